#pragma once
/// \file vector_ops.hpp
/// Scalar building blocks called by one thread inside kvmem kernels: dot product, L2 norm, layer norm.
/// Each sums in a fixed order, so a result has the same bits on every run of a backend. Inputs may be of
/// any storage type (float, bfloat16, float16: each element is read through to_float, exactly); every
/// sum is float32, and a float input gives the bits it gave before storage types existed.

#include <Kokkos_Core.hpp>

#include "../dtype.hpp"

namespace kvmem::kernels {

/// Negative infinity usable in device code.
KOKKOS_INLINE_FUNCTION constexpr float neg_inf() { return -__builtin_huge_valf(); }

/// a * b + c rounded once where the target has a fused multiply-add (x86 with FMA, ARM, GPUs) and
/// twice where it has none. Written out, so the rounding never depends on whether the compiler chose
/// to contract an expression (it may contract the same source differently in a vectorized loop, a
/// peeled iteration or another inlining context): kernels that must agree bit for bit across code paths
/// (one query or a block of queries, prefill or decode) use this for every multiply-add.
KOKKOS_INLINE_FUNCTION float mul_add(float a, float b, float c) {
#if defined(__FP_FAST_FMAF) || defined(FP_FAST_FMAF) || defined(__FMA__)
  return Kokkos::fma(a, b, c);
#else
  KOKKOS_IF_ON_DEVICE((return Kokkos::fma(a, b, c);))
  KOKKOS_IF_ON_HOST((return a * b + c;))
#endif
}

/// sum_c a[c] * b[c] over n channels, float accumulation, increasing c (each step one mul_add).
template <class A, class B>
KOKKOS_INLINE_FUNCTION float dot(const A* a, const B* b, int n) {
  float s = 0.0f;
  for (int c = 0; c < n; ++c) s = mul_add(to_float(a[c]), to_float(b[c]), s);
  return s;
}

/// dot(a, b, n) with `a` read at a stride, sum_c a[c * a_stride] * b[c]: the same chain (increasing c, one
/// mul_add a step, so the bits of dot), with the operands of four steps loaded before their multiply-adds,
/// so that a GPU thread waits on four loads at once rather than on each in turn (the spread readout's
/// logits, the eviction step's).
template <class A, class B>
KOKKOS_INLINE_FUNCTION float dot_ahead(const A* a, long a_stride, const B* b, int n) {
  float s = 0.0f;
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    const float a0 = to_float(a[c * a_stride]), a1 = to_float(a[(c + 1) * a_stride]),
                a2 = to_float(a[(c + 2) * a_stride]), a3 = to_float(a[(c + 3) * a_stride]);
    const float b0 = to_float(b[c]), b1 = to_float(b[c + 1]), b2 = to_float(b[c + 2]), b3 = to_float(b[c + 3]);
    s = mul_add(a0, b0, s);
    s = mul_add(a1, b1, s);
    s = mul_add(a2, b2, s);
    s = mul_add(a3, b3, s);
  }
  for (; c < n; ++c) s = mul_add(to_float(a[c * a_stride]), to_float(b[c]), s);
  return s;
}

/// s[r] = sum_c (g a[c]) * rows[r * stride + c] for r < NR: NR dot products of one vector with NR
/// consecutive rows, each summed in increasing c, one mul_add a step, exactly as `dot` of (g a) with
/// that row (g = 1 gives `dot`'s bits: g a[c] is exact). The NR chains are independent, so a thread
/// keeps NR multiply-adds in flight instead of waiting on every add of one chain (routing and the
/// novelty score read their rows this way; spec KVM.md §5.3, §5.5).
template <int NR, class Row>
KOKKOS_INLINE_FUNCTION void dot_rows(const float* a, float g, const Row* rows, long stride, int n, float* s) {
  for (int r = 0; r < NR; ++r) s[r] = 0.0f;
  for (int c = 0; c < n; ++c) {
    const float ga = g * a[c];
    for (int r = 0; r < NR; ++r) s[r] = mul_add(ga, to_float(rows[r * stride + c]), s[r]);
  }
}

/// ||a||_2 over n channels.
template <class A>
KOKKOS_INLINE_FUNCTION float norm2(const A* a, int n) {
  return Kokkos::sqrt(dot(a, a, n));
}

/// out = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias over n channels, biased variance (÷ n),
/// two-pass statistics, every multiply-add one mul_add (so the bits do not depend on how the compiler
/// vectorizes a caller: a 16-bit memory's LayerNorm of its widened keys is the float32 memory's, bit for
/// bit); channels [0, zero_prefix) of x are read as 0 (kvm-paper Sec. 4 LN_s with the
/// RoPE channels zeroed first, spec KVM.md §2). `out` may alias `x`; it receives the result rounded to its
/// storage type (from_float).
template <class In, class Out>
KOKKOS_INLINE_FUNCTION void layer_norm(const In* x, int n, int zero_prefix, const float* weight, const float* bias,
                                       float eps, Out* out) {
  float mean = 0.0f;
  for (int c = zero_prefix; c < n; ++c) mean += to_float(x[c]);
  mean /= static_cast<float>(n);
  float var = 0.0f;
  for (int c = 0; c < n; ++c) {
    const float d = (c < zero_prefix ? 0.0f : to_float(x[c])) - mean;
    var = mul_add(d, d, var);
  }
  var /= static_cast<float>(n);
  const float inv = 1.0f / Kokkos::sqrt(var + eps);
  for (int c = 0; c < n; ++c) {
    const float xc = c < zero_prefix ? 0.0f : to_float(x[c]);
    out[c] = from_float<Out>(mul_add((xc - mean) * inv, weight[c], bias[c]));
  }
}

}  // namespace kvmem::kernels
