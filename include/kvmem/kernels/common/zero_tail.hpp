#pragma once
/// \file zero_tail.hpp
/// Zeros (fills) the padding of a ragged batch in an output tensor.

#include <Kokkos_Core.hpp>

namespace kvmem::kernels {

/// Writes zeros to y[b, h, t, :] for every t >= lengths(b): y [B, H, T, C] (any layout), lengths [B] a
/// device view of token counts.
template <class ExecSpace, class Out, class Lengths>
void zero_tail(const ExecSpace& exec, const Out& y, const Lengths& lengths) {
  const long B = static_cast<long>(y.extent(0)), H = static_cast<long>(y.extent(1)), T = static_cast<long>(y.extent(2));
  const long C = static_cast<long>(y.extent(3)), n = B * H * T;
  if (n == 0) return;
  Kokkos::parallel_for(
      "kvmem::zero_tail", Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<long>>(exec, 0, n),
      KOKKOS_LAMBDA(const long idx) {
        const long t = idx % T, h = (idx / T) % H, b = idx / (T * H);
        if (t < lengths(b)) return;
        for (long c = 0; c < C; ++c) y(b, h, t, c) = typename Out::non_const_value_type{};  // +0 in any storage type
      });
}

/// Writes `value` to x[b, h, t] for every t >= lengths(b): x [B, H, T] (any layout; e.g. the log-sum-exp
/// -inf of a query that reads no key), lengths [B] a device view of token counts.
template <class ExecSpace, class Out, class Lengths>
void fill_tail(const ExecSpace& exec, const Out& x, const Lengths& lengths, typename Out::non_const_value_type value) {
  const long B = static_cast<long>(x.extent(0)), H = static_cast<long>(x.extent(1)), T = static_cast<long>(x.extent(2));
  const long n = B * H * T;
  if (n == 0) return;
  Kokkos::parallel_for(
      "kvmem::fill_tail", Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<long>>(exec, 0, n),
      KOKKOS_LAMBDA(const long idx) {
        const long t = idx % T, h = (idx / T) % H, b = idx / (T * H);
        if (t >= lengths(b)) x(b, h, t) = value;
      });
}

}  // namespace kvmem::kernels
