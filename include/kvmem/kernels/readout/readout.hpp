#pragma once
/// \file readout.hpp
/// The readout's one entry point. A memory's step hands kernels::readout_step its state, plan and logit scales
/// (ReadoutStep), the step's views and its workspace (ReadoutWork); readout_step chooses the form itself
/// (FlashInfer's tensor cores, split-KV decode, the tile readout whose teams write the window, the tile
/// readout), records the choice in the workspace, writes the window's new tokens where the form does not,
/// runs what must run between that write and the read (a lazy policy's fold), and reads. Every form leaves
/// the same state bit for bit; y and lse are the same bits in the three portable forms and agree with the
/// tensor-core form within docs/numerics.md, "The readout on tensor cores".
///
/// The forms, one header each beside this one: launch.hpp (the tile readout's launch), split_kv.hpp,
/// flashinfer.hpp; below them attend_blocks.hpp, tiles.hpp (CPUs' register tiles), spread.hpp (GPUs' spread
/// tiles), query_block.hpp, group_lanes.hpp and online_softmax.hpp.

#include <Kokkos_Core.hpp>

#include "../../config.hpp"
#include "../../dtype.hpp"
#include "../../policy/layer_weights.hpp"
#include "../../state/state_rows.hpp"
#include "../plan/step_plan.hpp"
#include "flashinfer.hpp"
#include "group_lanes.hpp"
#include "launch.hpp"
#include "split_kv.hpp"
#include "window_write.hpp"

namespace kvmem::kernels {

/// The form of a step's readout, as readout_step chose it (ReadoutWork::form holds the last step's).
enum class ReadoutForm {
  tiles,                 ///< readout() over a window that write_window filled first
  tiles_writing_window,  ///< readout() whose teams write their window's new tokens themselves (readout_writes_window)
  split_kv,              ///< readout() of a decode step in parallel key splits (DecodeSplits, split_kv.hpp)
  tensor_cores,          ///< flashinfer_readout: FlashInfer's FA2 on Kokkos::Cuda (flashinfer_readout_applies)
};

/// A memory's readout workspace and settings, one per memory, reused by every step: the schedule of a
/// decode step's key splits (`decode_splits`), whether tensor cores may run (`path`), the form of the last
/// step (`form`), split-KV decode's partials (`split`: [B x Hq, splits, Dv + 2] float32) and the tensor-core
/// form's buffers (`tensor_cores`, FlashInferWork). Buffers grow on the host only (readout_step, reserve_decode).
template <class MemorySpace, StorageType T>
struct ReadoutWork {
  DecodeSplits decode_splits = DecodeSplits::automatic;
  ReadoutPath path = ReadoutPath::automatic;
  ReadoutForm form = ReadoutForm::tiles;
  DecodeSplitWork<MemorySpace> split;
  FlashInferWork<MemorySpace, T> tensor_cores;

  /// Grows the buffers that a decode step (one query per sequence) of `batch` sequences over at most
  /// `row_capacity` state rows and a window ring of `window_slots` slots may need, whatever decode_splits and
  /// path say then: after it no such step allocates (Memory::reserve, for decode_async and graph capture).
  template <class ExecSpace>
  void reserve_decode(const ExecSpace& exec, const MemoryConfig& cfg, long batch, long row_capacity,
                      long window_slots) {
    const long splits = readout_max_splits(row_capacity, window_slots);
    if (splits > 1) split.reserve(exec, batch * cfg.query_heads, splits, cfg.value_dim);
    if constexpr (flashinfer_readout_built<ExecSpace, T>) {
      const auto sh = flashinfer_readout_shape(cfg, batch, 1, row_capacity, window_slots);
      tensor_cores.reserve(exec, batch, 1, cfg.query_heads, cfg.kv_heads, row_capacity, window_slots, cfg.value_dim,
                           sh.most_blocks(), sh.most_chunks());
    }
  }
};

/// What a step's readout reads besides its views: the memory's configuration, its logit scales (`weights`:
/// tau_state, tau_window per query head), its state rows and window ring, the step's plan on the device
/// (each sequence's queries, rows read and window: StepPlan), `batch` sequences, at most `tokens` queries per
/// sequence (1: a decode step), whether a fold runs between the window write and the read and may read the
/// new tokens (`fold_before_read`: a lazy policy's fold of a block > 0; the window is then written by its own
/// launch before the fold), and whether the row statistics read each query's log-sum-exp (`needs_row_lse`:
/// row eviction; the tensor-core form does not give it).
template <class MemorySpace, StorageType T>
struct ReadoutStep {
  const MemoryConfig& cfg;
  LayerWeightsRef weights;
  const state::StateRows<MemorySpace, T>& rows;
  const state::WindowRing<MemorySpace, T>& ring;
  const StepPlan<MemorySpace>& plan;
  long batch = 0;
  long tokens = 0;
  bool fold_before_read = false;
  bool needs_row_lse = false;
};

/// The form `step` with queries `q` [B, Hq, T, D] takes under `work`'s settings, recorded in work.form: tensor
/// cores where flashinfer_readout_applies; else split-KV for a decode step whose keys may span several
/// splits where splits_decode says so under work.decode_splits (work.split grows to the bound then: an
/// allocation unless reserve_decode ran); else the tile readout, its teams writing the window where one team
/// reads each window (readout_writes_window) and no fold comes between; else the tile readout after
/// write_window. Host only; no kernel runs.
template <class ExecSpace, StorageType T, class QueriesIn>
ReadoutForm choose_readout(const ExecSpace& exec, ReadoutWork<typename ExecSpace::memory_space, T>& work,
                           const ReadoutStep<typename ExecSpace::memory_space, T>& step, const QueriesIn& q) {
  work.split.splits = 1;
  if (flashinfer_readout_applies<ExecSpace, T>(work.path, step.cfg, step.rows, step.ring, q, step.needs_row_lse))
    return work.form = ReadoutForm::tensor_cores;
  if (step.tokens == 1) {
    const long bound = readout_max_splits(step.rows.capacity(), step.ring.slots());
    const GroupLanes gl(step.cfg.group(), 1, 1);
    if (splits_decode(exec, work.decode_splits, bound, gl.league(step.batch, step.cfg.kv_heads))) {
      work.split.reserve(exec, step.batch * step.cfg.query_heads, bound, step.cfg.value_dim);
      work.split.splits = bound;
      return work.form = ReadoutForm::split_kv;
    }
  }
  if (readout_writes_window<ExecSpace>(step.cfg, step.tokens) && !step.fold_before_read)
    return work.form = ReadoutForm::tiles_writing_window;
  return work.form = ReadoutForm::tiles;
}

/// One step's readout (spec KVM.md §3, OVQ.md §4: one softmax over [state rows ; block sliding window], the
/// meaning of kernels::readout): the form from choose_readout; the step's new keys `k`, values `v` [B, Hkv,
/// T, D/Dv] and merge gates `gate` [B, Hkv, T] (empty where the policy has none) written into the window
/// ring (write_window, or by the readout's own teams); then `before_read()` (the caller's fold, or nothing);
/// then y [B, Hq, T, Dv] from queries `q` [B, Hq, T, D], with each query's log-sum-exp into `row_lse`
/// [B, Hq, >= tokens] where it is not empty (row statistics) and into `lse` [B, Hq, T] where it is not empty
/// (lse_out). Launches only: no fence, no copy; an allocation only where choose_readout grows a buffer.
/// Throws std::runtime_error where FlashInfer or CUDA refuses a launch.
template <class Merge, class ExecSpace, StorageType T, class QueriesIn, class TokensIn, class GatesIn, class Out,
          class RowLse, class OutLse, class BeforeRead>
void readout_step(const ExecSpace& exec, ReadoutWork<typename ExecSpace::memory_space, T>& work,
                  const ReadoutStep<typename ExecSpace::memory_space, T>& step, const QueriesIn& q, const TokensIn& k,
                  const TokensIn& v, const GatesIn& gate, const Out& y, const RowLse& row_lse, const OutLse& lse,
                  BeforeRead&& before_read) {
  const ReadoutForm form = choose_readout(exec, work, step, q);
  if (form != ReadoutForm::tiles_writing_window)
    write_window<Merge>(exec, step.cfg, step.ring, step.plan, k, v, gate, step.tokens);
  before_read();
  switch (form) {
    case ReadoutForm::tensor_cores:
      flashinfer_readout<Merge>(exec, step.cfg, step.weights, step.rows, step.ring, step.plan, q, y, step.tokens, lse,
                                work.tensor_cores);
      break;
    case ReadoutForm::tiles_writing_window:
      readout<Merge>(exec, step.cfg, step.weights, step.rows, step.ring, step.plan, q, y, step.tokens, row_lse,
                     WindowTokens<TokensIn, GatesIn>{k, v, gate}, lse);
      break;
    case ReadoutForm::tiles:
    case ReadoutForm::split_kv:  // work.split.splits says which
      readout<Merge>(exec, step.cfg, step.weights, step.rows, step.ring, step.plan, q, y, step.tokens, row_lse,
                     NoWindowTokens{}, lse, work.split);
      break;
  }
}

}  // namespace kvmem::kernels
