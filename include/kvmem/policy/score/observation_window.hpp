#pragma once
/// \file observation_window.hpp
/// score::ObservationWindow — SnapKV (Li et al. 2024; spec EVICTION.md §6 "SnapKV"): the attention an
/// observation window of queries pays each token, pooled over neighbouring positions.

#include <string_view>

#include "eviction_scorer.hpp"

namespace kvmem::score {

/// score_t = avgpool5( sum over the observation queries i of mean over the G query heads of p_{i -> t} ),
/// the average over the eligible tokens at positions t - 2 .. t + 2 that counts absent ones as 0 (always
/// / 5), taken when the memory compresses. The observation queries are the last
/// EvictionConfig::observation_window queries of the chunk before the compression (chunk = 0: of the prompt,
/// given in one prefill call), so with chunk = 0, sinks = 0, window = W_obs + 1 and top_k = C_max - W_obs
/// the first decode step keeps SnapKV's selection after the prompt (kernels::snapkv_keep) and attends it.
/// At every decode step after that (a chunk of one token) the statistic is that one query's attention,
/// pooled. Ties: the older token is evicted (the newer kept, as SnapKV's ranking).
struct ObservationWindow : EvictionDefaults {
  static constexpr std::string_view name = "snapkv";
  static constexpr bool needs_probabilities = true;
  static constexpr bool windowed = true;
  static constexpr int pool = 5;
  KOKKOS_INLINE_FUNCTION double attended(double sum, double p, int group) const {
    return sum + p / static_cast<double>(group);
  }
};
static_assert(EvictionScorer<ObservationWindow>);

}  // namespace kvmem::score
