#pragma once
/// \file engine_buffers.hpp
/// Example helper: an engine's [tokens, heads, channels] host buffers seen as kvmem's (sequence, head,
/// token, channel) views with strides, without a copy.

#include <Kokkos_Core.hpp>
#include <random>
#include <vector>

namespace example {

using space = Kokkos::DefaultHostExecutionSpace::memory_space;
using tokens_view = Kokkos::View<float****, Kokkos::LayoutStride, space, Kokkos::MemoryUnmanaged>;

/// Tokens [t0, t0 + tokens) of a [T, heads, dim] buffer as a [1, heads, tokens, dim] view (no copy).
inline tokens_view wrap(float* data, long t0, long tokens, long heads, long dim) {
  const Kokkos::LayoutStride layout(1, 0, heads, dim, tokens, heads * dim, dim, 1);
  return tokens_view(data + t0 * heads * dim, layout);
}

/// Tokens [t0, t0 + tokens) of a [T, heads] buffer of per-token scalars (merge gates) as [1, heads, tokens].
inline Kokkos::View<float***, Kokkos::LayoutStride, space, Kokkos::MemoryUnmanaged> wrap_scalar(float* data, long t0,
                                                                                                 long tokens, long heads) {
  const Kokkos::LayoutStride layout(1, 0, heads, 1, tokens, heads);
  return Kokkos::View<float***, Kokkos::LayoutStride, space, Kokkos::MemoryUnmanaged>(data + t0 * heads, layout);
}

/// A [T, heads, dim] buffer of standard normal values.
inline std::vector<float> random_buffer(std::mt19937& rng, long T, long heads, long dim) {
  std::normal_distribution<float> normal;
  std::vector<float> x(T * heads * dim);
  for (auto& e : x) e = normal(rng);
  return x;
}

}  // namespace example
