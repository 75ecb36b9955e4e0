#pragma once
/// \file accumulated_attention.hpp
/// score::AccumulatedAttention — H2O heavy hitters (Zhang et al. 2023; spec EVICTION.md §6 "H2O").

#include "eviction_scorer.hpp"

namespace kvmem::score {

/// acc_t = sum over every step q' >= t at which t was attended (sinks and window included, from insertion
/// on) of sum over the G query heads of the group of p_{q' -> t}, the probability of the sparse,
/// renormalised attention of that step; lost when t is evicted (H2O `_update_hh_score`). The score is
/// acc_t (`normalize = false`, H2O, the default), or acc_t / (G (q - t)), the mean over the group and
/// over the q - t queries that saw t before step q (`normalize = true`, kvpress ObservedAttention).
struct AccumulatedAttention : EvictionDefaults {
  static constexpr std::string_view name = "h2o";
  static constexpr bool needs_probabilities = true;
  bool normalize = false;
  KOKKOS_INLINE_FUNCTION double attended(double acc, double p, int) const { return acc + p; }
  KOKKOS_INLINE_FUNCTION double base_score(double acc, long t, long q, int group) const {
    return normalize && q > t ? acc / (static_cast<double>(group) * static_cast<double>(q - t)) : acc;
  }
};
static_assert(EvictionScorer<AccumulatedAttention>);

}  // namespace kvmem::score
