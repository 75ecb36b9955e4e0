#pragma once
/// \file team_select.hpp
/// Choices one team makes over a range of scores: the lowest (the token or state row an eviction drops)
/// and every item's rank (the block tokens that found state rows, the routed tokens grouped by row). Both
/// follow a total order on unsigned keys (order_key), so the choice does not depend on the team size, the
/// order of a reduction or the backend. On Kokkos::Cuda the same choices go through CUB's warp reduction
/// and block radix sort (backend/cuda/team_select.hpp, where the team is laid out as CUB expects); elsewhere,
/// and as the reference the CUB paths are tested against, through a Kokkos team reduction
/// (Kokkos::MinFirstLoc) and rank counting.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <type_traits>

#include "../../backend/cuda/team_select.hpp"

namespace kvmem::kernels {

/// An unsigned key whose order is x's numeric order: -inf lowest, +inf above every finite x, every NaN one
/// key above +inf (the largest), -0.0 and +0.0 one key (they compare equal). Ranking by (key, index) then
/// orders numbers as `<` does, ties to the lower index, NaN after every number (among themselves by
/// index), and a radix sort of the keys gives that order.
KOKKOS_INLINE_FUNCTION std::uint32_t order_key(float x) {
  if (x != x) return ~std::uint32_t{0};
  const std::uint32_t u = x == 0.0f ? 0u : Kokkos::bit_cast<std::uint32_t>(x), sign = std::uint32_t{1} << 31;
  return (u & sign) != 0 ? ~u : (u | sign);
}
/// order_key for float64 scores (the eviction scorers' effective scores).
KOKKOS_INLINE_FUNCTION std::uint64_t order_key(double x) {
  if (x != x) return ~std::uint64_t{0};
  const std::uint64_t u = x == 0.0 ? 0u : Kokkos::bit_cast<std::uint64_t>(x), sign = std::uint64_t{1} << 63;
  return (u & sign) != 0 ? ~u : (u | sign);
}

/// Team shared memory of the CUB selections, taken once per team at a kernel's start (nullptr: the
/// portable paths; team_select_scratch's bytes must be given to the policy at level 0).
struct TeamSelectScratch {
  void* shared = nullptr;
};

/// Bytes of level-0 team scratch a kernel that calls team_lowest or team_rank gives each team on
/// ExecSpace (0 where the portable paths run), including the alignment slack of team_select_scratch.
template <class ExecSpace>
inline constexpr std::size_t team_select_bytes =
    backend::cuda::select_bytes<ExecSpace> > 0 ? backend::cuda::select_bytes<ExecSpace> + backend::cuda::select_align : 0;

/// The team's TeamSelectScratch, from level-0 team scratch of team_select_bytes<execution space>; call once
/// per team, before any other get_shmem of level 0 (Kokkos' team scratch is a bump allocator).
template <class Team>
KOKKOS_INLINE_FUNCTION TeamSelectScratch team_select_scratch(const Team& team) {
  constexpr std::size_t bytes = backend::cuda::select_bytes<typename Team::execution_space>;
  if constexpr (bytes == 0)
    return {};
  else
    return {team.team_scratch(0).get_shmem_aligned(bytes, backend::cuda::select_align)};
}

/// The entry of [begin, end) (begin < end) that a serial scan keeping the first strictly lower score
/// picks: the lowest score(i) (a double), ties to the lower index; a NaN score at `begin` is picked, a
/// NaN elsewhere never (its key ranks after +inf, and begin, which is not NaN, comes first among equal
/// keys). skip(i): entries that take no part (their key is the largest; the caller makes sure `begin` is
/// not one). Every thread of the team calls it and gets the same entry. One exact reduction of
/// (order_key, index) pairs: Kokkos::MinFirstLoc, or CUB warp reductions on Cuda (scratch.shared); the
/// same entry for every team size, also for a range of +inf scores (a Kokkos::Min<double> would start
/// from Kokkos 4's identity DBL_MAX, which no +inf goes below). Ends with a team barrier.
template <class Team, class Score, class Skip>
KOKKOS_INLINE_FUNCTION long team_lowest(const Team& team, long begin, long end, const Score& score, const Skip& skip,
                                        TeamSelectScratch scratch) {
  const double first = score(begin);
  if (first != first) {
    team.team_barrier();  // every thread has read the scores before the caller changes them
    return begin;
  }
  auto key = [&](long i) { return skip(i) ? ~std::uint64_t{0} : order_key(score(i)); };
  if constexpr (backend::cuda::select_bytes<typename Team::execution_space> > 0) {
    long lowest = end;
    if (backend::cuda::team_lowest(team, begin, end, key, scratch.shared, lowest)) return lowest;
  }
  using reducer = Kokkos::MinFirstLoc<std::uint64_t, long>;
  typename reducer::value_type lowest;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(team, begin, end),
      [&](long i, typename reducer::value_type& v) {
        const std::uint64_t k = key(i);
        if (k < v.val || (k == v.val && i < v.loc)) v.val = k, v.loc = i;
      },
      reducer(lowest));
  team.team_barrier();
  return lowest.loc;
}

/// rank(j) = #{i < n : (key(i), i) < (key(j), j)} for every j < n: a stable ascending order of n items by
/// unsigned 32-bit key (order_key of a score, or a row index), written through store(j, rank(j)). Every
/// thread of the team calls it; the ranks are stored when it returns (team barrier). One thread per item
/// counting the items before it, or CUB's block radix sort on Cuda (scratch.shared, n <= 1024).
template <class Team, class Key, class Store>
KOKKOS_INLINE_FUNCTION void team_rank(const Team& team, long n, const Key& key, const Store& store,
                                      TeamSelectScratch scratch) {
  static_assert(std::is_same_v<decltype(key(0L)), std::uint32_t>, "team_rank sorts 32-bit keys (order_key of a float)");
  if constexpr (backend::cuda::select_bytes<typename Team::execution_space> > 0) {
    if (backend::cuda::team_rank(team, n, key, store, scratch.shared)) return;
  }
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](long j) {
    const std::uint32_t kj = key(j);
    long rank = 0;
    for (long i = 0; i < j; ++i) rank += key(i) <= kj ? 1 : 0;
    for (long i = j + 1; i < n; ++i) rank += key(i) < kj ? 1 : 0;
    store(j, rank);
  });
  team.team_barrier();
}

}  // namespace kvmem::kernels
