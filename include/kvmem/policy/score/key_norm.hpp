#pragma once
/// \file key_norm.hpp
/// score::KeyNorm — keep the keys of smallest L2 norm (Devoto et al. 2024; spec EVICTION.md §6 "KNorm").

#include <Kokkos_Core.hpp>

#include "../../math/vector_ops.hpp"
#include "eviction_scorer.hpp"

namespace kvmem::score {

/// score_t = -||k_t||_2 of the key as cached [D], float32 (kernels::norm2: one multiply-add chain in
/// channel order), fixed at insertion: low-norm keys draw more attention and
/// are kept (spec EVICTION.md §6, kvpress `knorm_press.py`).
struct KeyNorm : EvictionDefaults {
  static constexpr std::string_view name = "knorm";
  int head_dim = 0;
  void bind(long, const EvictionConfig& cfg) { head_dim = cfg.head_dim; }
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION double absorb(long, int, long, const K* key, const V*) const {
    return -static_cast<double>(kernels::norm2(key, head_dim));
  }
};
static_assert(EvictionScorer<KeyNorm>);

}  // namespace kvmem::score
