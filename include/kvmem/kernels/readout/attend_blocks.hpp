#pragma once
/// \file attend_blocks.hpp
/// attend_blocks: the nb query blocks of a team folded over one key list tile by tile (in the register-tile
/// or the spread form), with the split closes every readout_split_keys keys (settle_splits).

#include <Kokkos_Core.hpp>

#include "online_softmax.hpp"
#include "query_block.hpp"
#include "spread.hpp"
#include "tiles.hpp"

namespace kvmem::kernels {

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

}  // namespace kvmem::kernels
