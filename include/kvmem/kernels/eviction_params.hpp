#pragma once
/// \file eviction_params.hpp
/// The scalars of an eviction memory that its step kernels read (spec EVICTION.md §1).

#include <Kokkos_Core.hpp>

#include "../eviction_config.hpp"

namespace kvmem::kernels {

/// The scalars a step needs, copied into the kernel.
struct EvictionParams {
  int head_dim, value_dim, group, sinks, window, top_k, decay_interval;
  float scale;  ///< 1 / sqrt(D), the softmax scale of q . k (one softmax, no temperature; spec §1 step 4)
  bool merge;   ///< EvictionConfig::merge_evicted: an evicted row folds into its most similar kept row

  static EvictionParams of(const EvictionConfig& cfg) {
    return {cfg.head_dim,     cfg.value_dim,
            cfg.group(),      cfg.sinks,
            cfg.window,       cfg.top_k,
            cfg.decay_interval, 1.0f / Kokkos::sqrt(static_cast<float>(cfg.head_dim)),
            cfg.merge_evicted};
  }
};

}  // namespace kvmem::kernels
