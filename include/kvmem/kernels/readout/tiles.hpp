#pragma once
/// \file tiles.hpp
/// The register-tile form of one key tile of a query block (CPUs: TileTraits RegisterTiles): packing a
/// tile, its logits, its softmax step and values (attend_tile).

#include <Kokkos_Core.hpp>

#include "../../dtype.hpp"
#include "../../math/simd.hpp"
#include "../../math/vector_ops.hpp"
#include "query_block.hpp"

namespace kvmem::kernels {

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

}  // namespace kvmem::kernels
