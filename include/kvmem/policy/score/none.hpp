#pragma once
/// \file none.hpp
/// score::None — StreamingLLM: sinks and a recent window only (Xiao et al. 2023; spec EVICTION.md §6).

#include "eviction_scorer.hpp"

namespace kvmem::score {

/// Every token scores 0, so ties decide and the newest wins: the cache keeps the sinks and the last
/// w + k tokens, the same as window w' = w + k with k' = 0 (spec EVICTION.md §6, "StreamingLLM").
struct None : EvictionDefaults {
  static constexpr std::string_view name = "streaming";
};
static_assert(EvictionScorer<None>);

}  // namespace kvmem::score
