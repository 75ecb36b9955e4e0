#pragma once
/// \file defaults.hpp
/// merge::Defaults — default hooks a merge policy inherits and overrides.

#include <Kokkos_Core.hpp>

#include "../../math/vector_ops.hpp"
#include "concept.hpp"

namespace kvmem::merge {

/// Defaults of every hook of the MergePolicy concept: keys stored and read as given, values read as
/// stored, logits q · k * tau / sqrt(D) without bias (scaled dot-product attention), gate 1, a new row
/// copies its token, folding is a plain sum. A policy derives from it and redefines what it changes.
/// The hooks that read or write tokens are templates over the storage type (kvmem/dtype.hpp): they read
/// through to_float and store through from_float, so one policy serves float, bfloat16 and float16.
struct Defaults {
  static constexpr bool first_chunk_verbatim = false;
  static constexpr bool route_after_append = false;
  static constexpr bool commit_eagerly = false;
  static constexpr bool rows_in_score_order = false;
  static constexpr bool uses_layer_norm = false;

  template <class In, class Out>
  KOKKOS_INLINE_FUNCTION static void window_key(const MemoryConfig& cfg, const In* k, Out* out) {
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = from_float<Out>(to_float(k[c]));
  }
  template <class In>
  KOKKOS_INLINE_FUNCTION static void memory_key(const MemoryConfig& cfg, const LayerWeightsRef&, const In* key,
                                                float* out) {
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = to_float(key[c]);
  }
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void read_key(const MemoryConfig& cfg, const LayerWeightsRef&, const Row& row,
                                              Out* out) {
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = from_float<Out>(row.key[c]);
  }
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void read_value(const MemoryConfig& cfg, const Row& row, Out* out) {
    for (int c = 0; c < cfg.value_dim; ++c) out[c] = from_float<Out>(row.value[c]);
  }
  /// tau / sqrt(D): scaled dot-product attention with an inverse temperature.
  template <class Q>
  KOKKOS_INLINE_FUNCTION static float logit_scale(float tau, const Q* /*q*/, int head_dim) {
    return tau / Kokkos::sqrt(static_cast<float>(head_dim));
  }
  KOKKOS_INLINE_FUNCTION static float row_bias(const Row&) { return 0.0f; }
  KOKKOS_INLINE_FUNCTION static float gate(float) { return 1.0f; }
  template <class V>
  KOKKOS_INLINE_FUNCTION static void new_row(const MemoryConfig& cfg, const Row& row, const float* key,
                                             const V* value) {
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] = key[c];
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] = to_float(value[c]);
    *row.radius = kernels::norm2(value, cfg.value_dim);
    *row.count = 1.0f;
  }
  KOKKOS_INLINE_FUNCTION static void begin_fold(const MemoryConfig&, const Row&) {}
  template <class V>
  KOKKOS_INLINE_FUNCTION static void fold(const MemoryConfig& cfg, const Row& row, const float* key, const V* value,
                                          float g) {
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] = kernels::mul_add(g, key[c], row.key[c]);
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] = kernels::mul_add(g, to_float(value[c]), row.value[c]);
    *row.count += 1.0f;
  }
  KOKKOS_INLINE_FUNCTION static void end_fold(const MemoryConfig&, const Row&) {}
};

}  // namespace kvmem::merge
