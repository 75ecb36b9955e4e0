#pragma once
/// \file eviction_params.hpp
/// The scalars of an eviction memory that its step kernels read (spec EVICTION.md §1).

#include <Kokkos_Core.hpp>

#include "../../eviction_config.hpp"

namespace kvmem::kernels {

/// The scalars a step needs, copied into the kernel.
struct EvictionParams {
  int head_dim, value_dim, group, sinks, window, top_k, decay_interval;
  float scale;  ///< 1 / sqrt(D), the softmax scale of q . k (one softmax, no temperature; spec §1 step 4)
  bool merge;   ///< EvictionConfig::merge_evicted: an evicted row folds into its most similar kept row
  int chunk;        ///< EvictionConfig::chunk: positions per compression (1: every token, 0: prompt end)
  int observation;  ///< EvictionConfig::observation_window: observing queries per chunk (0: all)

  static EvictionParams of(const EvictionConfig& cfg) {
    return {cfg.head_dim,     cfg.value_dim,
            cfg.group(),      cfg.sinks,
            cfg.window,       cfg.top_k,
            cfg.decay_interval, 1.0f / Kokkos::sqrt(static_cast<float>(cfg.head_dim)),
            cfg.merge_evicted, cfg.chunk,
            cfg.observation_window};
  }
};

/// What the step of the token at position q does besides appending and attending (EvictionConfig::chunk,
/// observation_window; docs/eviction.md "Compression per chunk and at the end of a prompt").
struct StepRole {
  bool compress = true;  ///< evict down to the budget after the append (the first token of a chunk)
  bool observe = true;   ///< the step's attention updates the scorer's statistics (an observation query)
  bool fresh = true;     ///< the first observation query of its chunk: a windowed scorer (SnapKV) restarts

  /// The role of position q in a call whose tokens are positions [first, end) of the sequence; `decode`: a
  /// decode() step. chunk = 1 gives every token every role (the streaming eviction).
  KOKKOS_INLINE_FUNCTION static StepRole of(const EvictionParams& p, long q, long first, long end, bool decode) {
    if (p.chunk == 0) {  // the end of a prompt: a prefill or extend call is one open chunk, a decode step one token
      if (decode) return {};
      const long obs0 = p.observation > 0 && end - p.observation > first ? end - p.observation : first;
      return {false, q >= obs0, q == obs0};
    }
    const long at = q % p.chunk;  // the token's place in its chunk
    const long obs0 = p.observation > 0 && p.chunk > p.observation ? p.chunk - p.observation : 0;
    return {at == 0, at >= obs0, at == obs0};
  }
};

}  // namespace kvmem::kernels
