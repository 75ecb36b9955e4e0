#pragma once
/// \file dtype.hpp
/// The element types a memory can hold its tokens in (its storage type): float32, bfloat16 and float16,
/// with the conversions the kernels use. Arithmetic is always float32: a kernel converts a stored element
/// to float when it loads it (to_float) and rounds a float32 result once when it stores it (from_float).
///
/// Why kvmem has its own 16-bit types: Kokkos::Experimental::bhalf_t and half_t are 2-byte types only
/// where a backend provides one (Cuda, HIP, SYCL); in a Kokkos built for CPUs only (Debian's 5.2.2) both
/// are `float`, so they would neither halve the bytes of a cache nor round as an engine's bf16 does, and
/// a CPU run would differ from a GPU run. kvmem::bfloat16 and kvmem::float16 are two bytes on every
/// backend and have the bit layout of __nv_bfloat16 / __half, torch.bfloat16 / torch.float16 and the
/// safetensors dtypes BF16 / F16, so an engine's buffer is wrapped without a copy (reinterpret its data
/// pointer), and a conversion gives the same bits on every backend.

#include <Kokkos_Core.hpp>
#include <concepts>
#include <cstdint>
#include <string_view>

// x86 F16C (the host compiler's -mf16c, implied by -march=haswell and later): float16 <-> float32 in
// one instruction, through the compiler's _Float16 type, which the vectorizer also widens a whole register at
// a time. Never in device code: nvcc, hipcc and SYCL device passes take the portable form.
#if defined(__F16C__) && defined(__FLT16_MAX__) && !defined(__CUDACC__) && !defined(__HIPCC__) && \
    !defined(__SYCL_DEVICE_ONLY__) && (defined(__x86_64__) || defined(__i386__))
#define KVMEM_F16C 1
#endif

namespace kvmem {

/// bfloat16 (IEEE float32's sign and 8-bit exponent, 7 stored mantissa bits; unit roundoff 2^-8): the
/// 16 high bits of a float32. Construct from float with from_float<bfloat16>; read with to_float.
struct bfloat16 {
  std::uint16_t bits = 0;
};
/// IEEE 754 binary16 (5-bit exponent, 10 stored mantissa bits; unit roundoff 2^-11, largest finite value
/// 65,504). Construct from float with from_float<float16>; read with to_float.
struct float16 {
  std::uint16_t bits = 0;
};
static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2, "16-bit storage types are two bytes");

/// The storage types a memory accepts for its tokens (queries, keys, values, outputs, the window and the
/// read caches of its state): float, kvmem::bfloat16, kvmem::float16.
template <class T>
concept StorageType = std::same_as<T, float> || std::same_as<T, bfloat16> || std::same_as<T, float16>;

/// The name of a storage type as the tools and the safetensors format spell it: "F32", "BF16", "F16".
template <StorageType T>
inline constexpr std::string_view dtype_name = std::same_as<T, float> ? "F32" : std::same_as<T, bfloat16> ? "BF16" : "F16";

/// Unit roundoff of a storage type: half the distance from 1 to the next value (2^-24, 2^-8, 2^-11). The
/// bound of docs/numerics.md: a stored x is x (1 + d) with |d| <= unit_roundoff<T> (normal range).
template <StorageType T>
inline constexpr double unit_roundoff = std::same_as<T, float> ? 0x1p-24 : std::same_as<T, bfloat16> ? 0x1p-8 : 0x1p-11;

/// The value of a stored element as float32 (exact: every bfloat16 and float16 value is a float32 value).
KOKKOS_INLINE_FUNCTION float to_float(float x) { return x; }
KOKKOS_INLINE_FUNCTION float to_float(bfloat16 x) { return Kokkos::bit_cast<float>(static_cast<std::uint32_t>(x.bits) << 16); }
namespace detail {
/// The float32 value of the float16 bit pattern `bits`, from the format's definition (portable, any
/// backend): normal numbers rebias the exponent (15 -> 127), subnormals are mantissa * 2^-24 (exact in
/// float32), Inf stays Inf and a NaN comes back quiet with its payload (as the CPUs' and GPUs' conversion
/// instructions give it). Selects rather than branches, so a loop of them vectorizes.
KOKKOS_INLINE_FUNCTION float widen_float16(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = bits & 0x7c00u, mantissa = bits & 0x3ffu;
  const std::uint32_t normal = (static_cast<std::uint32_t>(bits & 0x7fffu) << 13) + (112u << 23);
  const std::uint32_t special = 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u);
  const std::uint32_t subnormal = Kokkos::bit_cast<std::uint32_t>(static_cast<float>(mantissa) * 0x1p-24f);
  const std::uint32_t magnitude = exponent == 0x7c00u ? special : exponent == 0 ? subnormal : normal;
  return Kokkos::bit_cast<float>(sign | magnitude);
}
}  // namespace detail

/// The value of a stored float16 as float32 (exact): the F16C instruction where the compiler targets it
/// (KVMEM_F16C), detail::widen_float16 otherwise; both give the same bits (tests/unit/test_storage_types.cpp
/// checks every bit pattern, in the portable build and the -march=native one).
KOKKOS_INLINE_FUNCTION float to_float(float16 x) {
#if defined(KVMEM_F16C)
  return static_cast<float>(Kokkos::bit_cast<_Float16>(x.bits));
#else
  return detail::widen_float16(x.bits);
#endif
}

namespace detail {
KOKKOS_INLINE_FUNCTION bfloat16 round_to_bfloat16(float x) {
  const std::uint32_t u = Kokkos::bit_cast<std::uint32_t>(x), magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return {static_cast<std::uint16_t>((u >> 16) | 0x0040u)};  // NaN stays NaN (quiet)
  if (magnitude == 0x7f800000u) return {static_cast<std::uint16_t>(u >> 16)};             // +-Inf
  if (magnitude >= 0x7f7f8000u) return {static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7f7fu)};  // saturate
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // to nearest, ties to even
  return {static_cast<std::uint16_t>((u + rounding) >> 16)};
}
KOKKOS_INLINE_FUNCTION float16 round_to_float16(float x) {
  const std::uint32_t u = Kokkos::bit_cast<std::uint32_t>(x), magnitude = u & 0x7fffffffu;
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  if (magnitude > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu))};
  if (magnitude == 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};
  // 65,520 and above would round to Inf: a finite value saturates to the largest finite float16.
  if (magnitude >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7bffu)};
  if (magnitude < 0x38800000u) {
    // Below 2^-14 (float16's smallest normal): the result is a multiple of 2^-24. Adding 0.5 puts |x| in
    // [0.5, 1), where float32's spacing is 2^-24, so the addition itself rounds to nearest, ties to even;
    // the low bits of the sum are then the float16 mantissa (1024 reads as the smallest normal).
    const float shifted = Kokkos::bit_cast<float>(magnitude) + 0.5f;
    return {static_cast<std::uint16_t>(sign | (Kokkos::bit_cast<std::uint32_t>(shifted) - 0x3f000000u))};
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t odd = (magnitude >> 13) & 1u;
  const std::uint32_t rebiased = magnitude - (112u << 23) + 0xfffu + odd;
  return {static_cast<std::uint16_t>(sign | (rebiased >> 13))};
}
}  // namespace detail

/// x rounded to the storage type T: to nearest, ties to even; NaN stays NaN and +-Inf stays +-Inf; a
/// finite value beyond T's range saturates to T's largest finite value of its sign (float16: 65,504;
/// bfloat16: 3.3895e38), so storing never turns a finite number into Inf (docs/numerics.md).
template <StorageType T>
KOKKOS_INLINE_FUNCTION T from_float(float x) {
  if constexpr (std::same_as<T, float>)
    return x;
  else if constexpr (std::same_as<T, bfloat16>)
    return detail::round_to_bfloat16(x);
  else {
#if defined(KVMEM_F16C)
    // The conversion instruction rounds to nearest even but overflows to Inf: saturate first (65,520 and
    // above, as round_to_float16); NaN, Inf and everything below convert as there.
    const std::uint32_t magnitude = Kokkos::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
    if (magnitude >= 0x477ff000u && magnitude < 0x7f800000u)
      return {static_cast<std::uint16_t>(((Kokkos::bit_cast<std::uint32_t>(x) >> 16) & 0x8000u) | 0x7bffu)};
    return {Kokkos::bit_cast<std::uint16_t>(static_cast<_Float16>(x))};
#else
    return detail::round_to_float16(x);
#endif
  }
}

/// Stores the float32 `x` at `out` rounded to the element type of `out` (from_float).
template <StorageType T>
KOKKOS_INLINE_FUNCTION void store(T* out, float x) {
  *out = from_float<T>(x);
}

}  // namespace kvmem
