#pragma once
/// \file mlstm.hpp
/// score::MLstm — KVPOP's learned scorer: a per-kv-head mLSTM over the cached [k ; v], delayed scoring and a
/// per-head temporal decay (kvpop-paper Sec. 2, App. B, E; spec EVICTION.md §2-§4; numerics of
/// NX-AI/mlstm_kernels `native_step.py`).

#include <Kokkos_Core.hpp>
#include <type_traits>

#include "../../math/vector_ops.hpp"
#include "eviction_scorer.hpp"
#include "mlstm_weights.hpp"

namespace kvmem::score {

/// The normaliser of the mLSTM readout (spec EVICTION.md §3, Q4).
enum class MLstmNormalizer {
  xlstm,  ///< h = (q'^T C) / (max(|q' . n|, exp(-m)) + eps), q' = qf / sqrt(D) (mlstm_kernels; default)
  plain,  ///< h = (qf^T C) / (qf . n) (kvpop-paper App. B eq. 3)
};

namespace detail {
/// The mLSTM's loops on one thread: blocks(n, f) is f(0, n), one() runs f.
struct OneThread {
  template <class F>
  KOKKOS_INLINE_FUNCTION void blocks(int n, const F& f) const { f(0, n); }
  template <class F>
  KOKKOS_INLINE_FUNCTION void one(const F& f) const { f(); }
  template <class F>
  KOKKOS_INLINE_FUNCTION double one_value(const F& f) const { return f(); }
  KOKKOS_INLINE_FUNCTION void sync() const {}
};
/// The mLSTM's loops over a team: blocks(n, f) gives each thread single indices f(i, i + 1) (a team of one
/// thread, a CPU core's, takes f(0, n) as OneThread), one() runs f on one thread (one_value gives its
/// result to every thread), sync() is a team barrier.
template <class Team>
struct TeamThreads {
  const Team& team;
  template <class F>
  KOKKOS_INLINE_FUNCTION void blocks(int n, const F& f) const {
    if (team.team_size() == 1) {
      f(0, n);
      return;
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int i) { f(i, i + 1); });
  }
  template <class F>
  KOKKOS_INLINE_FUNCTION void one(const F& f) const {
    Kokkos::single(Kokkos::PerTeam(team), f);
  }
  template <class F>
  KOKKOS_INLINE_FUNCTION double one_value(const F& f) const {
    double r = 0.0;
    Kokkos::single(Kokkos::PerTeam(team), [&](double& x) { x = f(); }, r);
    return r;
  }
  KOKKOS_INLINE_FUNCTION void sync() const { team.team_barrier(); }
};
}  // namespace detail

/// KVPOP's mLSTM scorer, one recurrent state per (sequence, kv-head), its arithmetic and state in `Real`
/// (float32 by default, as every kernel; `double` gives the float64 twin that kvmem-soak compares it with,
/// docs/numerics.md "Eviction statistics") on float32 weights (spec EVICTION.md §3, §4, Q9). With x_t = [k_t ; v_t] (X = D + Dv channels, as cached), h = D / 2 and
/// HH(y) = [softmax(y) ; softmax(-y)] (Hedgehog, h -> D):
///   qf_t = HH(x_t W_q), kf_t = HH(x_t W_k) [D], vf_t = x_t W_v [h],
///   i~_t = c tanh((x_t . w_i + b_i) / c),  log f_t = logsigmoid(c tanh((x_t . w_f + b_f) / c)),
///   m_t = max(log f_t + m_{t-1}, i~_t),
///   C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i~_t - m_t) kf_t vf_t^T   [D, h],
///   n_t = exp(log f_t + m_{t-1} - m_t) n_{t-1} + exp(i~_t - m_t) kf_t          [D],
/// from C = 0, n = 0, m = 0. Token u is scored with the state after token u + w - 1 (delayed scoring, §2):
///   score_u = w_s . SiLU(h) + b_s with h from the normaliser (MLstmNormalizer).
/// Effective score (§4): log gamma_h = log 0.999 + sigmoid(theta_h) (log 0.999999 - log 0.999).
/// Soft cap c = `soft_cap` (15, the xLSTM default; <= 0 turns the cap off), eps = `eps` (1e-6).
///
/// The stabilizer m keeps the state update's exponentials at arguments <= 0 and, with the soft cap,
/// m >= -c, so float32 neither overflows nor loses the state to underflow over any stream length. The
/// score goes to the eviction step as a float64 statistic, where the decay term t log gamma (t up to 10^6
/// and beyond) is added in float64.
///
/// State (allocated by bind): C [B, Hkv, D, h], n [B, Hkv, D], m [B, Hkv], in Real, plus a work buffer
/// [B, Hkv, D + h + 2]. absorb and delayed_score come in two forms, one thread or a team's threads
/// (the eviction step's), with the same bits. bind() throws kvmem::invalid_argument naming a missing or misshapen weight.
template <class MemorySpace, class Real = float>
struct MLstm : EvictionDefaults {
  static_assert(std::is_floating_point_v<Real>, "MLstm: Real is float or double");
  static constexpr std::string_view name = "kvpop";
  static constexpr bool delayed = true;

  MLstmWeights<MemorySpace> weights;
  MLstmNormalizer normalizer = MLstmNormalizer::xlstm;
  double soft_cap = 15.0;
  double eps = 1e-6;

  Kokkos::View<Real****, Kokkos::LayoutRight, MemorySpace> C;
  Kokkos::View<Real***, Kokkos::LayoutRight, MemorySpace> n, work;
  Kokkos::View<Real**, Kokkos::LayoutRight, MemorySpace> m;
  int head_dim = 0, value_dim = 0;

  MLstm() = default;
  explicit MLstm(const MLstmWeights<MemorySpace>& w, MLstmNormalizer norm = MLstmNormalizer::xlstm)
      : weights(w), normalizer(norm) {}

  void bind(long batch, const EvictionConfig& cfg) {
    weights.validate(cfg);
    head_dim = cfg.head_dim;
    value_dim = cfg.value_dim;
    const int h = head_dim / 2;
    C = decltype(C)("kvmem::mlstm_C", batch, cfg.kv_heads, head_dim, h);
    n = decltype(n)("kvmem::mlstm_n", batch, cfg.kv_heads, head_dim);
    m = decltype(m)("kvmem::mlstm_m", batch, cfg.kv_heads);
    work = decltype(work)("kvmem::mlstm_work", batch, cfg.kv_heads, head_dim + h + 2);
  }
  void reset() const {
    Kokkos::deep_copy(C, Real(0));
    Kokkos::deep_copy(n, Real(0));
    Kokkos::deep_copy(m, Real(0));
  }
  /// reset() for sequence b alone (its C, n and m; the other sequences' stay).
  void reset_sequence(long b) const {
    const typename MemorySpace::execution_space exec;
    const auto all = Kokkos::ALL;
    Kokkos::deep_copy(exec, Kokkos::subview(C, b, all, all, all), Real(0));
    Kokkos::deep_copy(exec, Kokkos::subview(n, b, all, all), Real(0));
    Kokkos::deep_copy(exec, Kokkos::subview(m, b, all), Real(0));
    exec.fence();
  }

  /// Absorbs token t into the state of (b, h); returns 0 (the score comes later, delayed_score). One thread.
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION double absorb(long b, int h, long, const K* key, const V* value) const {
    absorb_with(detail::OneThread{}, b, h, key, value);
    return 0.0;
  }
  /// absorb() spread over a team's threads (the eviction step calls it with every thread of the team; the
  /// same bits as one thread). Returns 0 to every thread; ends with a team barrier.
  template <class Team, class K, class V>
  KOKKOS_INLINE_FUNCTION double absorb(const Team& team, long b, int h, long, const K* key, const V* value) const {
    absorb_with(detail::TeamThreads<Team>{team}, b, h, key, value);
    return 0.0;
  }

  /// score_u of token u (key_u, value_u as cached) read from the current state of (b, h). One thread.
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION double delayed_score(long b, int h, long, const K* key, const V* value) const {
    return score_with(detail::OneThread{}, b, h, key, value);
  }
  /// delayed_score() spread over a team's threads (the same bits as one thread), the score given to every
  /// thread; ends with a team barrier.
  template <class Team, class K, class V>
  KOKKOS_INLINE_FUNCTION double delayed_score(const Team& team, long b, int h, long, const K* key,
                                              const V* value) const {
    return score_with(detail::TeamThreads<Team>{team}, b, h, key, value);
  }

  KOKKOS_INLINE_FUNCTION double log_decay(int h) const {
    const double lo = Kokkos::log(0.999), hi = Kokkos::log(0.999999);
    return lo + (hi - lo) / (1.0 + Kokkos::exp(-static_cast<double>(weights.theta(h))));
  }

 private:
  // Both forms run every element's arithmetic in the same order, whichever thread takes it: a projection
  // output a sums x_j W[h, j, a] over j in order, a state row i updates its channels, a readout channel a
  // sums over i in order, each multiply-add written out (fma below); the Hedgehog normalizations, the
  // gates' dot products, q . n and the score's sum run on one thread. With one thread the loops over a run
  // innermost over contiguous weights and state (vector lanes on a CPU); a team gives each thread its own
  // a or i (coalesced on a GPU; the eviction step's teams have a vector length of 1).

  template <class Loops, class K, class V>
  KOKKOS_INLINE_FUNCTION void absorb_with(const Loops& loops, long b, int h, const K* key, const V* value) const {
    const int D = head_dim, hh = D / 2;
    Real* kf = &work(b, h, 0);
    Real* vf = &work(b, h, D);
    Real* gates = &work(b, h, D + hh);  // decay, gain
    project(loops, weights.w_k, h, key, value, kf);
    project(loops, weights.w_v, h, key, value, vf);
    loops.sync();
    loops.one([&] {
      hedgehog(kf);
      const Real i_gate = cap(dot_x(weights.w_i, h, key, value) + weights.b_i(h));
      const Real f_gate = cap(dot_x(weights.w_f, h, key, value) + weights.b_f(h));
      const Real log_f = Kokkos::fmin(f_gate, Real(0)) - Kokkos::log1p(Kokkos::exp(-Kokkos::fabs(f_gate)));
      const Real m_prev = m(b, h);
      const Real m_new = Kokkos::fmax(log_f + m_prev, i_gate);
      gates[0] = Kokkos::exp(log_f + m_prev - m_new);
      gates[1] = Kokkos::exp(i_gate - m_new);
      m(b, h) = m_new;
    });
    loops.sync();
    const Real decay = gates[0], gain = gates[1];
    loops.blocks(D, [&](int i0, int i1) {
      for (int i = i0; i < i1; ++i) {
        const Real gk = gain * kf[i];
        Real* KOKKOS_RESTRICT row = &C(b, h, i, 0);
        const Real* KOKKOS_RESTRICT v = vf;
        for (int a = 0; a < hh; ++a) row[a] = fma(gk, v[a], decay * row[a]);
        n(b, h, i) = fma(decay, n(b, h, i), gk);
      }
    });
    loops.sync();
  }

  template <class Loops, class K, class V>
  KOKKOS_INLINE_FUNCTION double score_with(const Loops& loops, long b, int h, const K* key, const V* value) const {
    const int D = head_dim, hh = D / 2;
    Real* qf = &work(b, h, 0);
    Real* num = &work(b, h, D);
    project(loops, weights.w_q, h, key, value, qf);
    loops.sync();
    loops.one([&] { hedgehog(qf); });
    loops.sync();
    const bool xl = normalizer == MLstmNormalizer::xlstm;
    const Real qscale = xl ? Real(1) / Kokkos::sqrt(static_cast<Real>(D)) : Real(1);
    loops.blocks(hh, [&](int a0, int a1) {  // num[a] = sum_i qscale qf[i] C[i, a], i in order
      Real* KOKKOS_RESTRICT out = num;
      for (int a = a0; a < a1; ++a) out[a] = 0;
      for (int i = 0; i < D; ++i) {
        const Real qi = qscale * qf[i];
        const Real* KOKKOS_RESTRICT row = &C(b, h, i, 0);
        for (int a = a0; a < a1; ++a) out[a] = fma(qi, row[a], out[a]);
      }
    });
    loops.sync();
    const double score = loops.one_value([&] {
      Real qn = 0;
      for (int i = 0; i < D; ++i) qn = fma(qscale * qf[i], n(b, h, i), qn);
      const Real den = xl ? Kokkos::fmax(Kokkos::fabs(qn), Kokkos::exp(-m(b, h))) + static_cast<Real>(eps) : qn;
      Real sc = weights.b_s(h);
      for (int a = 0; a < hh; ++a) {
        const Real hv = num[a] / den;
        sc = fma(static_cast<Real>(weights.w_s(h, a)), hv / (Real(1) + Kokkos::exp(-hv)), sc);
      }
      return static_cast<double>(sc);
    });
    loops.sync();
    return score;
  }

  /// a * b + c, each multiply-add written out (kernels::mul_add in float32, a fused one in float64), so
  /// that no code path's bits depend on whether the compiler contracted an expression.
  static KOKKOS_INLINE_FUNCTION Real fma(Real a, Real b, Real c) {
    if constexpr (std::is_same_v<Real, float>) return kernels::mul_add(a, b, c);
    else return Kokkos::fma(a, b, c);
  }
  KOKKOS_INLINE_FUNCTION Real cap(Real z) const {
    const Real c = static_cast<Real>(soft_cap);
    return soft_cap > 0.0 ? c * Kokkos::tanh(z / c) : z;
  }
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION Real x_at(const K* key, const V* value, int j) const {
    return j < head_dim ? static_cast<Real>(to_float(key[j])) : static_cast<Real>(to_float(value[j - head_dim]));
  }
  template <class W, class K, class V>
  KOKKOS_INLINE_FUNCTION Real dot_x(const W& w, int h, const K* key, const V* value) const {
    Real s = 0;
    for (int j = 0; j < head_dim + value_dim; ++j) s = fma(x_at(key, value, j), static_cast<Real>(w(h, j)), s);
    return s;
  }
  /// out[a] = sum_j x_j W[h, j, a] in j order, a < D / 2 (the outputs spread over the loops' threads).
  template <class Loops, class W, class K, class V>
  KOKKOS_INLINE_FUNCTION void project(const Loops& loops, const W& w, int h, const K* key, const V* value,
                                      Real* out) const {
    loops.blocks(head_dim / 2, [&](int a0, int a1) {
      Real* KOKKOS_RESTRICT o = out;
      for (int a = a0; a < a1; ++a) o[a] = 0;
      for (int j = 0; j < head_dim + value_dim; ++j) {
        const Real xj = x_at(key, value, j);
        const float* KOKKOS_RESTRICT wj = &w(h, j, 0);
        for (int a = a0; a < a1; ++a) o[a] = fma(xj, static_cast<Real>(wj[a]), o[a]);
      }
    });
  }
  /// out [D] = HH(y) = [softmax(y) ; softmax(-y)] in place, y = out[0, D / 2).
  KOKKOS_INLINE_FUNCTION void hedgehog(Real* out) const {
    const int hh = head_dim / 2;
    Real hi = out[0], lo = out[0];
    for (int a = 1; a < hh; ++a) hi = Kokkos::fmax(hi, out[a]), lo = Kokkos::fmin(lo, out[a]);
    Real sp = 0, sn = 0;
    for (int a = 0; a < hh; ++a) {
      const Real y = out[a];
      out[a] = Kokkos::exp(y - hi);
      out[hh + a] = Kokkos::exp(lo - y);
      sp += out[a];
      sn += out[hh + a];
    }
    for (int a = 0; a < hh; ++a) out[a] /= sp, out[hh + a] /= sn;
  }
};

}  // namespace kvmem::score
