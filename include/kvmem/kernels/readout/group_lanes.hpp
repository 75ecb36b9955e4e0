#pragma once
/// \file group_lanes.hpp
/// GroupLanes: which queries the lanes of a query block hold under GQA, and which team holds which blocks.

#include <Kokkos_Core.hpp>

#include "online_softmax.hpp"

namespace kvmem::kernels {

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

}  // namespace kvmem::kernels
