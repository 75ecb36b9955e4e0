#pragma once
/// \file online_softmax.hpp
/// The readout's online softmax (flash-style) for one query: its tile and split sizes, the running state
/// (OnlineSoftmax), the fold of a key list tile by tile (attend) and the log-sum-exp merge of two states
/// (merge_softmax, merge_partials) that splits of the key list and split-KV decode use.

#include <Kokkos_Core.hpp>

#include "../../math/softmax_exp.hpp"
#include "../../math/vector_ops.hpp"

namespace kvmem::kernels {

/// Keys processed per online-softmax tile.
inline constexpr int readout_key_tile = 32;
/// Queries handled by one team (the lanes of a query block).
inline constexpr int readout_query_block = 32;
/// Keys per split of a segment of the key list (tokens for a window or a KV cache, rows for the state): a
/// query's softmax over a segment of more keys is the log-sum-exp merge, in split order, of the softmaxes of
/// its splits [0, S), [S, 2S), ... (QueryBlock::close_split, merge_softmax). The splits sit at these fixed
/// positions in prefill and decode alike, so a decode step may compute its splits in parallel teams (split-KV
/// decode, flash-decoding: exact_causal_attention) and still give the prompt's bits. A multiple of
/// readout_key_tile; the same on every backend.
inline constexpr long readout_split_keys = 1024;
static_assert(readout_split_keys % readout_key_tile == 0, "splits start on a key tile");

/// The log-sum-exp merge of two online-softmax states (max logit, normalizer, un-normalized output [dim]):
/// state a (not empty) absorbs state b. M = max(m_a, m_b), c_a = exp(m_a - M), c_b = exp(m_b - M); the
/// normalizer becomes l_a c_a + l_b c_b and the output acc_a c_a + acc_b c_b, channel by channel. Prefill
/// (QueryBlock::close_split, settle_splits) and split-KV decode (exact_causal_attention) call this one
/// function in the same split order, so they give the same bits.
KOKKOS_INLINE_FUNCTION void merge_softmax(float& max_a, float& norm_a, float* acc_a, float max_b, float norm_b,
                                          const float* acc_b, int dim) {
  const float m = max_b > max_a ? max_b : max_a;
  const float ca = softmax_exp(max_a - m), cb = softmax_exp(max_b - m);
  norm_a = mul_add(norm_a, ca, norm_b * cb);
  for (int c = 0; c < dim; ++c) acc_a[c] = mul_add(acc_a[c], ca, acc_b[c] * cb);
  max_a = m;
}

/// Channel c of a query's output from the partials of its splits [0, count) (part(row, s, ...) as
/// QueryBlock::store_partial wrote them, value_dim dv): merged in split order by merge_softmax from split 0,
/// then divided by the normalizer as QueryBlock::finish does (the bits of the unsplit readout). `lse`
/// receives max + log(normalizer) when not null.
template <class Part>
KOKKOS_INLINE_FUNCTION float merge_partials(const Part& part, long row, long count, int c, int dv, float* lse) {
  float m = part(row, 0, dv), l = part(row, 0, dv + 1), a = part(row, 0, c);
  for (long s = 1; s < count; ++s) merge_softmax(m, l, &a, part(row, s, dv), part(row, s, dv + 1), &part(row, s, c), 1);
  if (lse != nullptr) *lse = m + Kokkos::log(l);
  return a * (1.0f / l);
}

/// Running online-softmax state of one query: max logit, normalizer and the un-normalized output
/// (acc [Dv], in scratch). `add_tile` folds a tile of logits and values in; the tiles' order and
/// boundaries fix the bits, so prefill and decode, which walk the same tiles, agree exactly. This is
/// the one-query form of QueryBlock below and gives the same bits operation for operation.
struct OnlineSoftmax {
  float max_logit = neg_inf();
  float normalizer = 0.0f;
  float* acc = nullptr;
  int value_dim = 0;

  /// Starts an empty softmax whose output accumulator is `acc` [dim] (zeroed here).
  KOKKOS_INLINE_FUNCTION void reset(float* accumulator, int dim) {
    max_logit = neg_inf();
    normalizer = 0.0f;
    acc = accumulator;
    value_dim = dim;
    for (int c = 0; c < dim; ++c) acc[c] = 0.0f;
  }
  /// Writes acc / normalizer to out [value_dim], rounded to out's storage type.
  template <class Out>
  KOKKOS_INLINE_FUNCTION void finish(Out* out) const {
    const float inv = 1.0f / normalizer;
    for (int c = 0; c < value_dim; ++c) out[c] = from_float<Out>(acc[c] * inv);
  }

  /// Folds n >= 1 logits and their values in: rescale by exp(old max - new max), then add
  /// p_j = exp(logit_j - new max) to the normalizer and p_j * v_j to acc, in key order. value_of(j) points
  /// to the value of key j in any storage type (read through to_float).
  template <class ValueOf>
  KOKKOS_INLINE_FUNCTION void add_tile(const float* logits, int n, ValueOf value_of) {
    float tile_max = neg_inf();
    for (int j = 0; j < n; ++j) tile_max = logits[j] > tile_max ? logits[j] : tile_max;
    const float new_max = tile_max > max_logit ? tile_max : max_logit;
    const float correction = softmax_exp(max_logit - new_max);
    for (int c = 0; c < value_dim; ++c) acc[c] *= correction;
    for (int j = 0; j < n; ++j) {
      const float pj = softmax_exp(logits[j] - new_max);
      normalizer = j == 0 ? mul_add(normalizer, correction, pj) : normalizer + pj;
      const auto* vj = value_of(j);
      for (int c = 0; c < value_dim; ++c) acc[c] = mul_add(pj, to_float(vj[c]), acc[c]);
    }
    max_logit = new_max;
  }
};

/// No logit bias (window tokens, exact attention).
struct NoBias {
  KOKKOS_INLINE_FUNCTION float operator()(long) const { return 0.0f; }
};

/// Folds keys [0, count) into `sm` tile by tile: logit_j = q · key_of(j) * scale + bias_of(j) over `dim`
/// channels, values value_of(j). `logits` is scratch of readout_key_tile floats. Tiles start at 0, so two
/// calls over the same keys give the same bits whatever else the caller does (and, for count <=
/// readout_split_keys, the same bits as attend_block for that query: attend has no splits).
template <class KeyOf, class ValueOf, class BiasOf = NoBias>
KOKKOS_INLINE_FUNCTION void attend(OnlineSoftmax& sm, const float* q, int dim, long count, float scale, float* logits,
                                   KeyOf key_of, ValueOf value_of, BiasOf bias_of = {}) {
  constexpr int KT = readout_key_tile;
  for (long j0 = 0; j0 < count; j0 += KT) {
    const int n = static_cast<int>(count - j0 < KT ? count - j0 : KT);
    for (int j = 0; j < n; ++j) logits[j] = mul_add(dot(q, key_of(j0 + j), dim), scale, bias_of(j0 + j));
    sm.add_tile(logits, n, [&](int j) { return value_of(j0 + j); });
  }
}

}  // namespace kvmem::kernels
