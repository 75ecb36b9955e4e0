#pragma once
/// \file last_query_attention.hpp
/// score::LastQueryAttention — TOVA (Oren et al. 2024; spec EVICTION.md §6 "TOVA").

#include "eviction_scorer.hpp"

namespace kvmem::score {

/// score_t = mean over the G query heads of the group of p_{q-1 -> t}: the attention of the most recent
/// query only, replaced at every step (a token not attended at q - 1 scores 0, which cannot happen to a
/// cached token). This is the group mean per kv-head, what `kvmem-run evict --scorer tova` runs; the
/// original averages over all heads of the layer, which equals it with one kv-head (spec §6): set
/// `layer_mean` for that, and every kv-head of a sequence then evicts the same token.
struct LastQueryAttention : EvictionDefaults {
  static constexpr std::string_view name = "tova";
  static constexpr bool needs_probabilities = true;
  bool layer_mean = false;
  KOKKOS_INLINE_FUNCTION bool layer_wide() const { return layer_mean; }
  KOKKOS_INLINE_FUNCTION double attended(double, double p, int group) const {
    return p / static_cast<double>(group);
  }
};
static_assert(EvictionScorer<LastQueryAttention>);

}  // namespace kvmem::score
