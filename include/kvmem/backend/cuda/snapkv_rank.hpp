#pragma once
/// \file snapkv_rank.hpp
/// CUB fast path of SnapKV's ranking on Kokkos::Cuda: every (sequence, kv-head)'s prefix tokens sorted by
/// pooled score in one cub::DeviceSegmentedRadixSort call (the field's standard segmented top-k on NVIDIA
/// GPUs). kernels::snapkv_rank selects it with `if constexpr`; elsewhere the portable team sort runs, and
/// both give the same order (the ranking is a strict total order; see kernels/eviction/snapkv.hpp).

#include <Kokkos_Core.hpp>

#ifdef KOKKOS_ENABLE_CUDA
#include <cub/device/device_segmented_radix_sort.cuh>

#include <stdexcept>
#include <string>
#endif

namespace kvmem::backend::cuda {

/// Device buffers of the CUB ranking for B x Hkv segments of T tokens: nothing outside CudaSpace.
template <class MemorySpace>
struct SnapKvSortScratch {
  void allocate(long /*segments*/, long /*tokens*/) {}
};

#ifdef KOKKOS_ENABLE_CUDA
/// The CudaSpace buffers: keys and values in [segments * T] (token order reversed per segment), segment
/// bounds [segments], and CUB's temporary storage, sized once here so a ranking allocates nothing.
template <>
struct SnapKvSortScratch<Kokkos::CudaSpace> {
  Kokkos::View<double*, Kokkos::CudaSpace> keys_in, keys_out;
  Kokkos::View<long*, Kokkos::CudaSpace> values_in, segment_begin, segment_end;
  Kokkos::View<unsigned char*, Kokkos::CudaSpace> temp;

  /// Throws std::runtime_error with CUB's status if CUB cannot size its storage.
  void allocate(long segments, long tokens) {
    const long items = segments * tokens;
    keys_in = decltype(keys_in)("kvmem::snapkv_cub_keys_in", items);
    keys_out = decltype(keys_out)("kvmem::snapkv_cub_keys_out", items);
    values_in = decltype(values_in)("kvmem::snapkv_cub_values_in", items);
    segment_begin = decltype(segment_begin)("kvmem::snapkv_cub_begin", segments);
    segment_end = decltype(segment_end)("kvmem::snapkv_cub_end", segments);
    std::size_t bytes = 0;
    const cudaError_t status = cub::DeviceSegmentedRadixSort::SortPairsDescending(
        nullptr, bytes, keys_in.data(), keys_out.data(), values_in.data(), values_in.data(), items, segments,
        segment_begin.data(), segment_end.data());
    if (status != cudaSuccess)
      throw std::runtime_error(std::string("kvmem: cub::DeviceSegmentedRadixSort could not size its storage: ") +
                               cudaGetErrorString(status));
    temp = decltype(temp)("kvmem::snapkv_cub_temp", bytes > 0 ? bytes : 1);
  }
};

/// order(b, h, i), i < L_b - W: the prefix tokens of (b, h) by pooled score, highest first, ties to the newer
/// token, NaN after every number (as -inf) -- the order of kernels::snapkv_rank_portable. Segments that
/// keep every token (L_b <= W + top_k) are left untouched. pooled [B, Hkv, T] and order [B, Hkv, T]
/// LayoutRight CudaSpace views, lengths [B]. Stable radix sort on keys laid out newest token first gives
/// the tie rule; the keys' bits are sorted, so -0.0 is stored as +0.0 and NaN as -inf first.
template <class Pooled, class Lengths, class Order>
void snapkv_rank(const Kokkos::Cuda& exec, const Pooled& pooled, const Lengths& lengths, long window, long top_k,
                 const Order& order, const SnapKvSortScratch<Kokkos::CudaSpace>& s) {
  const long B = static_cast<long>(pooled.extent(0)), H = static_cast<long>(pooled.extent(1));
  const long T = static_cast<long>(pooled.extent(2)), segments = B * H;
  const auto keys_in = s.keys_in;
  const auto values_in = s.values_in;
  const auto begin = s.segment_begin;
  const auto end = s.segment_end;
  Kokkos::parallel_for(
      "kvmem::snapkv_cub_in", Kokkos::RangePolicy<Kokkos::Cuda>(exec, 0, segments * T), KOKKOS_LAMBDA(long idx) {
        const long j = idx % T, seg = idx / T, h = seg % H, b = seg / H;
        const long L = lengths(b), prefix = L <= window + top_k ? 0 : L - window;
        if (j == 0) {
          begin(seg) = seg * T;
          end(seg) = seg * T + prefix;
        }
        if (j >= prefix) return;
        const long t = prefix - 1 - j;  // newest first: the stable sort keeps ties newest first
        const double x = pooled(b, h, t);
        keys_in(idx) = x != x ? -Kokkos::Experimental::infinity_v<double> : (x == 0.0 ? 0.0 : x);
        values_in(idx) = t;
      });
  std::size_t bytes = s.temp.extent(0);
  const cudaError_t status = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      s.temp.data(), bytes, s.keys_in.data(), s.keys_out.data(), s.values_in.data(), order.data(), segments * T,
      segments, s.segment_begin.data(), s.segment_end.data(), 0, static_cast<int>(sizeof(double) * 8),
      exec.cuda_stream());
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("kvmem: cub::DeviceSegmentedRadixSort failed on the SnapKV scores: ") +
                             cudaGetErrorString(status));
}
#endif

}  // namespace kvmem::backend::cuda
