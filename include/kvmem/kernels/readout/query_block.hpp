#pragma once
/// \file query_block.hpp
/// QueryBlock: the online softmaxes of up to readout_query_block queries that read the same keys, in one
/// team's scratch, with register-blocked logits and value sums (the block form of OnlineSoftmax).

#include <Kokkos_Core.hpp>

#include "../../dtype.hpp"
#include "../../math/simd.hpp"
#include "../../math/softmax_exp.hpp"
#include "../../math/vector_ops.hpp"
#include "online_softmax.hpp"

namespace kvmem::kernels {

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

}  // namespace kvmem::kernels
