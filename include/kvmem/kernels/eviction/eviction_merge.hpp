#pragma once
/// \file eviction_merge.hpp
/// Merge where eviction forgets: the row an eviction step removes is first folded into the kept row whose
/// key is most similar to its own (count-weighted means of keys and values; the merge of evicted into kept
/// tokens of CaM and D2O, read with token merging's log-count bias). EvictionConfig::merge_evicted.

#include <Kokkos_Core.hpp>

#include "../../dtype.hpp"
#include "eviction_params.hpp"
#include "../common/team_select.hpp"
#include "../../math/vector_ops.hpp"

namespace kvmem::kernels {

/// The largest count a merged row holds (float32's last count reached by adding integers exactly, 2^24
/// tokens); merge_into_row clamps the sum of two counts to it.
inline constexpr float max_merge_count = 16777216.0f;

/// cos(a, b) = a . b / (||a|| ||b||) of two keys [n] read in float32 (kernels::dot's order), norm_a =
/// ||a||; 0 when either norm is 0 (a zero key is neither similar nor dissimilar to any key); NaN when
/// either key holds a NaN (an infinite channel gives NaN or 0).
template <class A, class B>
KOKKOS_INLINE_FUNCTION float key_cosine(const A* a, float norm_a, const B* b, int n) {
  const float norm_b = norm2(b, n);
  const float denom = norm_a * norm_b;
  const float d = dot(a, b, n);
  return denom == 0.0f ? 0.0f : d / denom;
}

/// The order entry of (b, h) that the evicted entry `evicted` merges into: among the entries [first, live)
/// but `evicted` (first = the cached sinks, which are never merged into; the window and the other retained
/// rows are), the one of highest key_cosine with the evicted row's key, ties to the older entry (lower
/// position). A NaN similarity never wins unless it is the first candidate's (team_lowest's rule). At least
/// one candidate exists whenever a step evicts: the window holds the current token, which is not a sink.
/// Every thread of the team gets the entry; ends with a team barrier.
template <class Team, class Cache>
KOKKOS_INLINE_FUNCTION long eviction_merge_target(const Team& team, const EvictionParams& p, const Cache& c, long b, int h,
                                                  long evicted, long first, TeamSelectScratch select) {
  const long live = c.live(b, h);
  const long begin = evicted == first ? first + 1 : first;
  const auto* ke = &c.keys(b, h, c.order(b, h, evicted), 0);
  const float norm_e = norm2(ke, p.head_dim);
  auto score = [&](long i) -> double {
    return -static_cast<double>(key_cosine(ke, norm_e, &c.keys(b, h, c.order(b, h, i), 0), p.head_dim));
  };
  return team_lowest(team, begin, live, score, [&](long i) { return i == evicted; }, select);
}

/// Folds the row of order entry `from` of (b, h) into the row of entry `into`: with counts n_f and n_i, the
/// key and value of `into` become (n_i x_i + n_f x_f) / (n_i + n_f), each channel in float32 by one thread
/// and rounded to the cache's storage type, and its count min(n_i + n_f, max_merge_count) (past it the
/// weights stay those of the unclamped counts). The scorer's statistic of `into` is kept as it is (it sees
/// the merged row from the next step on). Ends with a team barrier.
template <class Team, class Cache>
KOKKOS_INLINE_FUNCTION void merge_into_row(const Team& team, const EvictionParams& p, const Cache& c, long b, int h,
                                           long from, long into) {
  using T = typename Cache::storage_type;
  const int sf = c.order(b, h, from), si = c.order(b, h, into);
  const float nf = c.counts(b, h, sf), ni = c.counts(b, h, si), n = nf + ni;
  const float wf = nf / n, wi = ni / n;
  auto mean = [&](const T& x_into, const T& x_from) {
    return from_float<T>(mul_add(wi, to_float(x_into), wf * to_float(x_from)));
  };
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p.head_dim),
                       [&](int ch) { c.keys(b, h, si, ch) = mean(c.keys(b, h, si, ch), c.keys(b, h, sf, ch)); });
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p.value_dim),
                       [&](int ch) { c.values(b, h, si, ch) = mean(c.values(b, h, si, ch), c.values(b, h, sf, ch)); });
  team.team_barrier();
  Kokkos::single(Kokkos::PerTeam(team), [&] { c.counts(b, h, si) = n < max_merge_count ? n : max_merge_count; });
  team.team_barrier();
}

/// The merge of an eviction step on (b, h): entry `evicted` folds into its eviction_merge_target before
/// eviction_remove frees its slot. `first`: the cached sinks (RetainedRange::begin). Ends with a team
/// barrier.
template <class Team, class Cache>
KOKKOS_INLINE_FUNCTION void eviction_merge(const Team& team, const EvictionParams& p, const Cache& c, long b, int h,
                                           long evicted, long first, TeamSelectScratch select) {
  const long into = eviction_merge_target(team, p, c, b, h, evicted, first, select);
  merge_into_row(team, p, c, b, h, evicted, into);
}

}  // namespace kvmem::kernels
