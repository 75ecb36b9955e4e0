#pragma once
/// \file defaults.hpp
/// merge::Defaults — default hooks a merge policy inherits and overrides.

#include <Kokkos_Core.hpp>

#include "../../kernels/vector_ops.hpp"
#include "concept.hpp"

namespace kvmem::merge {

/// Defaults of every hook of the MergePolicy concept: keys stored and read as given, values read as
/// stored, logits q · k * tau / sqrt(D) without bias (scaled dot-product attention), gate 1, a new row
/// copies its token, folding is a plain sum. A policy derives from it and redefines what it changes.
struct Defaults {
  static constexpr bool first_chunk_verbatim = false;
  static constexpr bool route_after_append = false;
  static constexpr bool commit_eagerly = false;
  static constexpr bool rows_in_score_order = false;
  static constexpr bool uses_layer_norm = false;

  KOKKOS_INLINE_FUNCTION static void window_key(const MemoryConfig& cfg, const float* k, float* out) {
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = k[c];
  }
  KOKKOS_INLINE_FUNCTION static void memory_key(const MemoryConfig& cfg, const LayerWeightsRef&, const float* key,
                                                float* out) {
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = key[c];
  }
  KOKKOS_INLINE_FUNCTION static void read_key(const MemoryConfig& cfg, const LayerWeightsRef&, const Row& row,
                                              float* out) {
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = row.key[c];
  }
  KOKKOS_INLINE_FUNCTION static void read_value(const MemoryConfig& cfg, const Row& row, float* out) {
    for (int c = 0; c < cfg.value_dim; ++c) out[c] = row.value[c];
  }
  /// tau / sqrt(D): scaled dot-product attention with an inverse temperature.
  KOKKOS_INLINE_FUNCTION static float logit_scale(float tau, const float* /*q*/, int head_dim) {
    return tau / Kokkos::sqrt(static_cast<float>(head_dim));
  }
  KOKKOS_INLINE_FUNCTION static float row_bias(const Row&) { return 0.0f; }
  KOKKOS_INLINE_FUNCTION static float gate(float) { return 1.0f; }
  KOKKOS_INLINE_FUNCTION static void new_row(const MemoryConfig& cfg, const Row& row, const float* key,
                                             const float* value) {
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] = key[c];
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] = value[c];
    *row.radius = kernels::norm2(value, cfg.value_dim);
    *row.count = 1.0f;
  }
  KOKKOS_INLINE_FUNCTION static void begin_fold(const MemoryConfig&, const Row&) {}
  KOKKOS_INLINE_FUNCTION static void fold(const MemoryConfig& cfg, const Row& row, const float* key, const float* value,
                                          float g) {
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] += g * key[c];
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] += g * value[c];
    *row.count += 1.0f;
  }
  KOKKOS_INLINE_FUNCTION static void end_fold(const MemoryConfig&, const Row&) {}
};

}  // namespace kvmem::merge
