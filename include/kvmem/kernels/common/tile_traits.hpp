#pragma once
/// \file tile_traits.hpp
/// How a readout team covers one key tile, per Kokkos execution space.

#include <Kokkos_Core.hpp>

namespace kvmem::kernels {

/// The register-tile form (CPU execution spaces): a team is one thread or a few, each with wide vector
/// registers; a thread computes a register tile of keys x query lanes (QueryBlock::logits_lanes), one
/// thread runs the softmax step of every lane in vector lanes (softmax_lanes), and a thread accumulates the
/// values of four lanes at once (accumulate_lanes). A team takes two consecutive query blocks and reads each
/// key tile once for both (attend_blocks): the tile is still in L1 for the second block, and a 16-bit tile is
/// widened to float32 once per 64 queries instead of once per 32.
struct RegisterTiles {
  static constexpr bool spread = false;
  static constexpr int blocks_per_team = 2;
};

/// The spread form (GPU execution spaces, where a team is 128 or more threads): every (key, query lane)
/// logit of the tile is its own thread's dot product, every lane's softmax step its own thread, and every
/// (lane, output channel) sum its own thread, so a decode step (a query block of G live lanes) keeps the
/// whole team busy instead of one thread per tile. A block whose every lane reads every key (a decode step)
/// walks runs of up to 8 tiles with five team barriers per run instead of three per tile, its loads read
/// four channels or value rows ahead (attend_run_spread). A team takes one query block (more teams to fill
/// the device's multiprocessors).
struct SpreadTiles {
  static constexpr bool spread = true;
  static constexpr int blocks_per_team = 1;
};

/// How the readout (readout.hpp: attend_block, used by every memory's readout and by exact attention)
/// covers a key tile on `ExecSpace`: RegisterTiles by default, SpreadTiles on Cuda and HIP. The arithmetic
/// of each logit, softmax step and output channel is the same sequence of operations in both forms
/// (kernels::dot's chain, OnlineSoftmax::add_tile's order), so the two give the same bits
/// (tests/unit/test_tile_spread.cpp): prefill and decode stay bit-identical on every backend whichever form
/// it runs; blocks_per_team (query blocks sharing a team's pass over the keys) changes no bit either.
/// Specialize it for another execution space to choose its form.
template <class ExecSpace>
struct TileTraits : RegisterTiles {};

#if defined(KOKKOS_ENABLE_CUDA)
template <>
struct TileTraits<Kokkos::Cuda> : SpreadTiles {};
#endif
#if defined(KOKKOS_ENABLE_HIP)
template <>
struct TileTraits<Kokkos::HIP> : SpreadTiles {};
#endif

}  // namespace kvmem::kernels
