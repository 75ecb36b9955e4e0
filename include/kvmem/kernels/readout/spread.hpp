#pragma once
/// \file spread.hpp
/// The spread form of key tiles of a query block (GPUs: TileTraits SpreadTiles): a thread per (key, lane)
/// logit and per (lane, channel) sum, tile by tile (attend_tile_spread) or by runs of tiles for a decode
/// step (attend_run_spread); the same operations per lane as the register-tile form.

#include <Kokkos_Core.hpp>

#include "../../dtype.hpp"
#include "../../math/softmax_exp.hpp"
#include "../../math/vector_ops.hpp"
#include "online_softmax.hpp"
#include "query_block.hpp"

namespace kvmem::kernels {

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

}  // namespace kvmem::kernels
