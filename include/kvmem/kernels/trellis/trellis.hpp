#pragma once
/// \file trellis.hpp
/// Kernels of the Trellis memory: the chunks of the two-pass stale-gradient compress for a batch
/// (trellis-paper eqs. 9-14; spec TRELLIS.md §3.2, corrected chunkwise form §3.3, two passes §4).
///
/// A chunk of sequence b covers input tokens [first, first + L_b) with L_b = min(chunk, max(0, len_b - first)).
/// One launch for every chunk of a call (trellis_chunks: a team per (sequence, head) walks its chunks),
/// three passes per chunk with a team barrier after each, each output element computed by one thread in a
/// fixed order (no atomics):
///   1. trellis_gradient: u1_r = grad_scale J^T(phi(S1 k_r) - alpha_r), u2_r = grad_scale J^T(phi(S2 v_r) - alpha_r)
///      at the stale states S1, S2 = M1, M2 before the chunk (§2.2, §3.2, §7 A11);
///   2. trellis_readout: per token r, pass 1 yhat_r = mu_r S1 q_r - sum_{i<=r} Gam[r,i] (q_r.k_i) u1_i,
///      p_r = f(yhat_r), pass 2 y_r = phi(mu2_r S2^T p_r - sum_{i<=r} Gam2[r,i] (p_r.u2_i) v_i) (§3.3);
///   3. trellis_state_element: S <- mu_{L-1} S - sum_i gamma_i omega[L-1,i] u_i key_i^T (§3.3 end state;
///      pass 1 stores the rows gamma_i omega[L-1,i] u_i).
/// omega[r,i] = prod_{j=i+1..r} beta_j is a running product walked from i = r down to 0, and mu_r is
/// that walk continued through beta_0: nothing is ever divided by a product of betas, so beta = 0 (erase)
/// is exact. A decode step is the same kernel with chunk = 1 (then omega = 1, mu = beta and the
/// readout mu S q - gamma (q.k) u equals M_t q of the recurrence §3.1), so prefill with C = 1 and decode
/// give the same bits.

#include <Kokkos_Core.hpp>
#include <string>
#include <type_traits>

#include "../../policy/merge/gradient_descent.hpp"
#include "../../token_checks.hpp"
#include "../../trellis_config.hpp"
#include "../plan/step_launch.hpp"
#include "../common/team_size.hpp"
#include "../../math/vector_ops.hpp"
#include "../common/zero_tail.hpp"

namespace kvmem::kernels {

/// The TrellisConfig fields the kernels read, as a trivially copyable value for device lambdas.
struct TrellisParams {
  int m = 0, D = 0, Dv = 0, H = 0;
  long chunk = 1;
  merge::Phi phi = merge::Phi::silu;
  merge::Activation f = merge::Activation::ln_silu;
  bool readout2_phi = true;
  float grad_scale = 2.0f, ln_eps = 1e-5f, l2_eps = 1e-12f;

  /// Copies the fields of `cfg`; `chunk` is the C of the launch (cfg.chunk in prefill, 1 in decode).
  static TrellisParams of(const TrellisConfig& cfg, long chunk) {
    TrellisParams p;
    p.m = cfg.slots, p.D = cfg.head_dim, p.Dv = cfg.value_dim, p.H = cfg.heads, p.chunk = chunk;
    p.phi = cfg.phi, p.f = cfg.f, p.readout2_phi = cfg.readout2_phi;
    p.grad_scale = cfg.grad_scale, p.ln_eps = cfg.ln_eps, p.l2_eps = cfg.l2_eps;
    return p;
  }
};

/// Tokens of the chunk starting at input token `first` for a sequence of `length` tokens: in [0, chunk].
KOKKOS_INLINE_FUNCTION long chunk_tokens(long length, long first, long chunk) {
  const long left = length - first;
  return left <= 0 ? 0 : (left < chunk ? left : chunk);
}

/// Memories of a batch: M1 [B, H, m, D] and M2 [B, H, m, Dv], slot-major (spec TRELLIS.md §6 layout).
template <class MemorySpace>
struct TrellisState {
  Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace> m1, m2;
};

/// Per-chunk scratch, each [B, H, capacity, m] with capacity >= the tokens of a chunk: U1, U2 (loss
/// gradients at the stale states), G1, G2 (the same rows scaled for the end state,
/// g_i = gamma_i omega[L-1, i] u_i) and P (f of the pass-1 readout); Y [B, H, capacity, Dv], the float32
/// readout of a chunk before it is rounded to an output of a 16-bit storage type (empty for float).
template <class MemorySpace>
struct TrellisScratch {
  Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace> u1, u2, g1, g2, p, y;

  [[nodiscard]] long capacity() const { return static_cast<long>(u1.extent(2)); }
  /// Makes room for chunks of `tokens` tokens (reallocates only to grow; contents are not kept), with Y
  /// for `value_dim` channels (0: no Y).
  void reserve(long batch, long heads, long tokens, long slots, long value_dim) {
    if (tokens <= capacity() && u1.data() != nullptr) return;
    const auto alloc = [](const char* n) { return Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(n)); };
    u1 = decltype(u1)(alloc("kvmem::trellis_u1"), batch, heads, tokens, slots);
    u2 = decltype(u2)(alloc("kvmem::trellis_u2"), batch, heads, tokens, slots);
    g1 = decltype(g1)(alloc("kvmem::trellis_g1"), batch, heads, tokens, slots);
    g2 = decltype(g2)(alloc("kvmem::trellis_g2"), batch, heads, tokens, slots);
    p = decltype(p)(alloc("kvmem::trellis_p"), batch, heads, tokens, slots);
    if (value_dim > 0) y = decltype(y)(alloc("kvmem::trellis_y"), batch, heads, tokens, value_dim);
  }
};

/// The runtime inputs of a call, in (sequence, head, token, channel) order with unit channel stride:
/// q, k [B, H, T, D], v [B, H, T, Dv], alpha [B, H, T, m]; gates beta1, gamma1, beta2, gamma2 [B, H, T];
/// all of one storage type (kvmem/dtype.hpp), read through to_float.
template <class Tokens, class Gates>
struct TrellisInputs {
  Tokens q, k, v, alpha;
  Gates beta1, gamma1, beta2, gamma2;

  /// Token t of every input ([B, H, 1, ...], the same strides, no copy; host only): the inputs of one
  /// decode step out of a prompt's (kvmem::AttentionMemory).
  [[nodiscard]] TrellisInputs token(long t) const {
    using kvmem::detail::token_slice;
    return {token_slice(q, t),     token_slice(k, t),      token_slice(v, t),     token_slice(alpha, t),
            token_slice(beta1, t), token_slice(gamma1, t), token_slice(beta2, t), token_slice(gamma2, t)};
  }
};

/// Pass 1 of a chunk, for local token r < L (input token t = first + r) of (b, h) and memory `pass`
/// (0: keys, 1: values):
///   u1[b,h,r] = grad_scale * J_phi(z)^T (phi(z) - alpha_t) with z = M1[b,h] k_t   (pass 0),
///   u2[b,h,r] = the same with z = M2[b,h] v_t                                     (pass 1)
/// (spec TRELLIS.md §2.2 at the stale state §3.2), and g[b,h,r] = (gamma_t omega[L-1, r]) u[b,h,r] with
/// omega[L-1, r] = beta_{L-1} ... beta_{r+1} multiplied in that order (the end-state weights of §3.3).
template <class MemorySpace, class Tokens, class Gates>
KOKKOS_INLINE_FUNCTION void trellis_gradient(const TrellisParams& prm, const TrellisState<MemorySpace>& st,
                                             const TrellisScratch<MemorySpace>& sc, const TrellisInputs<Tokens, Gates>& in,
                                             long b, long h, long first, long L, long r, int pass) {
  const long t = first + r;
  float* u = pass == 0 ? &sc.u1(b, h, r, 0) : &sc.u2(b, h, r, 0);
  const auto* key = pass == 0 ? &in.k(b, h, t, 0) : &in.v(b, h, t, 0);
  const int dim = pass == 0 ? prm.D : prm.Dv;
  for (int s = 0; s < prm.m; ++s) u[s] = dot(pass == 0 ? &st.m1(b, h, s, 0) : &st.m2(b, h, s, 0), key, dim);
  merge::GradientDescent::loss_gradient(prm.phi, u, &in.alpha(b, h, t, 0), prm.m, prm.grad_scale);
  float w = 1.0f;  // omega[L-1, r]
  for (long j = L - 1; j > r; --j) w *= to_float(pass == 0 ? in.beta1(b, h, first + j) : in.beta2(b, h, first + j));
  const float c = to_float(pass == 0 ? in.gamma1(b, h, t) : in.gamma2(b, h, t)) * w;
  float* g = pass == 0 ? &sc.g1(b, h, r, 0) : &sc.g2(b, h, r, 0);
  for (int s = 0; s < prm.m; ++s) g[s] = c * u[s];
}

/// Pass 2 of a chunk: the readouts of both memories for local token r of (b, h), with S1, S2 the states
/// before the chunk and omega/mu/Gam the running products of §3.3:
///   yhat_r = mu1_r (S1 q_r) - sum_{i<=r} gamma1_i omega1[r,i] (q_r . k_i) u1_i        [m]
///   p_r    = f(yhat_r)  (kept in scratch p)                                            [m]
///   y_r    = phi(mu2_r (S2^T p_r) - sum_{i<=r} gamma2_i omega2[r,i] (p_r . u2_i) v_i)  [Dv]
/// (phi only if readout2_phi). y [B, H, T, Dv] is written at token first + r, rounded once to its storage
/// type (summed in scratch Y for a 16-bit one). `ln_weight`/`ln_bias` are [m] or null.
template <class MemorySpace, class Tokens, class Gates, class Out>
KOKKOS_INLINE_FUNCTION void trellis_readout(const TrellisParams& prm, const TrellisState<MemorySpace>& st,
                                            const TrellisScratch<MemorySpace>& sc, const TrellisInputs<Tokens, Gates>& in,
                                            const float* ln_weight, const float* ln_bias, const Out& y, long b, long h,
                                            long first, long r) {
  using out_t = typename Out::non_const_value_type;
  const long t = first + r;
  const int m = prm.m, D = prm.D, Dv = prm.Dv;
  // Pass 1 (key memory): p <- yhat.
  float* p = &sc.p(b, h, r, 0);
  const auto* q = &in.q(b, h, t, 0);
  for (int s = 0; s < m; ++s) p[s] = 0.0f;
  float w = 1.0f;  // omega1[r, i]
  for (long i = r; i >= 0; --i) {
    const float c = to_float(in.gamma1(b, h, first + i)) * w * dot(q, &in.k(b, h, first + i, 0), D);
    const float* ui = &sc.u1(b, h, i, 0);
    for (int s = 0; s < m; ++s) p[s] += c * ui[s];
    w *= to_float(in.beta1(b, h, first + i));
  }
  for (int s = 0; s < m; ++s) p[s] = w * dot(&st.m1(b, h, s, 0), q, D) - p[s];  // w = mu1_r
  merge::GradientDescent::activate(prm.f, p, m, prm.ln_eps, prm.l2_eps, ln_weight, ln_bias);
  // Pass 2 (value memory), query p: the float32 sums in y itself, or in scratch Y for a 16-bit output.
  constexpr bool direct = std::is_same_v<out_t, float>;
  float* out = direct ? reinterpret_cast<float*>(&y(b, h, t, 0)) : &sc.y(b, h, r, 0);
  for (int c = 0; c < Dv; ++c) out[c] = 0.0f;
  w = 1.0f;  // omega2[r, i]
  for (long i = r; i >= 0; --i) {
    const float c = to_float(in.gamma2(b, h, first + i)) * w * dot(p, &sc.u2(b, h, i, 0), m);
    const auto* vi = &in.v(b, h, first + i, 0);
    for (int ch = 0; ch < Dv; ++ch) out[ch] += c * to_float(vi[ch]);
    w *= to_float(in.beta2(b, h, first + i));
  }
  for (int ch = 0; ch < Dv; ++ch) {
    float sp = 0.0f;
    for (int s = 0; s < m; ++s) sp += p[s] * st.m2(b, h, s, ch);
    out[ch] = w * sp - out[ch];  // w = mu2_r
  }
  if (prm.readout2_phi) merge::GradientDescent::apply_phi(prm.phi, out, Dv);
  if (!direct)
    for (int ch = 0; ch < Dv; ++ch) y(b, h, t, ch) = from_float<out_t>(out[ch]);
}

/// Pass 3 of a chunk: element e of the end state of (b, h) (spec TRELLIS.md §3.3), e = s (D + Dv) + c:
///   c < D:  M1[b,h,s,c]     <- mu1 M1[b,h,s,c]     - sum_{i=L-1..0} g1[b,h,i,s] k_i[c]
///   else:   M2[b,h,s,c - D] <- mu2 M2[b,h,s,c - D] - sum_{i=L-1..0} g2[b,h,i,s] v_i[c - D]
/// with g = gamma_i omega[L-1,i] u_i from pass 1 and mu = beta_{L-1} ... beta_0 (mu1, mu2 given).
template <class MemorySpace, class Tokens, class Gates>
KOKKOS_INLINE_FUNCTION void trellis_state_element(const TrellisParams& prm, const TrellisState<MemorySpace>& st,
                                                  const TrellisScratch<MemorySpace>& sc,
                                                  const TrellisInputs<Tokens, Gates>& in, long b, long h, long first,
                                                  long L, float mu1, float mu2, long e) {
  const long s = e / (prm.D + prm.Dv), c = e % (prm.D + prm.Dv);
  float acc = 0.0f;
  if (c < prm.D) {
    for (long i = L - 1; i >= 0; --i) acc += sc.g1(b, h, i, s) * to_float(in.k(b, h, first + i, c));
    st.m1(b, h, s, c) = mu1 * st.m1(b, h, s, c) - acc;
  } else {
    const long cv = c - prm.D;
    for (long i = L - 1; i >= 0; --i) acc += sc.g2(b, h, i, s) * to_float(in.v(b, h, first + i, cv));
    st.m2(b, h, s, cv) = mu2 * st.m2(b, h, s, cv) - acc;
  }
}

/// Every chunk of input tokens [0, tokens) for a batch, in one kernel (kvmem::trellis; its label fits the
/// 15 characters a std::string holds without a heap allocation: Kokkos copies the label at every launch,
/// and a decode step must not allocate). A team per (sequence b, head h) (head_team_size threads) walks
/// the chunks first = 0, C, 2C, ... while L_b = chunk_tokens(lengths(b), first, C) > 0, and runs for each
/// the three passes above in order, each split over the team's threads with one thread per output element
/// summed in a fixed order (no atomics), a team barrier after each: gradients per (token, memory),
/// readouts per token, end state per (slot, channel). Sequences with L_b = 0 keep their state. `tokens` >=
/// every lengths(b) that is to be run (the longest); decode is tokens = 1 with C = 1.
template <class ExecSpace, class Tokens, class Gates, class Lengths, class Out, class Weights>
void trellis_chunks(const ExecSpace& exec, const TrellisParams& prm, const TrellisState<typename ExecSpace::memory_space>& st,
                    const TrellisScratch<typename ExecSpace::memory_space>& sc, const TrellisInputs<Tokens, Gates>& in,
                    const Weights& ln_weight, const Weights& ln_bias, const Out& y, const Lengths& lengths, long tokens) {
  const long B = static_cast<long>(lengths.extent(0)), H = prm.H;
  if (B * H == 0 || tokens <= 0) return;
  const float* lnw = ln_weight.data();
  const float* lnb = ln_bias.data();
  using policy_t = Kokkos::TeamPolicy<ExecSpace, step_launch>;
  using member_t = typename policy_t::member_type;
  const long elements = static_cast<long>(prm.m) * (prm.D + prm.Dv);
  const auto body = KOKKOS_LAMBDA(const member_t& team) {
    const long h = team.league_rank() % H, b = team.league_rank() / H;
    for (long first = 0; first < tokens; first += prm.chunk) {
      const long L = chunk_tokens(lengths(b), first, prm.chunk);
      if (L == 0) break;  // the whole team: this and every later chunk are past the sequence
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, 2 * L), [&](long x) {
        trellis_gradient(prm, st, sc, in, b, h, first, L, x / 2, static_cast<int>(x % 2));
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, L),
                           [&](long r) { trellis_readout(prm, st, sc, in, lnw, lnb, y, b, h, first, r); });
      team.team_barrier();
      float mu1 = 1.0f, mu2 = 1.0f;
      for (long i = L - 1; i >= 0; --i) {
        mu1 *= to_float(in.beta1(b, h, first + i));
        mu2 *= to_float(in.beta2(b, h, first + i));
      }
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, elements), [&](long e) {
        trellis_state_element(prm, st, sc, in, b, h, first, L, mu1, mu2, e);
      });
      team.team_barrier();
    }
  };
  // On GPUs the state pass (m (D + Dv) elements) sizes the team; on CPU threads the threads per head.
  const int most = policy_t(exec, B * H, 1).team_size_max(body, Kokkos::ParallelForTag());
  Kokkos::parallel_for("kvmem::trellis", policy_t(exec, B * H, head_team_size(exec, B * H, elements, most)), body);
}

/// The first out-of-range gate in the order beta1, gamma1, beta2, gamma2, then (b, h, t), among tokens
/// t < lengths(b): a beta outside [0, 1] or a gamma that is negative or not finite (NaN included), as the
/// flat index ((g * B + b) * H + h) * T + t with g the gate's position in that order; -1 when all are good.
/// `first_bad` is a device scalar the caller owns (overwritten). Blocks until the result is on the host
/// (one device-to-host read of 8 bytes). A parallel_for with an atomic minimum (order-independent, so
/// deterministic) rather than a parallel_reduce into a host scalar: that one builds a fence message on the
/// heap at every call, and a decode step must not allocate.
template <class ExecSpace, class Tokens, class Gates, class Lengths>
long trellis_first_bad_gate(const ExecSpace& exec, const TrellisInputs<Tokens, Gates>& in, const Lengths& lengths,
                            long H, long T, const Kokkos::View<long, typename ExecSpace::memory_space>& first_bad) {
  const long B = static_cast<long>(lengths.extent(0)), n = 4 * B * H * T;
  if (n == 0) return -1;
  using host_scalar = Kokkos::View<long, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  long result = n;  // copied from a view, not filled from a value: a fill launches a kernel with a long label
  Kokkos::deep_copy(exec, first_bad, host_scalar(&result));
  Kokkos::parallel_for(
      "kvmem::tr_gates", Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<long>>(exec, 0, n),
      KOKKOS_LAMBDA(const long idx) {
        const long t = idx % T, h = (idx / T) % H, b = (idx / (T * H)) % B, g = idx / (T * H * B);
        if (t >= lengths(b)) return;
        const float x = to_float(g == 0 ? in.beta1(b, h, t) : g == 1 ? in.gamma1(b, h, t) : g == 2 ? in.beta2(b, h, t) : in.gamma2(b, h, t));
        const bool ok = g % 2 == 0 ? (x >= 0.0f && x <= 1.0f) : (x >= 0.0f && Kokkos::isfinite(x));
        if (!ok) Kokkos::atomic_min(&first_bad(), idx);
      });
  Kokkos::deep_copy(exec, host_scalar(&result), first_bad);
  static const std::string read = "kvmem::tr_gates read";  // our own label: Kokkos' default is a heap string
  exec.fence(read);
  return result < n ? result : -1;
}

}  // namespace kvmem::kernels
