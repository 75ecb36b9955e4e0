#pragma once
/// \file proportional.hpp
/// merge::Proportional — a training-free merge: rows hold the sums of their tokens' raw keys and values and
/// a count, and read as their mean key and mean value with the logit bias log(count) ("proportional
/// attention" of token merging, Bolya et al. 2023, eq. 1; the count-weighted merge of CaM and D2O).

#include "../../math/vector_ops.hpp"
#include "defaults.hpp"

namespace kvmem::merge {

/// Proportional merging for a pretrained model's own keys and values (no learned parameter):
/// - a row holds K_i = sum of its tokens' keys as the model gave them (RoPE'd, not normalized),
///   V_i = sum of their values and n_i = how many tokens it holds;
/// - it is read as the key K_i / n_i and the value V_i / n_i with the logit bias log(n_i), at the model's
///   scale tau / sqrt(D) (tau_state = tau_window = 1 for a pretrained model). A row of one token is read
///   exactly as that token; a row of n identical tokens carries their n tokens' softmax mass, since
///   exp(q . k / sqrt(D) + log n) = n exp(q . k / sqrt(D));
/// - the first chunk's tokens become rows verbatim (the first `sinks` of them are the sinks, never merged
///   into); later, when a chunk leaves the block sliding window, the budget schedule says how many of its
///   tokens found rows (the least similar by score::Novelty: max_i k . K_i / n_i), and every other token
///   joins the row of highest similarity k . K_i / n_i to the row's mean key (winner-take-all as KVM,
///   rows appended by this chunk included, sinks excluded; ties to the lower row), ungated.
/// Holding every token as its own row (a budget of at least the tokens seen), it is exact causal attention.
///
/// Counts are float32: exact up to max_count = 2^24 tokens in one row. A row that holds max_count tokens
/// keeps that count, and each further token moves its mean by 1 / max_count of its difference to it
/// (sums scaled by 1 - 1 / max_count before the token is added), so the row still reads as a mean and its
/// bias stays log(2^24) (docs/numerics.md "Merge counts"). A NaN or infinite key or value propagates into
/// the row it joins and from there into the outputs that read it, as it would in exact attention.
struct Proportional : Defaults {
  static constexpr std::string_view name = "proportional";
  static constexpr bool first_chunk_verbatim = true;
  static constexpr bool route_after_append = true;
  /// The largest count a row holds: float32's last integer n with n + 1 exact is 2^24 - 1, so 2^24 is the
  /// last count reached by adding one.
  static constexpr float max_count = 16777216.0f;

  /// K_i / n_i, [D].
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void read_key(const MemoryConfig& cfg, const LayerWeightsRef&, const Row& row,
                                              Out* out) {
    const float inv = 1.0f / *row.count;
    for (int c = 0; c < cfg.head_dim; ++c) out[c] = from_float<Out>(row.key[c] * inv);
  }
  /// V_i / n_i, [Dv].
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void read_value(const MemoryConfig& cfg, const Row& row, Out* out) {
    const float inv = 1.0f / *row.count;
    for (int c = 0; c < cfg.value_dim; ++c) out[c] = from_float<Out>(row.value[c] * inv);
  }
  /// log(n_i): a row weighs as many tokens as it holds.
  KOKKOS_INLINE_FUNCTION static float row_bias(const Row& row) { return Kokkos::log(*row.count); }
  /// K_i += k, V_i += v, n_i += 1 (ungated: `g` is ignored); at max_count, K_i and V_i are first scaled by
  /// 1 - 1 / max_count and the count stays (the running mean's step of 1 / max_count).
  template <class V>
  KOKKOS_INLINE_FUNCTION static void fold(const MemoryConfig& cfg, const Row& row, const float* key, const V* value,
                                          float /*g*/) {
    if (*row.count >= max_count) {
      constexpr float keep = 1.0f - 1.0f / max_count;
      for (int c = 0; c < cfg.head_dim; ++c) row.key[c] = kernels::mul_add(row.key[c], keep, key[c]);
      for (int c = 0; c < cfg.value_dim; ++c) row.value[c] = kernels::mul_add(row.value[c], keep, to_float(value[c]));
      *row.count = max_count;
      return;
    }
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] += key[c];
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] += to_float(value[c]);
    *row.count += 1.0f;
  }
};
static_assert(MergePolicy<Proportional>);

}  // namespace kvmem::merge
