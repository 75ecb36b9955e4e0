#pragma once
/// \file trellis_inputs.hpp
/// Trellis's runtime inputs made from a captured layer that has none of them (spec TRELLIS.md §1, §5).
///
/// A Trellis layer reads q, k, v, a latent target alpha_t = W_alpha x_t [m] and four gates from its own
/// trained projections; a layer of a model trained without Trellis (every capture of tools/capture) has
/// q, k, v only. kvmem-eval stands in for the missing pieces with untrained values, the same for every
/// input and fraction, and says so in the report:
///   - q, k, v: L2-normalized per head and token, x / max(||x||, 1e-12) (spec §5 recommends normalizing all
///     three; gamma * ||k||^2 and gamma * ||v||^2 stay O(1)). With GQA (Hq > Hkv) every query head reads the
///     keys and values of its kv-head h / (Hq / Hkv), and has its own memory.
///   - alpha_t = R khat_t [m]: a fixed random projection standing in for an untrained W_alpha (linear, no
///     activation, spec §1). R [m, D] has entries +1 or -1 (the top bit of the (i*D + j + 1)-th output of
///     splitmix64 seeded with trellis_alpha_seed: set -> -1), the same for every head, so each component of
///     alpha has unit variance for a unit key.
///   - beta1 = beta2 = gamma1 = gamma2 = sigmoid(0) = 1/2 at every token: the gates of spec §5,
///     sigmoid(w . x + b), with zero pre-activation (as the captures' KVM gate z = 0), the same arrays for
///     both passes (spec §5 default).

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>

#include <kvmem/dtype.hpp>
#include <kvmem/math/vector_ops.hpp>

#include "memory_kind.hpp"

namespace kvmem::tools::eval {

inline constexpr std::uint64_t trellis_alpha_seed = 0x6b766d656d2d6576ULL;  ///< "kvmem-ev"
inline constexpr float trellis_untrained_gate = 0.5f;                         ///< sigmoid(0)

/// Trellis inputs for the whole batch, device views in storage type T (float, kvmem::bfloat16 or
/// kvmem::float16): computed in float32 from the float32 tokens, then rounded to T once (from_float).
template <StorageType T>
struct TrellisInputs {
  Kokkos::View<T****, Kokkos::LayoutRight, mem_space> q, k;  ///< [B, Hq, T, D], unit rows
  Kokkos::View<T****, Kokkos::LayoutRight, mem_space> v;     ///< [B, Hq, T, Dv], unit rows
  Kokkos::View<T****, Kokkos::LayoutRight, mem_space> alpha; ///< [B, Hq, T, m]
  Kokkos::View<T***, Kokkos::LayoutRight, mem_space> forget; ///< beta1 = beta2 [B, Hq, T]
  Kokkos::View<T***, Kokkos::LayoutRight, mem_space> step;   ///< gamma1 = gamma2 [B, Hq, T]
};

/// The (n+1)-th output of splitmix64 seeded with `seed` (Steele, Lea, Flood 2014), as java.util.SplittableRandom.
constexpr std::uint64_t splitmix64(std::uint64_t seed, std::uint64_t n) {
  std::uint64_t z = seed + (n + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The projection R [m, D] of alpha = R khat: entry (i, j) is -1 when the top bit of splitmix64(seed, i*D + j)
/// is set, +1 otherwise.
inline Kokkos::View<float**, Kokkos::LayoutRight, mem_space> trellis_alpha_projection(long m, long D) {
  Kokkos::View<float**, Kokkos::LayoutRight, mem_space> r("trellis_alpha_projection", m, D);
  auto h = Kokkos::create_mirror_view(r);
  for (long i = 0; i < m; ++i)
    for (long j = 0; j < D; ++j)
      h(i, j) = (splitmix64(trellis_alpha_seed, static_cast<std::uint64_t>(i * D + j)) >> 63) ? -1.0f : 1.0f;
  Kokkos::deep_copy(r, h);
  return r;
}

/// out = x / max(||x||_2, 1e-12) over n contiguous channels, rounded to out's storage type.
template <class Out>
KOKKOS_INLINE_FUNCTION void unit_vector(const float* x, Out* out, int n) {
  const float norm = kernels::norm2(x, n);
  const float inv = 1.0f / (norm > 1e-12f ? norm : 1e-12f);
  for (int c = 0; c < n; ++c) out[c] = from_float<Out>(x[c] * inv);
}

/// Makes the Trellis inputs of the float32 tokens `in` for m slots, in storage type S, as described in the
/// file comment: alpha is computed from the unit keys in float32 before they are rounded to S.
template <StorageType S>
TrellisInputs<S> make_trellis_inputs(const Inputs& in, long m) {
  const long B = in.B, H = in.Hq, T = in.T, group = in.Hq / in.Hkv;
  const int D = static_cast<int>(in.D), Dv = static_cast<int>(in.Dv);
  using tokens = decltype(TrellisInputs<S>::q);
  using gates = decltype(TrellisInputs<S>::forget);
  TrellisInputs<S> t{tokens("trellis_q", B, H, T, D),     tokens("trellis_k", B, H, T, D),
                     tokens("trellis_v", B, H, T, Dv),    tokens("trellis_alpha", B, H, T, m),
                     gates("trellis_forget", B, H, T),    gates("trellis_step", B, H, T)};
  Kokkos::deep_copy(t.forget, from_float<S>(trellis_untrained_gate));
  Kokkos::deep_copy(t.step, from_float<S>(trellis_untrained_gate));
  const auto R = trellis_alpha_projection(m, D);
  const auto q = in.q, k = in.k, v = in.v;
  const auto tq = t.q, tk = t.k, tv = t.v, alpha = t.alpha;
  // The unit keys in float32, for alpha (the same bits for every storage type).
  const Kokkos::View<float****, Kokkos::LayoutRight, mem_space> unit_k("trellis_unit_k", B, H, T, D);
  using range = Kokkos::RangePolicy<exec>;
  Kokkos::parallel_for("kvmem_eval::trellis_normalize", range(0, B * H * T), KOKKOS_LAMBDA(long idx) {
    const long s = idx % T, h = (idx / T) % H, b = idx / (T * H), g = h / group;
    unit_vector(&q(b, h, s, 0), &tq(b, h, s, 0), D);
    unit_vector(&k(b, g, s, 0), &unit_k(b, h, s, 0), D);
    for (int c = 0; c < D; ++c) tk(b, h, s, c) = from_float<S>(unit_k(b, h, s, c));
    unit_vector(&v(b, g, s, 0), &tv(b, h, s, 0), Dv);
  });
  Kokkos::parallel_for("kvmem_eval::trellis_alpha", range(0, B * H * T * m), KOKKOS_LAMBDA(long idx) {
    const long i = idx % m, s = (idx / m) % T, h = (idx / (m * T)) % H, b = idx / (m * T * H);
    float a = 0.0f;
    for (int c = 0; c < D; ++c) a += R(i, c) * unit_k(b, h, s, c);
    alpha(b, h, s, i) = from_float<S>(a);
  });
  Kokkos::fence();
  return t;
}

}  // namespace kvmem::tools::eval
