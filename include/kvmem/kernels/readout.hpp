#pragma once
/// \file readout.hpp
/// Block attention readout: one softmax over [state rows ; block sliding window], online (flash-style).

#include <Kokkos_Core.hpp>
#include <stdexcept>
#include <type_traits>

#include "../config.hpp"
#include "../policy/layer_weights.hpp"
#include "../state/state_rows.hpp"
#include "scratch.hpp"
#include "simd.hpp"
#include "softmax_exp.hpp"
#include "step_launch.hpp"
#include "step_plan.hpp"
#include "tile_traits.hpp"
#include "vector_ops.hpp"
#include "window_write.hpp"

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

/// How a decode step (one query position) whose keys span more than one split of readout_split_keys keys
/// is scheduled: `automatic` runs its splits in parallel teams (split-KV decode, flash-decoding) where the
/// step has fewer (sequence, kv-head) teams than the backend has threads (a GPU: always; 2 CPU threads:
/// B x Hkv = 1), `always` and `never` force either schedule. The splits sit at the fixed positions that a
/// prefill takes too, so every choice gives the same bits (tests/unit/test_exact_attention.cpp,
/// test_decode_splits.cpp).
enum class DecodeSplits { automatic, always, never };

/// Whether a decode step of `teams` (sequence, kv-head, head group) teams over at most `splits` key splits
/// runs them in parallel teams, as `mode` says (DecodeSplits).
template <class ExecSpace>
[[nodiscard]] bool splits_decode(const ExecSpace& exec, DecodeSplits mode, long splits, long teams) {
  if (splits <= 1 || mode == DecodeSplits::never) return false;
  return mode == DecodeSplits::always || teams < static_cast<long>(exec.concurrency());
}

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

/// The online softmaxes of a block of up to readout_query_block queries that read the same keys, in one
/// team's scratch. Each key tile is read once for the whole block: the logits of all queries against the
/// tile come from a register-blocked product (queries in vector lanes, several keys at a time), then each
/// query folds its row of logits in. Every logit and every softmax step is the same sequence of
/// operations as OnlineSoftmax/attend for that query alone, so a block of 32 queries, a block of one
/// (decode) and attend() give the same bits.
struct QueryBlock {
  static constexpr int lanes = readout_query_block;
  static constexpr int tile = readout_key_tile;
  static_assert(lanes % simd::width == 0, "a query block fills whole register vectors");
  /// Keys per register tile of the logits (logits_lanes): NK keys x lanes / width vectors of accumulators,
  /// half the target's register vectors (16 under AVX-512: 8 keys, 2 vectors of lanes each).
  static constexpr int qk_keys =
      simd::registers / 2 * simd::width / lanes > 0 ? simd::registers / 2 * simd::width / lanes : 1;
  /// Lanes and channel vectors per register tile of the value product (accumulate_lanes): pv_lanes x
  /// pv_vectors accumulators, half the target's register vectors (4 x 4 under AVX-512).
  static constexpr int pv_lanes = 4, pv_vectors = simd::registers / 2 / pv_lanes;
  int queries = 0;  ///< live queries (lanes [queries, lanes) hold zero queries)
  int dim = 0, value_dim = 0;
  float* qt = nullptr;          ///< [dim][lanes] queries, transposed
  float* scales = nullptr;      ///< [2][lanes] logit scales (two sets: state rows, window)
  float* max_logit = nullptr;   ///< [lanes]
  float* normalizer = nullptr;  ///< [lanes]
  float* acc = nullptr;         ///< [lanes][value_dim]
  float* logits = nullptr;      ///< [tile][lanes] (key-major: a key's logits for all lanes are contiguous)
  float* probs = nullptr;       ///< [tile][lanes]
  float* tile_keys = nullptr;   ///< [tile][dim] a key tile widened to float32, or null (not packed)
  float* tile_values = nullptr; ///< [tile][value_dim] its values widened to float32, or null
  float* split_max = nullptr;   ///< [lanes] the merged softmax of the lane's closed splits, or null (no room)
  float* split_norm = nullptr;  ///< [lanes] its normalizer; 0: no split closed yet (a closed split's
                                ///< normalizer is >= 1: its largest logit adds exp(0) = 1, later terms add >= 0)
  float* split_acc = nullptr;   ///< [lanes][value_dim] its un-normalized output

  /// Scratch floats of one block; `packed`: with room for a key tile and its values widened to float32
  /// (attend_block packs the tiles of keys stored in 16 bits when a block has more than one query);
  /// `split`: with room for the merged softmax of closed splits (needed where a segment may hold more than
  /// readout_split_keys keys: needs_split_room).
  KOKKOS_INLINE_FUNCTION static constexpr long scratch_floats(int d, int dv, bool packed = false, bool split = false) {
    return long(d) * lanes + 4L * lanes + long(lanes) * dv + 2L * lanes * tile + lanes +
           (packed ? long(tile) * (d + dv) : 0L) + (split ? long(lanes) * (dv + 2) : 0L);
  }
  /// Scratch floats of a team's nb query blocks (attend_blocks): the first with room for the packed tile.
  KOKKOS_INLINE_FUNCTION static constexpr long team_floats(int nb, int d, int dv, bool packed = false,
                                                           bool split = false) {
    return scratch_floats(d, dv, packed, split) + (nb - 1) * scratch_floats(d, dv, false, split);
  }
  /// Whether a block must hold the merged softmax of closed splits: a segment of its key list (state rows,
  /// window, KV cache) may hold more than readout_split_keys keys.
  KOKKOS_INLINE_FUNCTION static constexpr bool needs_split_room(long max_segment_keys) {
    return max_segment_keys > readout_split_keys;
  }
  /// Lays out block i of a team's blocks in `team_scratch` (team_floats floats), after the blocks before
  /// it, for `n` live queries; block 0 holds the packed tile that the team's blocks share.
  KOKKOS_INLINE_FUNCTION void carve_in_team(float* team_scratch, int i, int n, int d, int dv, bool packed = false,
                                            bool split = false) {
    const long offset =
        i == 0 ? 0L : scratch_floats(d, dv, packed, split) + (i - 1) * scratch_floats(d, dv, false, split);
    carve(team_scratch + offset, n, d, dv, packed && i == 0, split);
  }
  /// Lays the block out in `scratch` (scratch_floats(d, dv, packed, split) floats) for `n` live queries.
  KOKKOS_INLINE_FUNCTION void carve(float* scratch, int n, int d, int dv, bool packed = false, bool split = false) {
    queries = n, dim = d, value_dim = dv;
    qt = scratch;
    scales = qt + long(d) * lanes;
    max_logit = scales + 2 * lanes;
    normalizer = max_logit + lanes;
    acc = normalizer + lanes;
    logits = acc + long(lanes) * dv;
    probs = logits + lanes * tile;
    float* rest = probs + lanes * tile + lanes;  // after the corrections [lanes]
    tile_keys = packed ? rest : nullptr;
    tile_values = packed ? tile_keys + long(tile) * d : nullptr;
    rest += packed ? long(tile) * (d + dv) : 0L;
    split_max = split ? rest : nullptr;
    split_norm = split ? rest + lanes : nullptr;
    split_acc = split ? rest + 2 * lanes : nullptr;
  }
  /// The lanes that attend_block reads, to be load()ed: lane 0 alone for a block of one live query (the
  /// decode form: logits_one, add_tile on lane 0), every lane otherwise (the register tiles read the padding
  /// lanes, which load() zeroes).
  KOKKOS_INLINE_FUNCTION int read_lanes() const { return queries == 1 ? 1 : lanes; }
  /// Whether attend_block widens the key tiles of storage type K into tile_keys / tile_values before the
  /// register tiles read them: for keys narrower than float32, in a block with room (carve's `packed`) and
  /// more than one live query. A packed key is widened once per tile instead of once per register tile
  /// that reads it; widening is exact, so packing changes no bit.
  template <class K>
  KOKKOS_INLINE_FUNCTION bool packs() const {
    return !std::is_same_v<std::remove_cv_t<K>, float> && tile_keys != nullptr && queries > 1;
  }
  /// Lane u: query q (null for a padding lane; any storage type, widened to float32) and an empty softmax.
  template <class Q>
  KOKKOS_INLINE_FUNCTION void load(int u, const Q* q) const {
    for (int c = 0; c < dim; ++c) qt[long(c) * lanes + u] = q ? to_float(q[c]) : 0.0f;
    max_logit[u] = neg_inf();
    normalizer[u] = 0.0f;
    for (int c = 0; c < value_dim; ++c) acc[long(u) * value_dim + c] = 0.0f;
    if (split_norm != nullptr) split_norm[u] = 0.0f;
  }
  /// Closes lane u's running split (it has folded at least one key): its softmax moves into the merged
  /// softmax of the closed splits (the first one) or is merged into it (merge_softmax), and the running
  /// softmax starts empty for the next split. Needs split room (carve's `split`).
  KOKKOS_INLINE_FUNCTION void close_split(int u) const {
    float* a = acc + long(u) * value_dim;
    float* m = split_acc + long(u) * value_dim;
    if (split_norm[u] == 0.0f) {
      split_max[u] = max_logit[u];
      split_norm[u] = normalizer[u];
      for (int c = 0; c < value_dim; ++c) m[c] = a[c];
    } else {
      merge_softmax(split_max[u], split_norm[u], m, max_logit[u], normalizer[u], a, value_dim);
    }
    max_logit[u] = neg_inf();
    normalizer[u] = 0.0f;
    for (int c = 0; c < value_dim; ++c) a[c] = 0.0f;
  }
  /// Lane u's softmax as a split's partial into out [value_dim + 2]: the un-normalized output, then the max
  /// logit and the normalizer (merged by merge_partials).
  KOKKOS_INLINE_FUNCTION void store_partial(int u, float* out) const {
    const float* a = acc + long(u) * value_dim;
    for (int c = 0; c < value_dim; ++c) out[c] = a[c];
    out[value_dim] = max_logit[u];
    out[value_dim + 1] = normalizer[u];
  }
  /// After lane u's last key: where splits were closed, the running split is merged into them and the result
  /// becomes the lane's softmax (max_logit, normalizer, acc), which finish() and the log-sum-exp read.
  KOKKOS_INLINE_FUNCTION void settle(int u) const {
    if (split_norm == nullptr || split_norm[u] == 0.0f) return;
    float* a = acc + long(u) * value_dim;
    float* m = split_acc + long(u) * value_dim;
    merge_softmax(split_max[u], split_norm[u], m, max_logit[u], normalizer[u], a, value_dim);
    max_logit[u] = split_max[u];
    normalizer[u] = split_norm[u];
    for (int c = 0; c < value_dim; ++c) a[c] = m[c];
  }
  /// y_u = acc_u / normalizer_u into out [value_dim], rounded to out's storage type.
  template <class Out>
  KOKKOS_INLINE_FUNCTION void finish(int u, Out* out) const {
    const float inv = 1.0f / normalizer[u];
    for (int c = 0; c < value_dim; ++c) out[c] = from_float<Out>(acc[long(u) * value_dim + c] * inv);
  }

  /// logits[j + jj][u] for all lanes u and NK keys; scale [lanes]. A register tile of NK keys x the
  /// lanes' register vectors: per channel, one load of the lanes' query channel and one broadcast per key.
  /// Keys of any storage type K (widened as they are read).
  template <int NK, class K, class BiasOf>
  KOKKOS_INLINE_FUNCTION void logits_lanes(const K* const* keys, const float* scale, int j, long j_abs,
                                           BiasOf bias_of) const {
    constexpr int W = simd::width;
    float bias[NK];
    for (int jj = 0; jj < NK; ++jj) bias[jj] = bias_of(j_abs + jj);
    simd::lane_dots<lanes, NK>(qt, dim, keys, [&](int jj, int x, const simd::vec& s) {
      simd::store(logits + (j + jj) * lanes + x * W,
                  simd::fma(s, simd::load(scale + x * W), simd::broadcast(bias[jj])));
    });
  }
  /// logits[j + jj][0] of lane 0 alone (one live query: decode) for NK keys: NK = simd::width keys
  /// transposed in registers, their chains in vector lanes (simd::row_dots), or NK scalar chains.
  template <int NK, class K, class BiasOf>
  KOKKOS_INLINE_FUNCTION void logits_one(const K* const* keys, const float* scale, int j, long j_abs,
                                         BiasOf bias_of) const {
    float s[NK];
    if constexpr (NK == simd::width) {
      simd::row_dots(qt, lanes, dim, keys, s);
    } else {
      for (int jj = 0; jj < NK; ++jj) s[jj] = 0.0f;
      for (int c = 0; c < dim; ++c) {
        const float qc = qt[long(c) * lanes];
        for (int jj = 0; jj < NK; ++jj) s[jj] = mul_add(qc, to_float(keys[jj][c]), s[jj]);
      }
    }
    for (int jj = 0; jj < NK; ++jj) logits[(j + jj) * lanes] = mul_add(s[jj], scale[0], bias_of(j_abs + jj));
  }

  /// logits_one (`One`: a block of one live query) or logits_lanes for NK keys.
  template <int NK, bool One, class K, class BiasOf>
  KOKKOS_INLINE_FUNCTION void logits_of(const K* const* keys, const float* scale, int j, long j_abs,
                                        BiasOf bias_of) const {
    if constexpr (One)
      logits_one<NK>(keys, scale, j, j_abs, bias_of);
    else
      logits_lanes<NK>(keys, scale, j, j_abs, bias_of);
  }

  /// logits[j][u] = logit_value(u, key, scale, bias).
  template <class K>
  KOKKOS_INLINE_FUNCTION void logit(int u, int j, const K* key, float scale, float bias) const {
    logits[j * lanes + u] = logit_value(u, key, scale, bias);
  }
  /// (q_u · key) * scale + bias: one dot chain over the channels in increasing order (kernels::dot, read
  /// four channels ahead: dot_ahead), then one mul_add; the bits of logits_lanes and logits_one for that key
  /// and lane.
  template <class K>
  KOKKOS_INLINE_FUNCTION float logit_value(int u, const K* key, float scale, float bias) const {
    return mul_add(dot_ahead(qt + u, lanes, key, dim), scale, bias);
  }

  /// Folds logits[0, n)[u] (n >= 1) and their values into lane u's softmax (OnlineSoftmax::add_tile).
  template <class ValueOf>
  KOKKOS_INLINE_FUNCTION void add_tile(int u, int n, ValueOf value_of) const {
    accumulate(u, n, softmax_one(u, n), value_of);
  }

  /// The softmax step of add_tile for lane u alone (n >= 1 keys): updates max_logit[u] and normalizer[u],
  /// writes probs[0, n)[u] and returns the correction exp(old max - new max) by which acc_u is to be scaled.
  KOKKOS_INLINE_FUNCTION float softmax_one(int u, int n) const {
    float tile_max = neg_inf();
    for (int j = 0; j < n; ++j) tile_max = logits[j * lanes + u] > tile_max ? logits[j * lanes + u] : tile_max;
    const float old_max = max_logit[u];
    const float new_max = tile_max > old_max ? tile_max : old_max;
    const float correction = softmax_exp(old_max - new_max);
    if constexpr (simd::vector_registers) {
      // Lane u's column of the tile gathered into a contiguous block first, so that the exponentials run
      // in vector lanes (each lane the scalar softmax_exp's bits).
      float e[tile];
      for (int j = 0; j < n; ++j) e[j] = logits[j * lanes + u] - new_max;
      for (int j = 0; j < n; ++j) e[j] = softmax_exp(e[j]);
      for (int j = 0; j < n; ++j) probs[j * lanes + u] = e[j];
    } else {
      for (int j = 0; j < n; ++j) probs[j * lanes + u] = softmax_exp(logits[j * lanes + u] - new_max);
    }
    float norm = mul_add(normalizer[u], correction, probs[u]);
    for (int j = 1; j < n; ++j) norm += probs[j * lanes + u];
    normalizer[u] = norm;
    max_logit[u] = new_max;
    return correction;
  }

  /// The softmax step of add_tile for every lane at once, lanes in vector lanes: lane u folds
  /// logits[0, n[u])[u] (n[u] = 0: lane untouched). Per lane the same operations in the same order as
  /// add_tile, so the same bits; the max, exponentials and normalizer sums vectorize across lanes instead
  /// of waiting on one lane's chain. Writes corrections [lanes]; the values follow with accumulate().
  KOKKOS_INLINE_FUNCTION void softmax_lanes(const int* n, int n_max, float* corrections) const {
    bool every_key = true;  // every lane folds all n_max keys (every tile but a causal diagonal's or padding's)
    for (int u = 0; u < lanes; ++u) every_key = every_key && n[u] == n_max;
    if (every_key)
      softmax_vectors<false>(n, n_max, corrections);
    else
      softmax_vectors<true>(n, n_max, corrections);
  }

  /// softmax_lanes in register vectors (the compiler's own vectorization of scalar loops may pick narrower
  /// ones): `Masked`, lane u folds its first n[u] keys; otherwise every lane folds n_max keys (no masks). The
  /// normalizer sums in the loop that writes the probabilities, in key order.
  template <bool Masked>
  KOKKOS_INLINE_FUNCTION void softmax_vectors(const int* n, int n_max, float* corrections) const {
    constexpr int W = simd::width, V = lanes / W;
    using simd::vec, simd::ivec, simd::load, simd::store, simd::select;
    vec tile_max[V], old_max[V], new_max[V], corr[V], norm[V];
    ivec count[V];
    for (int x = 0; x < V; ++x) {
      tile_max[x] = simd::broadcast(neg_inf());
      norm[x] = simd::broadcast(0.0f);
      old_max[x] = load(max_logit + x * W);
      count[x] = simd::load_int(n + x * W);
    }
    auto folds = [&](int j, int x, const ivec& m) {  // m, and whether the lanes fold key j
      if constexpr (Masked)
        return (simd::broadcast_int(j) < count[x]) & m;
      else
        return m;
    };
    for (int j = 0; j < n_max; ++j)
      for (int x = 0; x < V; ++x) {
        const vec l = load(logits + j * lanes + x * W);
        tile_max[x] = select(folds(j, x, l > tile_max[x]), l, tile_max[x]);
      }
    for (int x = 0; x < V; ++x) {
      new_max[x] = select(tile_max[x] > old_max[x], tile_max[x], old_max[x]);
      corr[x] = softmax_exp(old_max[x] - new_max[x]);
      store(corrections + x * W, corr[x]);
    }
    for (int j = 0; j < n_max; ++j)
      for (int x = 0; x < V; ++x) {
        const vec p = softmax_exp(load(logits + j * lanes + x * W) - new_max[x]);
        store(probs + j * lanes + x * W, p);
        if (j == 0)
          norm[x] = simd::fma(load(normalizer + x * W), corr[x], p);
        else if constexpr (Masked)
          norm[x] = select(simd::broadcast_int(j) < count[x], norm[x] + p, norm[x]);
        else
          norm[x] = norm[x] + p;
      }
    for (int x = 0; x < V; ++x) {
      const ivec live = count[x] > simd::broadcast_int(0);
      store(normalizer + x * W, select(live, norm[x], load(normalizer + x * W)));
      store(max_logit + x * W, select(live, new_max[x], old_max[x]));
    }
  }

  /// accumulate() for `count` lanes at once (lane[i], each with n[i] >= 1 keys of the tile): register tiles
  /// of pv_lanes lanes x pv_vectors register vectors of output channels (then pv_vectors / 2, ... for the
  /// channels left); each value row is loaded once for the group's lanes, each probability broadcast once
  /// for its channels. Keys [0, min n) run for the whole group, each lane's remaining keys after them. Per
  /// lane and channel the same operations in the same key order as accumulate(), so the same bits.
  template <class ValueOf>
  KOKKOS_INLINE_FUNCTION void accumulate_lanes(const int* lane, const int* n, const float* corrections, int count,
                                               ValueOf value_of) const {
    constexpr int UQ = pv_lanes;
    int i0 = 0;
    for (; i0 + UQ <= count; i0 += UQ) {
      static_assert(pv_vectors == 1 || pv_vectors == 2 || pv_vectors == 4, "tile sizes 4, 2, 1 cover the channels");
      int c0 = accumulate_group<pv_vectors>(lane + i0, n + i0, corrections, value_of, 0);
      if constexpr (pv_vectors > 2) c0 = accumulate_group<2>(lane + i0, n + i0, corrections, value_of, c0);
      if constexpr (pv_vectors > 1) c0 = accumulate_group<1>(lane + i0, n + i0, corrections, value_of, c0);
      for (int i = 0; i < UQ; ++i) {
        float* a = acc + long(lane[i0 + i]) * value_dim;
        const float* pr = probs + lane[i0 + i];
        const float corr = corrections[lane[i0 + i]];
        for (int c = c0; c < value_dim; ++c) {
          float r = a[c] * corr;
          for (int j = 0; j < n[i0 + i]; ++j) r = mul_add(pr[j * lanes], to_float(value_of(j)[c]), r);
          a[c] = r;
        }
      }
    }
    for (; i0 < count; ++i0) accumulate(lane[i0], n[i0], corrections[lane[i0]], value_of);
  }

  /// One register tile size of accumulate_lanes: channels [c0, ...) of the pv_lanes lanes lane[0, pv_lanes)
  /// in groups of CV register vectors, as long as a whole group fits in value_dim; returns the first
  /// channel left.
  template <int CV, class ValueOf>
  KOKKOS_INLINE_FUNCTION int accumulate_group(const int* lane, const int* n, const float* corrections,
                                              ValueOf value_of, int c0) const {
    constexpr int UQ = pv_lanes, W = simd::width, CW = CV * W;
    int common = n[0];
    for (int i = 1; i < UQ; ++i) common = n[i] < common ? n[i] : common;
    float* a[UQ];
    const float* pr[UQ];
    for (int i = 0; i < UQ; ++i) a[i] = acc + long(lane[i]) * value_dim, pr[i] = probs + lane[i];
    for (; c0 + CW <= value_dim; c0 += CW) {
      simd::vec r[UQ][CV];
      for (int i = 0; i < UQ; ++i) {
        const simd::vec corr = simd::broadcast(corrections[lane[i]]);
        for (int x = 0; x < CV; ++x) r[i][x] = simd::mul(simd::load(a[i] + c0 + x * W), corr);
      }
      for (int j = 0; j < common; ++j) {
        const auto* vj = value_of(j) + c0;
        simd::vec v[CV];
        for (int x = 0; x < CV; ++x) v[x] = simd::load(vj + x * W);
        for (int i = 0; i < UQ; ++i) {
          const simd::vec pj = simd::broadcast(pr[i][j * lanes]);
          for (int x = 0; x < CV; ++x) r[i][x] = simd::fma(pj, v[x], r[i][x]);
        }
      }
      for (int i = 0; i < UQ; ++i) {
        for (int j = common; j < n[i]; ++j) {
          const auto* vj = value_of(j) + c0;
          const simd::vec pj = simd::broadcast(pr[i][j * lanes]);
          for (int x = 0; x < CV; ++x) r[i][x] = simd::fma(pj, simd::load(vj + x * W), r[i][x]);
        }
        for (int x = 0; x < CV; ++x) simd::store(a[i] + c0 + x * W, r[i][x]);
      }
    }
    return c0;
  }

  /// Channel c of accumulate(): acc_u[c] = acc_u[c] * correction + sum_{j < n} probs[j][u] v_j[c], in key
  /// order (the bits accumulate() gives that channel).
  template <class ValueOf>
  KOKKOS_INLINE_FUNCTION void accumulate_channel(int u, int c, int n, float correction, ValueOf value_of) const {
    float* a = acc + long(u) * value_dim;
    float r = a[c] * correction;
    for (int j = 0; j < n; ++j) r = mul_add(probs[j * lanes + u], to_float(value_of(j)[c]), r);
    a[c] = r;
  }

  /// acc_u = acc_u * correction + sum_{j < n} probs[j][u] v_j, in key order per channel. With vector
  /// registers: 8 register vectors of output channels at a time (a value row of up to 8 x simd::width
  /// channels read once, in one contiguous pass), then one vector at a time; else 32 channels at a time.
  /// Per channel the same operations in the same order, so every form gives the same bits.
  template <class ValueOf>
  KOKKOS_INLINE_FUNCTION void accumulate(int u, int n, float correction, ValueOf value_of) const {
    float* a = acc + long(u) * value_dim;
    int c0 = 0;
    if constexpr (simd::vector_registers) {
      c0 = accumulate_vectors<8>(a, u, n, correction, value_of, c0);
      c0 = accumulate_vectors<1>(a, u, n, correction, value_of, c0);
    } else {
      constexpr int CW = 32;  // output channels held in registers across the tile's keys
      for (; c0 + CW <= value_dim; c0 += CW) {
        float r[CW];
        for (int c = 0; c < CW; ++c) r[c] = a[c0 + c] * correction;
        for (int j = 0; j < n; ++j) {
          const auto* vj = value_of(j) + c0;
          const float pj = probs[j * lanes + u];
          for (int c = 0; c < CW; ++c) r[c] = mul_add(pj, to_float(vj[c]), r[c]);
        }
        for (int c = 0; c < CW; ++c) a[c0 + c] = r[c];
      }
    }
    for (int c = c0; c < value_dim; ++c) {
      float r = a[c] * correction;
      for (int j = 0; j < n; ++j) r = mul_add(probs[j * lanes + u], to_float(value_of(j)[c]), r);
      a[c] = r;
    }
  }

  /// accumulate() over channels [c0, ...) of acc row `a` (lane u) in groups of CV register vectors, as
  /// long as a whole group fits in value_dim; returns the first channel left.
  template <int CV, class ValueOf>
  KOKKOS_INLINE_FUNCTION int accumulate_vectors(float* a, int u, int n, float correction, ValueOf value_of, int c0) const {
    constexpr int W = simd::width, CW = CV * W;
    const simd::vec corr = simd::broadcast(correction);
    for (; c0 + CW <= value_dim; c0 += CW) {
      simd::vec r[CV];
      for (int x = 0; x < CV; ++x) r[x] = simd::mul(simd::load(a + c0 + x * W), corr);
      simd::add_weighted_rows(
          r, n, [&](int j) { return probs[j * lanes + u]; }, [&](int j) { return value_of(j) + c0; });
      for (int x = 0; x < CV; ++x) simd::store(a + c0 + x * W, r[x]);
    }
    return c0;
  }
};

/// Widens keys [0, n) of a tile (key_at(j), storage type of dim channels) and their values (value_at(j),
/// value_dim channels) into blk.tile_keys [n][dim] and blk.tile_values [n][value_dim], a key per thread of
/// `team`. Exact (to_float), so the packed tile gives the bits of the stored one.
template <class Member, class KeyAt, class ValueAt>
KOKKOS_INLINE_FUNCTION void pack_tile(const Member& team, const QueryBlock& blk, int n, KeyAt key_at,
                                      ValueAt value_at) {
  auto widen = [](float* out, const auto* in, int len) {
    constexpr int W = simd::width;
    int c = 0;
    for (; c + W <= len; c += W) simd::store(out + c, simd::load(in + c));
    for (; c < len; ++c) out[c] = to_float(in[c]);
  };
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int j) {
    widen(blk.tile_keys + long(j) * blk.dim, key_at(j), blk.dim);
    widen(blk.tile_values + long(j) * blk.value_dim, value_at(j), blk.value_dim);
  });
}

/// logits[j][*] for keys j0 + [0, n) of a tile (key_at(j), any storage type), NK keys per register tile
/// and the last n % NK one at a time: QueryBlock::logits_one for a block of one live query (`One`),
/// logits_lanes otherwise. Spread over `team` by register tiles; no barrier.
template <int NK, bool One, class Member, class KeyAt, class BiasOf>
KOKKOS_INLINE_FUNCTION void tile_logits(const Member& team, const QueryBlock& blk, const float* scale, long j0, int n,
                                        KeyAt key_at, BiasOf bias_of) {
  using key_ptr = decltype(key_at(0));
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (n + NK - 1) / NK), [&](int g) {
    const int j = g * NK;
    if (j + NK <= n) {
      key_ptr keys[NK];
      for (int jj = 0; jj < NK; ++jj) keys[jj] = key_at(j + jj);
      blk.logits_of<NK, One>(keys, scale, j, j0 + j, bias_of);
    } else {
      for (int jj = j; jj < n; ++jj) {
        key_ptr key[1] = {key_at(jj)};
        blk.logits_of<1, One>(key, scale, jj, j0 + jj, bias_of);
      }
    }
  });
}

/// One key tile of attend_block in the register-tile form: keys j0 + [0, n) (key_at(j), value_at(j) for
/// j in [0, n), any storage type), lane u reading the first keys_of(u) of them. Logits of every lane (a
/// register tile of keys x lanes, or row_dots for a single query), then the softmax step and the values.
/// Collective over `team`; ends with a team barrier.
template <class Member, class KeysOf, class KeyAt, class ValueAt, class BiasOf>
KOKKOS_INLINE_FUNCTION void attend_tile(const Member& team, const QueryBlock& blk, const float* scale, long j0, int n,
                                        KeysOf keys_of, KeyAt key_at, ValueAt value_at, BiasOf bias_of) {
  if (blk.queries == 1) {
    // One query (a G = 1 decode step): every key and value is read once, from memory. Ask for the tile's
    // value rows now, so that they stream in while the logits wait on the keys.
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](int j) {
      const auto* v = value_at(j);
      simd::prefetch(v, long(blk.value_dim) * long(sizeof(*v)));
    });
    tile_logits<simd::width, true>(team, blk, scale, j0, n, key_at, bias_of);
  } else
    tile_logits<QueryBlock::qk_keys, false>(team, blk, scale, j0, n, key_at, bias_of);
  team.team_barrier();
  if (blk.queries == 1) {
    Kokkos::single(Kokkos::PerTeam(team), [&]() { blk.add_tile(0, keys_of(0), value_at); });
  } else {
    float* corrections = blk.probs + QueryBlock::tile * QueryBlock::lanes;
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      int counts[QueryBlock::lanes];
      for (int u = 0; u < QueryBlock::lanes; ++u) counts[u] = keys_of(u);
      blk.softmax_lanes(counts, n, corrections);
    });
    team.team_barrier();
    // The lanes that read keys of this tile, in groups of four per thread (QueryBlock::accumulate_lanes).
    int lane[QueryBlock::lanes], counts[QueryBlock::lanes], live = 0;
    for (int u = 0; u < blk.queries; ++u) {
      const int nu = keys_of(u);
      if (nu > 0) lane[live] = u, counts[live++] = nu;
    }
    constexpr int UQ = QueryBlock::pv_lanes;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (live + UQ - 1) / UQ), [&](int g) {
      const int i0 = UQ * g, m = live - i0 < UQ ? live - i0 : UQ;
      blk.accumulate_lanes(lane + i0, counts + i0, corrections, m, value_at);
    });
  }
  team.team_barrier();
}

/// One key tile in the spread form (TileTraits SpreadTiles): a thread per (key, lane) logit, per lane softmax
/// step and per (lane, channel) sum; the same operations per lane as attend_tile. keys_of(u): keys of the
/// tile that lane u reads; key_at(j), value_at(j), bias_of(j0 + j) for j in [0, n). Ends with a team barrier.
template <class Member, class KeysOf, class KeyAt, class ValueAt, class BiasOf>
KOKKOS_INLINE_FUNCTION void attend_tile_spread(const Member& team, const QueryBlock& blk, const float* scale, long j0,
                                               int n, KeysOf keys_of, KeyAt key_at, ValueAt value_at,
                                               BiasOf bias_of) {
  const int lanes = blk.queries;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n * lanes), [&](int e) {
    const int j = e / lanes, u = e % lanes;
    blk.logit(u, j, key_at(j), scale[u], bias_of(j0 + j));
  });
  team.team_barrier();
  float* corrections = blk.probs + QueryBlock::tile * QueryBlock::lanes;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, lanes), [&](int u) {
    const int nu = keys_of(u);
    if (nu > 0) corrections[u] = blk.softmax_one(u, nu);
  });
  team.team_barrier();
  const int dv = blk.value_dim;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, lanes * dv), [&](int e) {
    const int u = e / dv, c = e % dv, nu = keys_of(u);
    if (nu > 0) blk.accumulate_channel(u, c, nu, corrections[u], value_at);
  });
  team.team_barrier();
}

/// Key tiles per run of attend_run_spread for a block of `live` lanes: the largest of 8, 4, 2 and 1 whose
/// probabilities [tiles x readout_key_tile][live] and per-tile maxima and corrections [2][tiles][live]
/// fit the block's logits and probs (2 x readout_key_tile x readout_query_block floats). A power of two, so
/// runs from key 0 never cross a split (readout_split_keys).
KOKKOS_INLINE_FUNCTION constexpr int spread_run_tiles(int live) {
  constexpr int room = 2 * readout_key_tile * readout_query_block;
  for (int t = 8; t > 1; t /= 2)
    if (t * live * (readout_key_tile + 2) <= room) return t;
  return 1;
}
static_assert(readout_split_keys % (spread_run_tiles(1) * readout_key_tile) == 0, "runs start on a split");

/// A run of key tiles in the spread form for a block whose every live lane reads every key of it (a decode
/// step: one query position, so the lanes' counts agree): keys j0 + [0, n) (n <= spread_run_tiles(queries)
/// x readout_key_tile; key_at(j), value_at(j), bias_of(j0 + j) for j in [0, n)). Five passes, each spread
/// over `team` with a barrier after it, where attend_tile_spread takes three per tile: every (key, lane)
/// logit of the run; each tile's maximum per lane; each lane's running maximum and correction tile by tile;
/// every probability; then every (lane, output channel) sum over the run's keys beside each lane's
/// normalizer. Lane u runs attend_tile_spread's operations for it (QueryBlock::softmax_one,
/// accumulate_channel) tile by tile in the same order, so the bits are the same; only the barriers move.
/// The run's logits, maxima and corrections live in the block's logits and probs. Ends with a team barrier.
template <class Member, class KeyAt, class ValueAt, class BiasOf>
KOKKOS_INLINE_FUNCTION void attend_run_spread(const Member& team, const QueryBlock& blk, const float* scale, long j0,
                                              int n, KeyAt key_at, ValueAt value_at, BiasOf bias_of) {
  constexpr int KT = readout_key_tile;
  const int live = blk.queries, tiles = (n + KT - 1) / KT, dv = blk.value_dim;
  float* prob = blk.logits;                            // [n][live]: the logits, then their probabilities
  float* run_max = prob + long(tiles) * KT * live;     // [tiles][live]: a tile's maximum, then the running one
  float* correction = run_max + long(tiles) * live;    // [tiles][live]: exp(max before the tile - max after)
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n * live), [&](int e) {
    const int j = e / live, u = e % live;
    prob[e] = blk.logit_value(u, key_at(j), scale[u], bias_of(j0 + j));
  });
  team.team_barrier();
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tiles * live), [&](int e) {
    const int t = e / live, u = e % live, end = (t + 1) * KT < n ? (t + 1) * KT : n;
    float m = neg_inf();
    for (int j = t * KT; j < end; ++j) m = prob[j * live + u] > m ? prob[j * live + u] : m;
    run_max[e] = m;
  });
  team.team_barrier();
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, live), [&](int u) {
    float old_max = blk.max_logit[u];
    for (int t = 0; t < tiles; ++t) {
      const float tile_max = run_max[t * live + u];
      const float new_max = tile_max > old_max ? tile_max : old_max;
      correction[t * live + u] = softmax_exp(old_max - new_max);
      run_max[t * live + u] = new_max;
      old_max = new_max;
    }
    blk.max_logit[u] = old_max;
  });
  team.team_barrier();
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n * live), [&](int e) {
    const int j = e / live, u = e % live;
    prob[e] = softmax_exp(prob[e] - run_max[(j / KT) * live + u]);
  });
  team.team_barrier();
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, live * dv + live), [&](int e) {
    if (e >= live * dv) {  // lane u's normalizer, tile by tile (softmax_one's chain)
      const int u = e - live * dv;
      float norm = blk.normalizer[u];
      for (int t = 0; t < tiles; ++t) {
        const int end = (t + 1) * KT < n ? (t + 1) * KT : n;
        norm = mul_add(norm, correction[t * live + u], prob[t * KT * live + u]);
        for (int j = t * KT + 1; j < end; ++j) norm += prob[j * live + u];
      }
      blk.normalizer[u] = norm;
      return;
    }
    const int u = e / dv, c = e % dv;  // accumulate_channel's chain, the value rows read four ahead
    float* a = blk.acc + long(u) * dv + c;
    float r = *a;
    for (int t = 0; t < tiles; ++t) {
      const int end = (t + 1) * KT < n ? (t + 1) * KT : n;
      r = r * correction[t * live + u];
      int j = t * KT;
      for (; j + 4 <= end; j += 4) {
        const float v0 = to_float(value_at(j)[c]), v1 = to_float(value_at(j + 1)[c]),
                    v2 = to_float(value_at(j + 2)[c]), v3 = to_float(value_at(j + 3)[c]);
        r = mul_add(prob[j * live + u], v0, r);
        r = mul_add(prob[(j + 1) * live + u], v1, r);
        r = mul_add(prob[(j + 2) * live + u], v2, r);
        r = mul_add(prob[(j + 3) * live + u], v3, r);
      }
      for (; j < end; ++j) r = mul_add(prob[j * live + u], to_float(value_at(j)[c]), r);
    }
    *a = r;
  });
  team.team_barrier();
}

/// Folds keys [0, count_of(i, u)) into lane u of block blks[i], for the nb <= NB blocks of a team that read
/// the same keys (consecutive query positions of one kv-head), tile by tile from key 0 (the tiles of
/// attend): logit = q_u · key_of(j) * scale_of(i)[u] + bias_of(j), values value_of(j). `max_count` is the
/// largest count over every lane of every block. key_of/value_of return pointers to elements of one storage
/// type (float, bfloat16 or float16), widened to float32 in registers, or first into blks[0]'s packed tile
/// (QueryBlock::packs) once for all the blocks. Each tile is read once for the nb blocks while it is in the
/// nearest cache; every lane runs the operations it runs alone (attend_block), so nb changes no bit.
/// At every readout_split_keys keys a lane that reads on closes its split (QueryBlock::close_split; the
/// blocks need split room where max_count > readout_split_keys): a lane's softmax over the segment is the
/// merge of its splits in order once settle_splits has run, the bits a split-KV decode step gives.
/// Collective over `team`; ends with a team barrier.
/// `Spread` (TileTraits<ExecSpace>::spread) picks how the team covers a tile, not a bit of the result; in
/// the spread form, blocks whose every live lane reads all max_count keys (a decode step) go by runs of
/// spread_run_tiles tiles (attend_run_spread), others tile by tile (attend_tile_spread).
template <bool Spread = false, int NB = 1, class Member, class ScaleOf, class CountOf, class KeyOf, class ValueOf,
          class BiasOf>
KOKKOS_INLINE_FUNCTION void attend_blocks(const Member& team, const QueryBlock* blks, int nb, ScaleOf scale_of,
                                          long max_count, CountOf count_of, KeyOf key_of, ValueOf value_of,
                                          BiasOf bias_of) {
  constexpr int KT = readout_key_tile, L = QueryBlock::lanes;
  using key_type = std::remove_pointer_t<decltype(key_of(0L))>;
  long lane_count[NB][L];  // count_of once per lane, not once per tile
  long block_count[NB] = {};  // the most keys a lane of the block reads (zeroed: GCC -O1 cannot see nb <= NB)
  for (int i = 0; i < nb; ++i) {
    block_count[i] = 0;
    for (int u = 0; u < L; ++u) {
      lane_count[i][u] = u < blks[i].queries ? count_of(i, u) : 0;
      block_count[i] = lane_count[i][u] > block_count[i] ? lane_count[i][u] : block_count[i];
    }
  }
  const bool packed = !Spread && blks[0].packs<key_type>();
  // The spread form walks runs of tiles (attend_run_spread) where every live lane of every block reads every
  // key (a decode step), unless a run is one tile (32 live lanes).
  int step = KT;
  if constexpr (Spread) {
    bool uniform = true;
    int tiles = spread_run_tiles(1);
    for (int i = 0; i < nb; ++i) {
      for (int u = 0; u < blks[i].queries; ++u) uniform = uniform && lane_count[i][u] == max_count;
      const int t = spread_run_tiles(blks[i].queries);
      tiles = t < tiles ? t : tiles;
    }
    if (uniform) step = tiles * KT;
  }
  for (long j0 = 0; j0 < max_count; j0 += step) {
    const int n = static_cast<int>(max_count - j0 < step ? max_count - j0 : step);
    if (j0 > 0 && j0 % readout_split_keys == 0) {  // a split ends: close it in every lane that reads on
      if (blks[0].split_norm == nullptr)
        Kokkos::abort("kvmem::kernels::attend_blocks: a segment past readout_split_keys without split room");
      for (int i = 0; i < nb; ++i)
        if (block_count[i] > j0) {
          const long* counts = lane_count[i];
          const QueryBlock& blk = blks[i];
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries), [&](int u) {
            if (counts[u] > j0) blk.close_split(u);
          });
        }
      team.team_barrier();
    }
    auto key_at = [&](int j) { return key_of(j0 + j); };
    auto values = [&](int j) { return value_of(j0 + j); };
    if (packed) {
      pack_tile(team, blks[0], n, key_at, values);
      team.team_barrier();
    }
    for (int i = 0; i < nb; ++i) {
      if (block_count[i] <= j0) continue;  // no lane of block i reads this tile (same on every thread)
      const long* counts = lane_count[i];
      auto keys_of = [&](int u) {  // keys of this tile that lane u of block i reads
        const long count = counts[u];
        return static_cast<int>(count <= j0 ? 0 : (count - j0 < KT ? count - j0 : KT));
      };
      const QueryBlock& blk = blks[i];
      if constexpr (Spread) {
        if (step > KT)
          attend_run_spread(team, blk, scale_of(i), j0, n, key_at, values, bias_of);
        else
          attend_tile_spread(team, blk, scale_of(i), j0, n, keys_of, key_at, values, bias_of);
      } else if (packed) {
        const float* pk = blks[0].tile_keys;
        const float* pv = blks[0].tile_values;
        const long d = blk.dim, dv = blk.value_dim;
        attend_tile(
            team, blk, scale_of(i), j0, n, keys_of, [&](int j) { return pk + j * d; },
            [&](int j) { return pv + j * dv; }, bias_of);
      } else {
        attend_tile(team, blk, scale_of(i), j0, n, keys_of, key_at, values, bias_of);
      }
    }
  }
}

/// QueryBlock::settle for every live lane of the nb blocks, after their last attend_blocks and before
/// finish() and the log-sum-exp: where no split was closed (no split room, or no segment past
/// readout_split_keys keys) nothing changes. Collective over `team`; ends with a team barrier where the
/// blocks have split room.
template <class Member>
KOKKOS_INLINE_FUNCTION void settle_splits(const Member& team, const QueryBlock* blks, int nb) {
  if (blks[0].split_norm == nullptr) return;
  for (int i = 0; i < nb; ++i) {
    const QueryBlock& blk = blks[i];
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries), [&](int u) { blk.settle(u); });
  }
  team.team_barrier();
}

/// attend_blocks for one block: keys [0, count_of(u)) into lane u of `blk` with logit scales scale[u];
/// `max_count` is the largest count_of(u).
template <bool Spread = false, class Member, class CountOf, class KeyOf, class ValueOf, class BiasOf>
KOKKOS_INLINE_FUNCTION void attend_block(const Member& team, const QueryBlock& blk, const float* scale, long max_count,
                                         CountOf count_of, KeyOf key_of, ValueOf value_of, BiasOf bias_of) {
  attend_blocks<Spread, 1>(
      team, &blk, 1, [&](int) { return scale; }, max_count, [&](int, int u) { return count_of(u); }, key_of,
      value_of, bias_of);
}

/// Which queries the lanes of one query block hold under GQA: the query heads of a kv-head's group read the
/// same keys, so a block holds `heads` query heads of one kv-head at `positions` consecutive positions and
/// reads each key once for all of them. Lane u of a block with n heads (n = heads, or fewer in the last
/// head group when G > readout_query_block) reads query head first_head + u % n at position first + u / n;
/// its live lanes are [0, n x live positions). With G = 1 a block is 32 positions of one head; a decode
/// step (one position) puts a group's G query heads in G lanes. The lanes' layout changes no bit: every
/// lane runs the operations of OnlineSoftmax/attend for its query alone.
struct GroupLanes {
  long group = 1;        ///< G: query heads per kv-head
  int heads = 1;         ///< query heads per block: min(G, readout_query_block)
  int positions = 1;     ///< positions per block: readout_query_block / heads
  long head_groups = 1;  ///< blocks of heads per kv-head: ceil(G / heads)
  long blocks = 1;       ///< position blocks: ceil(max_queries / positions)
  int per_team = 1;      ///< consecutive position blocks per team (TileTraits::blocks_per_team)
  long team_blocks = 1;  ///< teams per (sequence, head group): ceil(blocks / per_team)

  /// The layout for group size G >= 1, at most max_queries >= 1 positions per sequence and up to
  /// `blocks_per_team` >= 1 position blocks per team (they read each key tile once for all of them).
  GroupLanes(long G, long max_queries, int blocks_per_team = 1)
      : group(G),
        heads(static_cast<int>(G < readout_query_block ? G : readout_query_block)),
        positions(readout_query_block / heads),
        head_groups((G + heads - 1) / heads),
        blocks((max_queries + positions - 1) / positions),
        per_team(blocks_per_team),
        team_blocks((blocks + blocks_per_team - 1) / blocks_per_team) {}
  /// Teams for B sequences of Hkv kv-heads.
  [[nodiscard]] long league(long B, long Hkv) const { return B * Hkv * head_groups * team_blocks; }

  /// One team's blocks: sequence b, kv-head h, query heads [first_head, first_head + heads), position block
  /// indices [block, block + per_team) (block x positions + [0, positions) from the caller's first query;
  /// the last team's blocks may run past the queries).
  struct Team {
    long b, h, first_head, block;
    int heads;
  };
  KOKKOS_INLINE_FUNCTION Team team(long league_rank, long Hkv) const {
    Team t{};
    t.block = (league_rank % team_blocks) * per_team;
    long rest = league_rank / team_blocks;
    const long hg = rest % head_groups;
    rest /= head_groups;
    t.h = rest % Hkv;
    t.b = rest / Hkv;
    t.first_head = t.h * group + hg * heads;
    const long left = group - hg * heads;
    t.heads = static_cast<int>(left < heads ? left : heads);
    return t;
  }
};

/// Whether readout() over at most `max_queries` queries per sequence (tokens) runs one team per (sequence,
/// kv-head): G <= readout_query_block and the queries fit one team's blocks (a decode step, or a prefill
/// step of at most readout_query_block x Traits::blocks_per_team / G tokens). Only then can the readout
/// write the step's tokens into the window itself (WindowTokens), as no other team reads that window.
template <class ExecSpace, class Traits = TileTraits<ExecSpace>>
[[nodiscard]] bool readout_writes_window(const MemoryConfig& cfg, long max_queries) {
  const GroupLanes gl(cfg.group(), max_queries > 0 ? max_queries : 1, Traits::blocks_per_team);
  return gl.head_groups == 1 && gl.team_blocks == 1;
}

/// The workspace of a split-KV decode step's readout (DecodeSplits): at most `splits` key splits per
/// (sequence, kv-head) (readout_max_splits), and `partials` [B x Hq, >= splits, Dv + 2] float32, each split's
/// un-normalized output [Dv], max logit and normalizer. splits = 1 (the default): the readout runs unsplit.
template <class MemorySpace>
struct DecodeSplitWork {
  long splits = 1;
  Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> partials;

  /// Whether the partials hold `rows` (B x Hq) x `max_splits` splits of value_dim `dv`.
  [[nodiscard]] bool holds(long rows, long max_splits, int dv) const {
    return static_cast<long>(partials.extent(0)) >= rows && static_cast<long>(partials.extent(1)) >= max_splits &&
           static_cast<long>(partials.extent(2)) >= dv + 2L;
  }
  /// Grows the partials (one allocation on `exec`, contents undefined) unless they hold() already.
  template <class ExecSpace>
  void reserve(const ExecSpace& exec, long rows, long max_splits, int dv) {
    if (holds(rows, max_splits, dv)) return;
    partials = decltype(partials)(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "kvmem::decode_split_partials"),
                                  rows, max_splits, dv + 2L);
  }
};

/// One split of a (sequence, kv-head)'s key list of m state rows and nw window tokens, as attend_blocks
/// splits it: the state at every readout_split_keys rows, the window at every readout_split_keys tokens, the
/// window's first split joined to the state's last (split J = max(ceil(m / S), 1) - 1). Split s reads state
/// rows [row_begin, row_end) then window offsets [window_begin, window_end) (offsets from the window's first
/// position; a split of the window alone has row_begin = row_end = m).
struct KeySplit {
  long row_begin = 0, row_end = 0, window_begin = 0, window_end = 0;

  /// Splits of the key list: J + 1 + max(ceil(nw / S) - 1, 0).
  KOKKOS_INLINE_FUNCTION static long count(long m, long nw) {
    constexpr long S = readout_split_keys;
    const long a = (m + S - 1) / S, c = (nw + S - 1) / S;
    return (a > 1 ? a : 1) + (c > 1 ? c - 1 : 0);
  }
  /// Split s in [0, count(m, nw)).
  KOKKOS_INLINE_FUNCTION static KeySplit of(long s, long m, long nw) {
    constexpr long S = readout_split_keys;
    const long a = (m + S - 1) / S, joined = a > 0 ? a - 1 : 0;
    KeySplit k;
    if (s < joined) {
      k.row_begin = s * S, k.row_end = (s + 1) * S;
    } else if (s == joined) {
      k.row_begin = joined * S, k.row_end = m, k.window_end = nw < S ? nw : S;
    } else {
      const long w = s - joined;
      k.row_begin = k.row_end = m;
      k.window_begin = w * S, k.window_end = nw < (w + 1) * S ? nw : (w + 1) * S;
    }
    return k;
  }
};

/// The most key splits of a decode step's readout over state rows that fit `row_capacity` rows and a
/// window that fits `window_slots` tokens (KeySplit::count at both).
[[nodiscard]] inline long readout_max_splits(long row_capacity, long window_slots) {
  return KeySplit::count(row_capacity, window_slots);
}

namespace detail {

/// The split-KV form of a decode step's readout (readout() with a DecodeSplitWork of splits > 1): one team
/// per (sequence, kv-head, head group, split) folds its split's keys (KeySplit) into an empty softmax and
/// writes its partial to work.partials; splits past a sequence's KeySplit::count do nothing. Then one thread
/// per (sequence, query head, channel) merges the sequence's splits in order (merge_softmax), writes y and,
/// where asked, the log-sum-exp (lse, out_lse as readout()). A split's softmax starts empty at its first key,
/// as after a prefill's close_split, so the step gives the bits of the unsplit readout.
template <class Merge, class ExecSpace, StorageType T, class QueriesIn, class Out, class Lse, class Traits, class OutLse>
void readout_split_kv(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                      const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                      const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                      const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q, const Out& y,
                      const DecodeSplitWork<typename ExecSpace::memory_space>& work, const Lse& lse,
                      const OutLse& out_lse) {
  const long B = static_cast<long>(plan.device.extent(0));
  const long Hq = cfg.query_heads, Hkv = cfg.kv_heads;
  const int D = cfg.head_dim, Dv = cfg.value_dim;
  constexpr int QB = readout_query_block;
  const GroupLanes gl(cfg.group(), 1, 1);
  const long splits = work.splits;
  const auto part = work.partials;
  const auto p = plan.device;
  using policy_t = Kokkos::TeamPolicy<ExecSpace, step_launch>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  constexpr bool packed = !std::is_same_v<T, float>;
  const long floats = QueryBlock::scratch_floats(D, Dv, packed);
  policy_t policy(exec, gl.league(B, Hkv) * splits, Kokkos::AUTO);
  const int level = scratch_level(policy, scratch_t::shmem_size(floats));
  policy = policy.set_scratch_size(level, Kokkos::PerTeam(scratch_t::shmem_size(floats)));
  Kokkos::parallel_for(
      "kvmem::readout_split", policy, KOKKOS_LAMBDA(const member_t& team) {
        const long s = team.league_rank() % splits;
        const auto t = gl.team(team.league_rank() / splits, Hkv);
        const long b = t.b, h = t.h, n = t.heads;
        const long pos = p(b, query_begin);
        if (p(b, query_end) <= pos) return;  // an inactive sequence
        const long m = p(b, read_rows), wb = p(b, window_begin_pos), off = p(b, input_offset);
        const long nw = pos + 1 - wb;
        if (s >= KeySplit::count(m, nw)) return;
        const KeySplit ks = KeySplit::of(s, m, nw);
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blk;
        blk.carve(scratch.data(), static_cast<int>(n), D, Dv, packed);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.read_lanes()), [&](int u) {
          const long hq = t.first_head + u % n;
          const typename QueriesIn::value_type* qu = u < blk.queries ? &q(b, hq, pos - off, 0) : nullptr;
          blk.load(u, qu);
          blk.scales[u] = qu ? Merge::logit_scale(w.tau_state[hq], qu, D) : 0.0f;
          blk.scales[QB + u] = qu ? Merge::logit_scale(w.tau_window[hq], qu, D) : 0.0f;
        });
        team.team_barrier();
        const long r0 = ks.row_begin, rows_read = ks.row_end - ks.row_begin;
        attend_block<Traits::spread>(
            team, blk, blk.scales, rows_read, [&](int) { return rows_read; },
            [&](long i) { return &rows.read_keys(b, h, r0 + i, 0); },
            [&](long i) { return &rows.read_values(b, h, r0 + i, 0); },
            [&](long i) { return Merge::row_bias(rows.row(b, h, r0 + i)); });
        const long first_slot = ring.slot_after(ring.slot(wb), ks.window_begin);
        const long window_read = ks.window_end - ks.window_begin;
        attend_block<Traits::spread>(
            team, blk, blk.scales + QB, window_read, [&](int) { return window_read; },
            [&](long j) { return &ring.keys(b, h, ring.slot_after(first_slot, j), 0); },
            [&](long j) { return &ring.values(b, h, ring.slot_after(first_slot, j), 0); }, NoBias{});
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries),
                             [&](int u) { blk.store_partial(u, &part(b * Hq + t.first_head + u, s, 0)); });
      });
  using out_type = std::remove_cv_t<typename Out::value_type>;
  Kokkos::parallel_for(
      "kvmem::readout_split_merge", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * Hq * Dv), KOKKOS_LAMBDA(const long e) {
        const long bh = e / Dv, b = bh / Hq, hq = bh % Hq;
        const int c = static_cast<int>(e % Dv);
        const long pos = p(b, query_begin), u = pos - p(b, input_offset);
        if (p(b, query_end) <= pos) return;
        const long count = KeySplit::count(p(b, read_rows), pos + 1 - p(b, window_begin_pos));
        float lse_u = 0.0f;
        y(b, hq, u, c) = from_float<out_type>(merge_partials(part, bh, count, c, Dv, c == 0 ? &lse_u : nullptr));
        if (c == 0 && lse.data() != nullptr) lse(b, hq, 0) = lse_u;
        if (c == 0 && out_lse.data() != nullptr) out_lse(b, hq, u) = lse_u;
      });
}

}  // namespace detail

/// Attention output for the queries of every (sequence b, query head hq) at positions
/// [query_begin, query_end) of plan row b (spec KVM.md §3, OVQ.md §4):
///   logit(u, i) = q_u · read_keys_i * Merge::logit_scale(tau_state[hq], q_u) + Merge::row_bias(row i)
///                 for state rows i < read_rows,
///   logit(u, p) = q_u · k_p * Merge::logit_scale(tau_window[hq], q_u) for window positions
///                 window_begin <= p <= u (k_p as Merge::window_key stored it),
///   y_u = softmax(logits) · [read_values ; v].
/// q [B, Hq, T, D] and y [B, Hq, T, Dv] are indexed by position - input_offset and need unit channel
/// stride; their element type, that of the state's read caches and of the window (the storage type T) may
/// be float, bfloat16 or float16, read as float32, with float32 logits, softmax and sums (docs/numerics.md).
/// Query head hq reads kv-head hq / G (GQA). `max_queries` bounds query_end - query_begin.
/// The state rows and the window are two segments of the key list, each split every readout_split_keys
/// keys (attend_blocks); the window's first split continues the state's last one, so a query that reads at
/// most readout_split_keys rows and window tokens reads them in one online softmax.
/// A team computes Traits::blocks_per_team consecutive blocks of readout_query_block queries of one kv-head's
/// group (GroupLanes: the query heads that share the kv-head, at consecutive positions; QueryBlock,
/// attend_blocks: one pass over the keys for all of them), in a fixed order: the same bits on every run of
/// a backend, for any block layout and on any thread count.
/// When `lse` [B, Hq, >= max_queries] is not empty, lse(b, hq, u - query_begin) also receives each query's
/// log-sum-exp max + log(normalizer) (for row eviction, score::RowEviction); otherwise nothing is paid.
/// When `out_lse` [B, Hq, T] (float32, any layout) is not empty, out_lse(b, hq, u - input_offset) receives the
/// same log-sum-exp, indexed as y (the readout's log-sum-exp an engine asked for: AttentionMemory).
/// `Traits` (TileTraits<ExecSpace>) picks how a team covers a key tile; it changes no bit.
/// With `split_work` of splits > 1 (a decode step: max_queries = 1, and no `fresh`; std::logic_error
/// otherwise) the step runs split-KV (detail::readout_split_kv) with the same bits.
/// With `fresh` a WindowTokens (only where readout_writes_window(cfg, max_queries); std::logic_error
/// otherwise), each team first writes the tokens [write_begin, write_end) of its (sequence, kv-head) into
/// the window ring (write_window_token, the bits write_window stores), then reads them: a decode step
/// without write_window's launch.
template <class Merge, class ExecSpace, StorageType T, class QueriesIn, class Out,
          class Lse = Kokkos::View<float***, Kokkos::LayoutRight, typename ExecSpace::memory_space>,
          class Traits = TileTraits<ExecSpace>, class Fresh = NoWindowTokens,
          class OutLse = Kokkos::View<float***, Kokkos::LayoutStride, typename ExecSpace::memory_space>>
void readout(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
             const state::StateRows<typename ExecSpace::memory_space, T>& rows,
             const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
             const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q, const Out& y,
             long max_queries, const Lse& lse = Lse{}, const Fresh& fresh = Fresh{}, const OutLse& out_lse = OutLse{},
             const DecodeSplitWork<typename ExecSpace::memory_space>& split_work = {}) {
  const long B = static_cast<long>(plan.device.extent(0));
  if constexpr (Fresh::writes)
    if (!readout_writes_window<ExecSpace, Traits>(cfg, max_queries) || split_work.splits > 1)
      throw std::logic_error("kvmem::kernels::readout: WindowTokens where a kv-head's window has several teams");
  if (max_queries <= 0 || B == 0) return;
  if (split_work.splits > 1) {
    if (max_queries != 1 || !split_work.holds(B * cfg.query_heads, split_work.splits, cfg.value_dim))
      throw std::logic_error("kvmem::kernels::readout: split-KV outside a decode step, or partials too small");
    detail::readout_split_kv<Merge, ExecSpace, T, QueriesIn, Out, Lse, Traits, OutLse>(exec, cfg, w, rows, ring, plan, q, y,
                                                                                  split_work, lse, out_lse);
    return;
  }
  constexpr int QB = readout_query_block, NB = Traits::blocks_per_team;
  const int Hkv = cfg.kv_heads, D = cfg.head_dim, Dv = cfg.value_dim;
  const GroupLanes gl(cfg.group(), max_queries, NB);
  const auto p = plan.device;
  // Dynamic schedule: a causal query block's work grows with its position, so equal shares of the league
  // are unequal work (with a static split over 2 threads of one head, one thread did 3/4 of it). Each team
  // writes only its own outputs, so the schedule cannot change a bit.
  using policy_t = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>, step_launch>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  constexpr bool packed = !std::is_same_v<T, float>;  // room for a widened key tile (QueryBlock::packs)
  // Room for closed splits where the state rows or the window (positions that fit the ring) may pass
  // readout_split_keys.
  const bool split = QueryBlock::needs_split_room(rows.capacity() > ring.slots() ? rows.capacity() : ring.slots());
  const long floats = QueryBlock::team_floats(NB, D, Dv, packed, split);
  policy_t policy(exec, gl.league(B, Hkv), Kokkos::AUTO);
  const int level = scratch_level(policy, scratch_t::shmem_size(floats));
  policy = policy.set_scratch_size(level, Kokkos::PerTeam(scratch_t::shmem_size(floats)));
  Kokkos::parallel_for(
      "kvmem::readout", policy, KOKKOS_LAMBDA(const member_t& team) {
        const auto t = gl.team(team.league_rank(), Hkv);
        const long b = t.b, h = t.h, n = t.heads;
        const long begin = p(b, query_begin), end = p(b, query_end);
        // Named outside the if constexpr: nvcc's extended lambdas cannot first-capture inside one.
        [[maybe_unused]] const Fresh& tokens = fresh;
        [[maybe_unused]] const MemoryConfig& config = cfg;
        [[maybe_unused]] const auto& window = ring;
        if constexpr (Fresh::writes)  // the only team of (b, h): a barrier below orders it before the reads
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p(b, write_begin), p(b, write_end)), [&](long pos) {
            write_window_token<Merge>(config, window, p, tokens.k, tokens.v, tokens.gate, b, h, pos);
          });
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blks[NB];
        long firsts[NB] = {};
        int nb = 0;  // the team's blocks that hold queries of row b
        for (; nb < NB && begin + (t.block + nb) * gl.positions < end; ++nb) {
          const long first = begin + (t.block + nb) * gl.positions, last = Kokkos::min(end, first + gl.positions);
          firsts[nb] = first;
          blks[nb].carve_in_team(scratch.data(), nb, static_cast<int>((last - first) * n), D, Dv, packed, split);
        }
        if (nb == 0) return;
        const long m = p(b, read_rows), wb = p(b, window_begin_pos), off = p(b, input_offset);
        const long wb_slot = ring.slot(wb);  // the window's positions [wb, last) fit the ring's slots
        for (int i = 0; i < nb; ++i)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blks[i].read_lanes()), [&](int u) {
            const long hq = t.first_head + u % n;
            const typename QueriesIn::value_type* qu =
                u < blks[i].queries ? &q(b, hq, firsts[i] + u / n - off, 0) : nullptr;
            blks[i].load(u, qu);
            blks[i].scales[u] = qu ? Merge::logit_scale(w.tau_state[hq], qu, D) : 0.0f;
            blks[i].scales[QB + u] = qu ? Merge::logit_scale(w.tau_window[hq], qu, D) : 0.0f;
          });
        team.team_barrier();
        attend_blocks<Traits::spread, NB>(
            team, blks, nb, [&](int i) { return blks[i].scales; }, m, [&](int, int) { return m; },
            [&](long i) { return &rows.read_keys(b, h, i, 0); }, [&](long i) { return &rows.read_values(b, h, i, 0); },
            [&](long i) { return Merge::row_bias(rows.row(b, h, i)); });
        const long last = firsts[nb - 1] + blks[nb - 1].queries / n;  // one past the team's last position
        attend_blocks<Traits::spread, NB>(
            team, blks, nb, [&](int i) { return blks[i].scales + QB; }, last - wb,
            [&](int i, int u) { return firsts[i] + u / n + 1 - wb; },
            [&](long j) { return &ring.keys(b, h, ring.slot_after(wb_slot, j), 0); },
            [&](long j) { return &ring.values(b, h, ring.slot_after(wb_slot, j), 0); }, NoBias{});
        settle_splits(team, blks, nb);
        for (int i = 0; i < nb; ++i) {
          const QueryBlock& blk = blks[i];
          const long first = firsts[i];
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries),
                               [&](int u) { blk.finish(u, &y(b, t.first_head + u % n, first + u / n - off, 0)); });
          if (lse.data() != nullptr || out_lse.data() != nullptr)
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries), [&](int u) {
              const long hq = t.first_head + u % n, pos = first + u / n;
              const float l = blk.max_logit[u] + Kokkos::log(blk.normalizer[u]);
              if (lse.data() != nullptr) lse(b, hq, pos - begin) = l;
              if (out_lse.data() != nullptr) out_lse(b, hq, pos - off) = l;
            });
        }
      });
}

}  // namespace kvmem::kernels
