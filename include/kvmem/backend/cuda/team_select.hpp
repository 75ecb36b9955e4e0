#pragma once
/// \file team_select.hpp
/// CUB fast paths of kernels/common/team_select.hpp on Kokkos::Cuda: the lowest score of a range by
/// cub::WarpReduce (a warp's threads, then the warps' results in warp order), the ranks of a block's items by
/// cub::BlockRadixSort (stable, so ties keep index order). Both give the portable path's choice exactly:
/// keys are unsigned and compared with their index, a total order (tests/unit/test_team_select.cpp runs
/// both where a GPU is present). They apply where a Kokkos team is a whole CUDA block laid out as CUB's
/// collectives count threads (vector length 1, the team's threads along y); elsewhere the functions return
/// false and the caller takes the portable path. Everything here compiles to nothing without Cuda.

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#ifdef KOKKOS_ENABLE_CUDA
#include <cub/block/block_radix_sort.cuh>
#include <cub/warp/warp_reduce.cuh>
#endif

namespace kvmem::backend::cuda {

/// Alignment of the shared memory the selections use (bytes).
inline constexpr std::size_t select_align = 16;

/// Threads of a team that team_rank sorts with, and items per thread: blocks of up to 1,024 items.
inline constexpr int rank_team = 256, rank_items = 4;

/// The (key, index) pair of team_lowest; the lower key wins, then the lower index.
struct KeyIndex {
  std::uint64_t key;
  long index;
};
/// The order of team_lowest: a total order on (key, index), so every reduction tree picks the same pair.
struct LowerKeyIndex {
  KOKKOS_INLINE_FUNCTION KeyIndex operator()(const KeyIndex& a, const KeyIndex& b) const {
    return b.key < a.key || (b.key == a.key && b.index < a.index) ? b : a;
  }
};

#ifdef KOKKOS_ENABLE_CUDA
using RankSort = cub::BlockRadixSort<std::uint32_t, 1, rank_items, int, 4, true, cub::BLOCK_SCAN_WARP_SCANS,
                                     cudaSharedMemBankSizeFourByte, rank_team>;
using LowestWarp = cub::WarpReduce<KeyIndex>;
/// Shared memory of team_lowest: a warp reduction's storage and one result per warp (up to 32 warps).
struct LowestStorage {
  typename LowestWarp::TempStorage warp[32];
  KeyIndex partial[32];
};
#endif

/// Bytes of team shared memory the CUB selections need per team on ExecSpace (0: none run there).
template <class ExecSpace>
inline constexpr std::size_t select_bytes = 0;
#ifdef KOKKOS_ENABLE_CUDA
template <>
inline constexpr std::size_t select_bytes<Kokkos::Cuda> =
    sizeof(typename RankSort::TempStorage) > sizeof(LowestStorage) ? sizeof(typename RankSort::TempStorage)
                                                                    : sizeof(LowestStorage);
#endif

/// team_lowest (kernels/common/team_select.hpp) over [begin, end) of key(i) (std::uint64_t) with CUB's warp
/// reduction: each thread takes entries rank, rank + team size, ... in order, each warp reduces its
/// threads' pairs, and every thread reduces the warps' results in warp order. Returns false (nothing done)
/// where it does not apply: off Cuda, on the host, without shared memory, or for a team that is not a
/// whole block of full warps along y. Stores the entry in `lowest` and ends with a block barrier.
template <class Team, class Key>
KOKKOS_INLINE_FUNCTION bool team_lowest(const Team& team, long begin, long end, const Key& key, void* shared,
                                        long& lowest) {
#ifdef KOKKOS_ENABLE_CUDA
  if constexpr (std::is_same_v<typename Team::execution_space, Kokkos::Cuda>) {
    KOKKOS_IF_ON_DEVICE((
        const int threads = team.team_size();
        if (shared == nullptr || blockDim.x != 1 || blockDim.z != 1 || threads % 32 != 0 || threads > 1024) return false;
        auto& s = *static_cast<LowestStorage*>(shared);
        const int rank = team.team_rank(), warp = rank / 32;
        KeyIndex mine{~std::uint64_t{0}, end};
        for (long i = begin + rank; i < end; i += threads) mine = LowerKeyIndex{}(mine, KeyIndex{key(i), i});
        const KeyIndex warp_lowest = LowestWarp(s.warp[warp]).Reduce(mine, LowerKeyIndex{});
        if (rank % 32 == 0) s.partial[warp] = warp_lowest;
        __syncthreads();
        KeyIndex all = s.partial[0];
        for (int w = 1; w < threads / 32; ++w) all = LowerKeyIndex{}(all, s.partial[w]);
        __syncthreads();  // every thread has read the partials before a next call writes them
        lowest = all.index;
        return true;))
  }
#endif
  (void)team, (void)begin, (void)end, (void)key, (void)shared, (void)lowest;
  return false;
}

/// team_rank (kernels/common/team_select.hpp) of n items by key(j) (std::uint32_t) with cub::BlockRadixSort: item j
/// is thread j / rank_items's item j % rank_items (a blocked arrangement, in index order, so the stable sort
/// keeps ties in index order), items past n take the largest key and come after every item; after the
/// sort the item at sorted place r stores store(j, r). Returns false (nothing done) where it does not
/// apply: off Cuda, on the host, without shared memory, n > rank_team * rank_items, or a team other than a
/// whole block of rank_team threads along y. Ends with a block barrier.
template <class Team, class Key, class Store>
KOKKOS_INLINE_FUNCTION bool team_rank(const Team& team, long n, const Key& key, const Store& store, void* shared) {
#ifdef KOKKOS_ENABLE_CUDA
  if constexpr (std::is_same_v<typename Team::execution_space, Kokkos::Cuda>) {
    KOKKOS_IF_ON_DEVICE((
        if (shared == nullptr || blockDim.x != 1 || blockDim.z != 1 || team.team_size() != rank_team ||
            n > long(rank_team) * rank_items) return false;
        const int rank = team.team_rank();
        std::uint32_t keys[rank_items];
        int items[rank_items];
        for (int k = 0; k < rank_items; ++k) {
          const long j = long(rank) * rank_items + k;
          keys[k] = j < n ? key(j) : ~std::uint32_t{0};
          items[k] = static_cast<int>(j);
        }
        RankSort(*static_cast<typename RankSort::TempStorage*>(shared)).Sort(keys, items);
        for (int k = 0; k < rank_items; ++k)
          if (items[k] < n) store(long(items[k]), long(rank) * rank_items + k);
        __syncthreads();  // the ranks are stored, and the storage is free for a next call
        return true;))
  }
#endif
  (void)team, (void)n, (void)key, (void)store, (void)shared;
  return false;
}

}  // namespace kvmem::backend::cuda
