#pragma once
/// \file softmax_exp.hpp
/// The float32 softmax exponential of the readouts (state rows, window, exact attention, the eviction
/// step's readout) and of row attention: one float form and, lane by lane the same bits, a register-vector
/// form. (The float64 statistics of the eviction step and SnapKV use Kokkos::exp.)

#include <Kokkos_Core.hpp>

#include "simd.hpp"
#include "vector_ops.hpp"

namespace kvmem::kernels {

/// c ? a : b through integer masks: a select the compiler vectorizes even where it keeps floating-point
/// exceptions exact (GCC's default -ftrapping-math turns float selects around FP arithmetic into branches).
KOKKOS_INLINE_FUNCTION float select_bits(bool c, float a, float b) {
  const unsigned mask = 0u - static_cast<unsigned>(c);
  return Kokkos::bit_cast<float>((Kokkos::bit_cast<unsigned>(a) & mask) | (Kokkos::bit_cast<unsigned>(b) & ~mask));
}

namespace detail {
// The operations of softmax_exp on one float and, lane by lane the same, on a register vector of floats.
KOKKOS_FORCEINLINE_FUNCTION float splat(float, float c) { return c; }
KOKKOS_FORCEINLINE_FUNCTION float fma_of(float a, float b, float c) { return mul_add(a, b, c); }
KOKKOS_FORCEINLINE_FUNCTION float pick(bool c, float a, float b) { return select_bits(c, a, b); }
KOKKOS_FORCEINLINE_FUNCTION int bits_of(float x) { return Kokkos::bit_cast<int>(x); }
KOKKOS_FORCEINLINE_FUNCTION float float_of(int x) { return Kokkos::bit_cast<float>(x); }
KOKKOS_FORCEINLINE_FUNCTION simd::vec splat(const simd::vec&, float c) { return simd::broadcast(c); }
KOKKOS_FORCEINLINE_FUNCTION simd::vec fma_of(const simd::vec& a, const simd::vec& b, const simd::vec& c) {
  return simd::fma(a, b, c);
}
KOKKOS_FORCEINLINE_FUNCTION simd::vec pick(const simd::ivec& m, const simd::vec& a, const simd::vec& b) {
  return simd::select(m, a, b);
}
KOKKOS_FORCEINLINE_FUNCTION simd::ivec bits_of(const simd::vec& x) { return simd::as_int(x); }
KOKKOS_FORCEINLINE_FUNCTION simd::vec float_of(const simd::ivec& x) { return simd::as_float(x); }
}  // namespace detail

/// exp(x) for the softmax, where x = logit - running max <= 0 (or -inf): Cody-Waite reduction by ln 2
/// and a degree-6 polynomial (Cephes expf): within 1 ulp of glibc expf on [-86, 0], 0 below -87, NaN for
/// NaN. Plain arithmetic (mul_add, integer bit operations, select_bits; simd::fma and simd::select on a
/// vector). F is float, or a register vector
/// of floats on a CPU (simd::vec: QueryBlock::softmax_lanes), whose every lane gives the float call's bits.
template <class F>
KOKKOS_FORCEINLINE_FUNCTION F softmax_exp(F x) {
  using detail::fma_of, detail::pick, detail::splat;
  const auto in_range = x > splat(x, -87.0f);  // false for -inf, NaN and underflow
  F xc = pick(in_range, x, splat(x, -87.0f));
  xc = pick(xc < splat(x, 88.0f), xc, splat(x, 88.0f));
  const F magic = splat(x, 12582912.0f);  // 1.5 * 2^23: t's low mantissa bits hold round(x / ln 2)
  const F t = fma_of(xc, splat(x, 1.44269504088896341f), magic);
  const F n = t - magic;
  F r = fma_of(n, splat(x, -0.693359375f), xc);  // ln 2 = 0.693359375 - 2.12194440e-4, hi part exact in n
  r = fma_of(n, splat(x, 2.12194440e-4f), r);
  F poly = splat(x, 1.9875691500e-4f);
  poly = fma_of(poly, r, splat(x, 1.3981999507e-3f));
  poly = fma_of(poly, r, splat(x, 8.3334519073e-3f));
  poly = fma_of(poly, r, splat(x, 4.1665795894e-2f));
  poly = fma_of(poly, r, splat(x, 1.6666665459e-1f));
  poly = fma_of(poly, r, splat(x, 5.0000001201e-1f));
  const F e = fma_of(poly, r * r, r) + splat(x, 1.0f);
  const auto n_int = detail::bits_of(t) - detail::bits_of(magic);
  const F result = e * detail::float_of((n_int + 127) << 23);
  return pick(in_range, result, pick(x == x, splat(x, 0.0f), x));
}

}  // namespace kvmem::kernels
