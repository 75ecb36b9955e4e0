#pragma once
/// \file k_means_count.hpp
/// merge::KMeansCount — OVQ's online k-means dictionary with counts (ovq-paper Sec. 3.2 eqs. 15-19,
/// App. 8.3; spec OVQ.md §2-§6).

#include "../../math/vector_ops.hpp"
#include "defaults.hpp"

namespace kvmem::merge {

/// Online vector quantization: keys are unit-normalized, khat = k / (||k|| + 1e-5), and every row is a
/// centroid of keys and values with a count; a block of tokens is committed as soon as it is complete:
/// the least-similar tokens found new centroids, the others move their nearest pre-existing centroid
/// (plain dot product) to the running mean (c_old D_old + sum x) / c_new (learning rate 1 / count).
/// Attention logits are beta * sqrt(D) * qhat · key plus log(count) for centroids (tau carries beta).
/// With MemoryConfig::normalize_rows, both centroids of a touched row are L2-normalized after the fold.
struct KMeansCount : Defaults {
  static constexpr std::string_view name = "ovq";
  static constexpr bool commit_eagerly = true;
  static constexpr bool rows_in_score_order = true;
  static constexpr float key_eps = 1e-5f;  ///< spec OVQ.md §9 #6: x / (||x|| + 1e-5)

  /// khat = k / (||k||_2 + 1e-5), [D] (spec OVQ.md §2).
  template <class In, class Out>
  KOKKOS_INLINE_FUNCTION static void window_key(const MemoryConfig& cfg, const In* k, Out* out) {
    const float inv = 1.0f / (kernels::norm2(k, cfg.head_dim) + key_eps);
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = from_float<Out>(to_float(k[c]) * inv);
  }
  /// beta * sqrt(D) / (||q|| + 1e-5): the logit is beta * sqrt(D) * qhat · key (spec OVQ.md §2, §4).
  template <class Q>
  KOKKOS_INLINE_FUNCTION static float logit_scale(float beta, const Q* q, int head_dim) {
    return beta * Kokkos::sqrt(static_cast<float>(head_dim)) / (kernels::norm2(q, head_dim) + key_eps);
  }
  /// log(count): a centroid weighs as many tokens as it absorbed (spec OVQ.md §4).
  KOKKOS_INLINE_FUNCTION static float row_bias(const Row& row) { return Kokkos::log(*row.count); }
  /// The running mean starts from c_old * D_old.
  KOKKOS_INLINE_FUNCTION static void begin_fold(const MemoryConfig& cfg, const Row& row) {
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] *= *row.count;
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] *= *row.count;
  }
  /// D_new = (c_old D_old + sum x) / c_new, then optional L2 normalization (spec OVQ.md §5.4-§5.5).
  KOKKOS_INLINE_FUNCTION static void end_fold(const MemoryConfig& cfg, const Row& row) {
    const float inv = 1.0f / *row.count;
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] *= inv;
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] *= inv;
    if (cfg.normalize_rows) normalize(cfg, row);
  }
  /// A founding token's centroid is the token itself (normalized too when normalize_rows is on).
  template <class V>
  KOKKOS_INLINE_FUNCTION static void new_row(const MemoryConfig& cfg, const Row& row, const float* key,
                                             const V* value) {
    Defaults::new_row(cfg, row, key, value);
    if (cfg.normalize_rows) normalize(cfg, row);
  }
  /// x / max(||x||, 1e-12) for the key and the value of a row.
  KOKKOS_INLINE_FUNCTION static void normalize(const MemoryConfig& cfg, const Row& row) {
    const float nk = kernels::norm2(row.key, cfg.head_dim), nv = kernels::norm2(row.value, cfg.value_dim);
    const float ik = 1.0f / (nk > cfg.norm_eps ? nk : cfg.norm_eps), iv = 1.0f / (nv > cfg.norm_eps ? nv : cfg.norm_eps);
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] *= ik;
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] *= iv;
  }
};
static_assert(MergePolicy<KMeansCount>);

}  // namespace kvmem::merge
