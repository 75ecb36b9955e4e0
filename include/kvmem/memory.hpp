#pragma once
/// \file memory.hpp
/// Memory<ExecSpace, Merge, Budget, Scorer, RowPolicy, Storage>: the public facade that composes a bounded attention memory.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "config.hpp"
#include "dtype.hpp"
#include "errors.hpp"
#include "kernels/plan/decode_plan.hpp"
#include "kernels/readout/readout.hpp"
#include "kernels/update/row_eviction.hpp"
#include "kernels/plan/step_plan.hpp"
#include "kernels/update/update.hpp"
#include "policy/budget/concept.hpp"
#include "policy/layer_weights.hpp"
#include "policy/merge/concept.hpp"
#include "policy/score/append_scorer.hpp"
#include "policy/score/row_eviction.hpp"
#include "prompt_calls.hpp"
#include "state/schedule.hpp"
#include "state/sequence_counts.hpp"
#include "state/sequence_reset.hpp"
#include "state/slot_protocol.hpp"
#include "state/state_rows.hpp"
#include "token_checks.hpp"

namespace kvmem {

/// A bounded attention memory for one layer and a batch of sequences, composed at compile time from a
/// merge policy, a budget schedule and an eviction scorer, running on the Kokkos execution space
/// `ExecSpace` (kvm-paper Sec. 4 and App. A, spec KVM.md §3-§6: KVM = WinnerTakeAll x Novelty; ovq-paper
/// Sec. 3.2, spec OVQ.md §2-§6: OVQ = KMeansCount x Novelty with one window chunk and no sinks; any
/// budget schedule).
///
/// Tensors are views in (sequence, head, token, channel) index order with unit channel stride; any other
/// strides are accepted, so an engine's [tokens, heads, head_dim] buffer is wrapped without a copy
/// (LayoutStride).
/// - q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], gate [B, Hkv, T] (merge-gate pre-activation z;
///   an empty view means z = 0), y [B, Hq, T, Dv] (written), all of element type Storage.
///
/// Storage, the storage type (kvmem/dtype.hpp: float, the default, kvmem::bfloat16 or kvmem::float16), is the
/// element type of the inputs and outputs and of what the memory holds per token: the block sliding
/// window's keys and values and the state rows' read caches (the keys and values every readout streams).
/// The merge accumulators (running sums, radius, counts), gates, logits, softmax statistics and every sum
/// are float32; a value is widened when loaded and rounded once (to nearest even, saturating at the type's range)
/// when stored. Inputs of another element type are a compile error: nothing is converted behind the
/// caller's back. The error bounds against float64 are in docs/numerics.md.
/// Per (sequence, kv-head) the memory holds state rows (keys, values, radius) and the block sliding
/// window of the last window_chunks * chunk tokens. prefill() and decode() have one meaning: a prompt
/// through prefill or through decode token by token gives the same bits, and decode continues a
/// prefilled cache.
///
/// RowPolicy (score::RowEviction; default score::KeepRows, none) optionally evicts state rows too: after a
/// fold leaves more than RowPolicy::max_rows rows, the rows with the lowest statistic go (e.g.
/// score::RowAccumulatedAttention, H2O over rows: KVM merging with eviction of stale rows). The schedule
/// still decides how many rows each fold appends (its growth, as if no row had been evicted: the other
/// tokens of the block merge as usual), and the eviction takes the rows back to the cap.
template <class ExecSpace, merge::MergePolicy Merge, budget::BudgetSchedule Budget, score::AppendScorer Scorer,
          score::RowEviction RowPolicy = score::KeepRows, StorageType Storage = float>
class Memory : public detail::PromptCalls<Memory<ExecSpace, Merge, Budget, Scorer, RowPolicy, Storage>> {
  using Calls = detail::PromptCalls<Memory>;
  friend Calls;

 public:
  using Calls::extend;
  using Calls::prefill;
  using execution_space = ExecSpace;
  using storage_type = Storage;
  using memory_space = typename ExecSpace::memory_space;
  using merge_type = Merge;
  using budget_type = Budget;
  using scorer_type = Scorer;
  using row_policy_type = RowPolicy;
  using tokens_in = Kokkos::View<const Storage****, Kokkos::LayoutStride, memory_space>;
  using gates_in = Kokkos::View<const Storage***, Kokkos::LayoutStride, memory_space>;
  using tokens_out = Kokkos::View<Storage****, Kokkos::LayoutStride, memory_space>;
  /// The views one call reads, bundled (kvmem::AttentionMemory): q [B, Hq, T, D], k [B, Hkv, T, D], v [B,
  /// Hkv, T, Dv] and gate [B, Hkv, T] (merge-gate pre-activations; an empty view means z = 0).
  struct inputs {
    tokens_in q, k, v;
    gates_in gate;

    /// Token t of every input ([B, heads, 1, ...], the same strides, no copy): the inputs of one decode
    /// step out of a prompt's (kvmem::AttentionMemory).
    [[nodiscard]] inputs token(long t) const {
      return {detail::token_slice(q, t), detail::token_slice(k, t), detail::token_slice(v, t),
              detail::token_slice(gate, t)};
    }
  };
  /// The readout's log-sum-exp [B, Hq, T], float32, any strides (kvmem::AttentionMemory): lse[b, h, t] =
  /// log sum_j exp(logit_j) over every key that query (b, h, t) reads (state rows with their bias, window
  /// tokens), the natural log of the softmax normalizer, so that y can be merged with another attention over
  /// other keys (y = (e^lse1 y1 + e^lse2 y2) / (e^lse1 + e^lse2)). -inf where a query reads no key (t >=
  /// lengths[b] in a prefill).
  using lse_out = Kokkos::View<float***, Kokkos::LayoutStride, memory_space>;
  /// y is one softmax over keys, so the readout has a log-sum-exp (lse_out).
  static constexpr bool softmax_readout = true;

  /// A memory for `batch` sequences. `weights.tau_state`/`tau_window` [Hq] are the per-head factors of
  /// Merge::logit_scale (KVM temperatures, OVQ beta); `ln_weight`/`ln_bias` [D] are needed when
  /// Merge::uses_layer_norm. Throws kvmem::invalid_argument for a bad config field, budget parameter,
  /// `batch` < 1, or weights whose extents do not match the config.
  Memory(const MemoryConfig& config, const Budget& budget, const LayerWeights<memory_space>& weights, int batch,
         const ExecSpace& exec = ExecSpace())
      : cfg_(config), budget_(budget), weights_(weights), exec_(exec) {
    cfg_.validate();
    budget_.validate();
    weights_.validate(cfg_, Merge::uses_layer_norm);
    require(batch >= 1, "batch", batch, "must be >= 1");
    cursors_.allocate("kvmem::cursors", batch, state::SequenceCursor{});
    cursors_.upload(exec_);
    active_.allocate("kvmem::active", batch, 1L);
    active_.upload(exec_);
    plan_error_ = decltype(plan_error_)("kvmem::plan_error");
    folds_.cover(exec_, cfg_, budget_, Merge::first_chunk_verbatim, 1);  // later growths double it
    rows_.allocate(batch, cfg_.kv_heads, cfg_.chunk, cfg_.head_dim, cfg_.value_dim);
    ring_.allocate(batch, cfg_.kv_heads, cfg_.window() + cfg_.chunk, cfg_.head_dim, cfg_.value_dim);
    scratch_.allocate(batch, cfg_.kv_heads, cfg_.chunk, cfg_.head_dim);
    plan_.allocate(batch);
    if constexpr (RowPolicy::evicts) rows_.allocate_stats();
    if constexpr (RowPolicy::needs_probabilities)
      lse_ = decltype(lse_)("kvmem::readout_lse", batch, cfg_.query_heads, std::max(cfg_.window(), static_cast<long>(cfg_.chunk)));
  }

  /// A memory whose state rows are also evicted by `row_policy` (see the class comment). Throws
  /// kvmem::invalid_argument as the constructor above, and for a row cap max_rows <= sinks.
  Memory(const MemoryConfig& config, const Budget& budget, const LayerWeights<memory_space>& weights, int batch,
         const RowPolicy& row_policy, const ExecSpace& exec = ExecSpace())
      : Memory(config, budget, weights, batch, exec) {
    row_policy.validate();
    if constexpr (RowPolicy::evicts)
      require(row_policy.max_rows > config.sinks, "max_rows (row eviction)", row_policy.max_rows,
              "must exceed sinks = " + std::to_string(config.sinks) + " (sink rows are never evicted)");
    row_policy_ = row_policy;
  }

  /// Runs lengths[b] tokens of each sequence b (all T when `lengths` is empty) after those it holds: y[b, :,
  /// t] for t < lengths[b] is the attention output of its t-th new token, y[b, :, t] for t >= lengths[b] is
  /// written as zeros, and a sequence with lengths[b] = 0 keeps its state bit for bit (another request's
  /// slot). A sequence that holds no tokens takes its prompt chunk-parallel (spec KVM.md §4); one that
  /// holds tokens continues it (chunked prefill: a prompt in pieces, interleaved with other sequences'
  /// decode steps) through the decode step, token by token: both give the bits of one prefill of the whole
  /// prompt (docs/design.md, "Requests that come and go"). Throws kvmem::invalid_argument, before anything
  /// changes, for mismatched shapes, a length outside [0, T], sinks >= chunk when merges happen, or, under
  /// set_strict_slots(true), a sequence with lengths[b] > 0 that holds tokens (extend() continues it).
  void prefill(const tokens_in& q, const tokens_in& k, const tokens_in& v, const gates_in& gate, const tokens_out& y,
               std::span<const long> lengths = {}) {
    run_prompt(inputs{q, k, v, gate}, y, lengths, lse_out{}, state::SlotCall::prefill);
  }

 private:
  void run_prompt(const inputs& in, const tokens_out& y, std::span<const long> lengths, const lse_out& lse,
                  state::SlotCall call) {
    const char* where = call == state::SlotCall::prefill ? "prefill" : "extend";
    const auto& [q, k, v, gate] = in;
    const long T = static_cast<long>(q.extent(2));
    check_inputs(q, k, v, gate, y, T, where);
    detail::check_lse_view(lse, where, batch(), cfg_.query_heads, T);
    detail::check_lengths(lengths, batch(), T);
    std::vector<long> len(batch(), T);
    if (!lengths.empty()) std::copy(lengths.begin(), lengths.end(), len.begin());
    sync();
    state::check_slots(call, this->strict_slots_, batch(), lengths, T, [&](long b) { return cursors_.host(b).tokens; });
    // Sequences that hold tokens continue through the decode step; the others start chunk-parallel.
    std::vector<long> fresh(batch(), 0), continued(batch(), 0);
    for (long b = 0; b < batch(); ++b) {
      const long held = cursors_.host(b).tokens;
      cfg_.check_sinks(held + len[b]);
      (held == 0 ? fresh : continued)[b] = len[b];
    }
    Kokkos::deep_copy(exec_, y, Storage{});
    if (lse.data() != nullptr) Kokkos::deep_copy(exec_, lse, -std::numeric_limits<float>::infinity());
    prefill_fresh(in, y, lse, fresh);
    prefill_continued(in, y, lse, continued);
  }

 public:

  /// decode() below with the inputs bundled (the AttentionMemory contract).
  void decode(const inputs& in, const tokens_out& y, std::span<const unsigned char> active = {}) {
    decode(in, y, active, lse_out{});
  }
  /// decode() that also writes the readout's log-sum-exp lse [B, Hq, 1] (lse_out) of the active sequences
  /// (not written when empty). Throws as decode(), and for an lse of other extents than [B, Hq, 1].
  void decode(const inputs& in, const tokens_out& y, std::span<const unsigned char> active, const lse_out& lse) {
    const auto& [q, k, v, gate] = in;
    check_decode(q, k, v, gate, y);
    detail::check_lse_view(lse, "decode", batch(), cfg_.query_heads, 1);
    sync();
    state::check_slots(state::SlotCall::decode, this->strict_slots_, batch(), active,
                       [&](long b) { return cursors_.host(b).tokens; });
    set_active(active);
    for (long b = 0; b < batch(); ++b)
      if (active_.host(b) != 0) cfg_.check_sinks(cursors_.host(b).tokens + 1);
    const Bounds bounds = plan_on_host();
    rows_.grow(bounds.most_rows);
    if (!cursors_.shared())  // the device plans from its own counts (a GPU, or plan_on_device())
      kernels::plan_decode(exec_, shape(), cursors_.device(), folds_.device, folds_.folds, rows_.capacity(),
                           std::numeric_limits<long>::max(), active_.device(), plan_.device, plan_error_);
    run_step(in, y, lse, bounds, /*update_first=*/!Merge::commit_eagerly);
    fence_step();
  }
  /// decode_async() below with the inputs bundled (the AttentionMemory contract).
  void decode_async(const inputs& in, const tokens_out& y) { decode_async(in, y, lse_out{}); }

  /// Appends one token to every sequence b with active[b] != 0 (all when `active` is empty) and writes
  /// its attention output (spec KVM.md §6: push, direct append, at most one update, drop, readout).
  /// q [B, Hq, 1, D], k [B, Hkv, 1, D], v [B, Hkv, 1, Dv], gate [B, Hkv, 1], y [B, Hq, 1, Dv]; rows of
  /// inactive sequences in y are left untouched. Returns when y is written (one fence). The step's plan is
  /// worked out on the host for its launch bounds and, on a GPU, by the device from its own counts
  /// (kernels::plan_decode): no plan is copied; `active` is copied only when it changes (set_active()).
  /// Throws kvmem::invalid_argument for mismatched shapes, a token count other than 1, sinks >= chunk at
  /// the first merge, or, under set_strict_slots(true), an active sequence that holds no token, before
  /// anything changes.
  void decode(const tokens_in& q, const tokens_in& k, const tokens_in& v, const gates_in& gate, const tokens_out& y,
              std::span<const unsigned char> active = {}) {
    decode(inputs{q, k, v, gate}, y, active, lse_out{});
  }

  /// decode() as launches only, for capture in a CUDA graph and replay (FlashInfer's plan/run split: reserve()
  /// and set_active() plan, this runs): no host allocation, no copy, no fence and no read of device data;
  /// y is written when the execution space is fenced. The sequences set_active() chose each take one token.
  /// On a GPU the device plans each step from its own counts (kernels::plan_decode) with fixed launch
  /// bounds (a fold's kernel on every step, row statistics over every allocated row), so every replay
  /// launches the same kernels; the host's counts stay behind until sync(). What must stay fixed between
  /// replays: the batch, the active set, the views' addresses (q, k, v, gate, y and the memory's own, which
  /// reserve() fixes) and the horizon. A step that would reach the horizon is refused on the device (that
  /// sequence keeps its state and its y) and reported by the next sync(). On a host memory space this is
  /// decode() with the active set of set_active() and without the fence (CUDA graphs do not apply there),
  /// unless plan_on_device() made it plan as a GPU does.
  /// Once it has run on a GPU, the host cannot know how often a graph replayed it: every later sync() (and
  /// so every decode(), prefill() and reserve()) reads the counts back, one fence and two copies, until
  /// reset(). decode() with an empty `active` makes every sequence active again, which a graph captured for
  /// fewer would then replay. Throws kvmem::invalid_argument, before anything is launched, for mismatched
  /// shapes, a token count other than 1, or (on a GPU, or after plan_on_device()) no reserve() since
  /// construction or reset().
  void decode_async(const tokens_in& q, const tokens_in& k, const tokens_in& v, const gates_in& gate,
                    const tokens_out& y) {
    decode_async(inputs{q, k, v, gate}, y, lse_out{});
  }
  /// decode_async() that also writes the readout's log-sum-exp lse [B, Hq, 1] (lse_out) of the active
  /// sequences (not written when empty; its address, too, must stay fixed between replays). Throws as
  /// decode_async(), and for an lse of other extents than [B, Hq, 1].
  void decode_async(const inputs& in, const tokens_out& y, const lse_out& lse) {
    const auto& [q, k, v, gate] = in;
    check_decode(q, k, v, gate, y);
    detail::check_lse_view(lse, "decode", batch(), cfg_.query_heads, 1);
    if (cursors_.shared()) {  // a host backend: the host plans in place
      for (long b = 0; b < batch(); ++b)
        if (active_.host(b) != 0) cfg_.check_sinks(cursors_.host(b).tokens + 1);
      const Bounds bounds = plan_on_host();
      rows_.grow(bounds.most_rows);
      run_step(in, y, lse, bounds, /*update_first=*/!Merge::commit_eagerly);
    } else {
      if (horizon_ <= 0)
        throw invalid_argument(detail::describe("horizon", horizon_, "decode_async needs reserve(tokens) first"));
      kernels::plan_decode(exec_, shape(), cursors_.device(), folds_.device, folds_.folds, rows_.capacity(), horizon_,
                           active_.device(), plan_.device, plan_error_);
      Bounds fixed;  // every replay launches the same kernels over the same ranges
      fixed.tokens = 1;
      fixed.block = cfg_.chunk;
      fixed.most_read = rows_.capacity();
      run_step(in, y, lse, fixed, /*update_first=*/!Merge::commit_eagerly);
      cursors_.device_advanced();
    }
  }

  /// Chooses the sequences the next steps advance: active[b] != 0 (all when `active` is empty). One copy to
  /// the device when the set changes, none otherwise. Throws kvmem::invalid_argument for a size other than
  /// the batch.
  void set_active(std::span<const unsigned char> active) { state::set_active(active_, active, exec_); }

  /// Plans and counts decode steps as a GPU does, on any execution space: from now on the device's counts
  /// are kept apart from the host's, decode_async() launches the device's own planning with fixed launch
  /// bounds and leaves the host's counts behind until sync(), and a step past reserve()'s horizon is
  /// refused on the device. On a GPU that is how it always runs; on a host backend it costs a copy of the
  /// counts and, for decode_async(), launches over fixed bounds, and exists so that CPU machines run and
  /// test the GPU's path (tests/unit/test_decode_async.cpp). Keeps every count and the state; idempotent.
  void plan_on_device() {
    sync();
    state::keep_apart(exec_, cursors_, active_);
  }

  /// Prepares launch-only decoding (decode_async) of every sequence up to `tokens` tokens: the fold table
  /// and the state capacity those positions need (one allocation and copy each when they grow, and the
  /// state's regrowth), so that no replay allocates. Throws kvmem::invalid_argument for `tokens` < 1,
  /// sinks >= chunk when `tokens` passes window + chunk (merges then need a non-sink row), or a refusal
  /// that sync() reports.
  void reserve(long tokens) {
    require(tokens >= 1, "tokens", tokens, "must be >= 1");
    cfg_.check_sinks(tokens);
    sync();
    const long C = cfg_.chunk;
    const long needed = state::window_begin(tokens + 1, C, cfg_.window()) / C + 1;  // blocks folded by then
    folds_.cover(exec_, cfg_, budget_, Merge::first_chunk_verbatim, needed);
    long rows = folds_.granted_after(needed - 1);
    if constexpr (RowPolicy::evicts)  // a verbatim first chunk holds C rows before any eviction
      rows = std::min(rows, std::max(row_policy_.max_rows, Merge::first_chunk_verbatim ? C : 0L) + C);
    rows_.grow(std::max({rows, C, 1L}));
    // The readout's buffers for a decode step in any form (split-KV, tensor cores), so that no replay allocates.
    readout_.reserve_decode(exec_, cfg_, batch(), rows_.capacity(), ring_.slots());
    horizon_ = tokens;
  }

  /// How decode steps whose keys span several splits of kernels::readout_split_keys keys are scheduled
  /// (kernels::DecodeSplits: split-KV decode where the step has fewer teams than the backend has threads, or
  /// forced either way). Every choice gives the same bits; a GPU graph captured before a change replays the
  /// schedule it captured.
  void set_decode_splits(kernels::DecodeSplits mode) { readout_.decode_splits = mode; }
  [[nodiscard]] kernels::DecodeSplits decode_splits() const { return readout_.decode_splits; }

  /// Which kernel the readout runs (kernels::ReadoutPath): `automatic` (the default) takes FlashInfer's
  /// tensor cores where kernels::flashinfer_readout_applies (Kokkos::Cuda, 16-bit storage, a build linking
  /// kvmem::flashinfer, D == Dv in {64, 128}, no row eviction), `portable` the portable readout always. The
  /// state (rows, counts, window) is the same bit for bit either way: no merge reads the readout; y and lse
  /// differ within docs/numerics.md, "The readout on tensor cores". A GPU graph captured before a change
  /// replays the path it captured.
  void set_readout_path(kernels::ReadoutPath path) { readout_.path = path; }
  [[nodiscard]] kernels::ReadoutPath readout_path() const { return readout_.path; }
  /// The form the last step's readout took (kernels::ReadoutForm: tensor cores, split-KV, the tile readout
  /// writing the window or after write_window), as kernels::readout_step chose it; `tiles` before any step.
  [[nodiscard]] kernels::ReadoutForm readout_form() const { return readout_.form; }
  /// Whether this build can run this memory's readout on tensor cores (kernels::flashinfer_readout_built).
  static constexpr bool tensor_core_readout_built = kernels::flashinfer_readout_built<ExecSpace, Storage>;
  /// Whether a step with queries `q` [B, Hq, T, D] runs its readout on tensor cores under the current
  /// readout_path() (kernels::flashinfer_readout_applies: the layout of q and the memory's sizes).
  [[nodiscard]] bool tensor_core_readout(const tokens_in& q) const {
    return kernels::flashinfer_readout_applies<ExecSpace, Storage>(readout_.path, cfg_, rows_, ring_, q,
                                                                   RowPolicy::needs_probabilities);
  }

  /// Brings the host's counts (cursor(), window_tokens(), held_bytes()) up to the device's after
  /// decode_async steps on a GPU and their replays: one fence and two copies; nothing on a host memory
  /// space (unless plan_on_device()) or before the first decode_async. Throws kvmem::invalid_argument when
  /// a step was refused (naming the position and whether it passed reserve()'s horizon or needed a fold or
  /// state rows that reserve() did not prepare), after taking the counts back.
  void sync() {
    if (!cursors_.replayable()) return;
    static const std::string label = "kvmem::Memory::sync";
    cursors_.sync(exec_, label);
    // (On a host memory space the mirror is plan_error_ itself: read it before clearing it.)
    const auto error = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, plan_error_);
    const long refusal = error(0), position = error(1) - 1;
    if (refusal == kernels::decode_ok) return;
    Kokkos::deep_copy(plan_error_, 0L);
    const std::string why = refusal == kernels::past_horizon
                                ? "passed reserve(tokens = " + std::to_string(horizon_) + ")"
                                : "needed a fold or state rows that reserve(tokens = " + std::to_string(horizon_) +
                                      ") did not prepare";
    throw invalid_argument(detail::describe("decode_async position", position,
                                            "a replayed step " + why +
                                                " and was refused (that sequence kept its state and y); reserve "
                                                "further before replaying"));
  }

  /// Forgets every sequence (state rows and window); keeps the allocations.
  void reset() {
    exec_.fence();  // replays still in flight write the cursors
    cursors_.forget_replays();
    Kokkos::deep_copy(exec_, plan_error_, 0L);
    for (long b = 0; b < batch(); ++b) cursors_.host(b) = state::SequenceCursor{};
    cursors_.mark_changed();
    cursors_.upload(exec_);
    horizon_ = 0;
    Kokkos::deep_copy(exec_, rows_.keys, 0.0f);
    Kokkos::deep_copy(exec_, rows_.values, 0.0f);
    Kokkos::deep_copy(exec_, rows_.read_keys, Storage{});
    Kokkos::deep_copy(exec_, rows_.read_values, Storage{});
    if (rows_.decision_keys.data() != nullptr) Kokkos::deep_copy(exec_, rows_.decision_keys, 0.0f);
    Kokkos::deep_copy(exec_, rows_.radius, 0.0f);
    Kokkos::deep_copy(exec_, rows_.counts, 0.0f);
    exec_.fence();
  }

  /// Forgets sequence b (a finished request frees its slot): its state rows, counts and window, so that its
  /// next tokens run as in a new memory, bit for bit; every other sequence keeps its state bit for bit.
  /// reserve()'s horizon and the active set stay. Throws kvmem::invalid_argument, before anything changes,
  /// for b outside [0, B), or for a sequence in decode_async's active set once the device counts steps on
  /// its own (a GPU after decode_async, or plan_on_device()): a captured graph would go on advancing it.
  void reset_sequence(long b) {
    state::check_reset_sequence(b, cursors_, active_);
    sync();
    exec_.fence();
    cursors_.host(b) = state::SequenceCursor{};
    cursors_.mark_changed();
    cursors_.upload(exec_);
    state::fill_sequence(exec_, rows_.keys, b, 0.0f);
    state::fill_sequence(exec_, rows_.values, b, 0.0f);
    state::fill_sequence(exec_, rows_.read_keys, b, Storage{});
    state::fill_sequence(exec_, rows_.read_values, b, Storage{});
    state::fill_sequence(exec_, rows_.decision_keys, b, 0.0f);
    state::fill_sequence(exec_, rows_.radius, b, 0.0f);
    state::fill_sequence(exec_, rows_.counts, b, 0.0f);
    state::fill_sequence(exec_, rows_.stats, b, 0.0);
    exec_.fence();
  }

  [[nodiscard]] const MemoryConfig& config() const { return cfg_; }
  [[nodiscard]] const Budget& budget() const { return budget_; }
  [[nodiscard]] long batch() const { return cursors_.size(); }
  /// Token counts of sequence b: tokens seen, tokens covered by the state, state rows (same per kv-head).
  /// Throws kvmem::invalid_argument for b outside [0, B) or when decode_async steps ran on a GPU since the
  /// last sync() (the host's counts are then behind the device's).
  [[nodiscard]] const state::SequenceCursor& cursor(long b) const {
    detail::check_sequence(b, batch(), cursors_.ahead(), "cursor(b)");
    return cursors_.host(b);
  }
  /// Tokens sequence b has seen (cursor(b).tokens). Throws as cursor(b).
  [[nodiscard]] long tokens(long b) const { return cursor(b).tokens; }
  /// The fold table of decode steps (rows granted and appended per block), for inspection.
  [[nodiscard]] const kernels::FoldTable<memory_space>& fold_table() const { return folds_; }
  /// State rows [B, Hkv, capacity, ...]; rows [0, cursor(b).rows) of sequence b are live.
  [[nodiscard]] const state::StateRows<memory_space, Storage>& rows() const { return rows_; }
  /// Tokens of sequence b held in the block sliding window: n - window_begin(n).
  [[nodiscard]] long window_tokens(long b) const {
    const long n = cursor(b).tokens;
    return n - state::window_begin(n, cfg_.chunk, cfg_.window());
  }
  /// Bytes the batch holds as its memory: per kv-head, state rows x (D + Dv + 1) float32 (key and value
  /// sums, and the row's radius or count) plus window tokens x ((D + Dv) x sizeof(Storage) + 4) (key and value in
  /// the storage type, a float32 gate). Read caches are derived data and are not counted
  /// (allocated_bytes() counts them).
  [[nodiscard]] long held_bytes() const {
    long rows = 0, tokens = 0;
    for (long b = 0; b < batch(); ++b) rows += cursor(b).rows, tokens += window_tokens(b);
    const long channels = cfg_.head_dim + cfg_.value_dim;
    return cfg_.kv_heads * (rows * (channels + 1) * static_cast<long>(sizeof(float)) +
                            tokens * (channels * static_cast<long>(sizeof(Storage)) + static_cast<long>(sizeof(float))));
  }
  /// Bytes this object has allocated on the device (state, read caches, window ring, scratch).
  [[nodiscard]] long allocated_bytes() const {
    const auto f32 = rows_.keys.span() + rows_.values.span() + rows_.decision_keys.span() + rows_.radius.span() +
                     rows_.counts.span() + ring_.gates.span();
    const auto stored = rows_.read_keys.span() + rows_.read_values.span() + ring_.keys.span() + ring_.values.span();
    return static_cast<long>(f32 * sizeof(float) + stored * sizeof(Storage)) + scratch_.bytes();
  }

 private:
  /// The chunk-parallel prefill of the empty sequences b with len[b] > 0 (spec KVM.md §4); sequences with
  /// len[b] = 0 are not planned (their state and y stay).
  void prefill_fresh(const inputs& in, const tokens_out& y, const lse_out& lse, const std::vector<long>& len) {
    const long longest = *std::max_element(len.begin(), len.end());
    if (longest == 0) return;
    const long C = cfg_.chunk, L = cfg_.window();
    // Front block: exact causal attention over the first min(T, L) tokens, no state. Then the first chunk
    // becomes rows verbatim (KVM), or is committed like any later block when it is due (OVQ).
    plan_.clear();
    long front_block = 0;
    for (long b = 0; b < batch(); ++b) {
      if (len[b] == 0) continue;
      auto& cur = cursors_.host(b);
      const long front = std::min(len[b], L);
      set_io(b, 0, 0, front, 0, 0);
      cur.tokens = front;
      if constexpr (Merge::first_chunk_verbatim) {
        const long first = std::min(len[b], C);
        set_block(b, 0, first, 0, first);
        cur.covered = cur.rows = cur.granted = first;
        front_block = std::max(front_block, first);
      } else if (fold_due(cur, len[b], front)) {
        plan_block(b, cur);
        front_block = C;
      }
    }
    run_step(in, y, lse, std::min(longest, L), front_block, /*update_first=*/false);
    // Chunks [s, s + C) for s = L, L + C, ...: attend to [state ; window], then fold the block that is due.
    for (long s = L; s < longest; s += C) {
      plan_.clear();
      long block = 0;
      for (long b = 0; b < batch(); ++b) {
        if (s >= len[b]) continue;
        auto& cur = cursors_.host(b);
        const long e = std::min(len[b], s + C);
        set_io(b, 0, s, e, state::window_begin(e, C, L), cur.rows);
        cur.tokens = e;
        if (fold_due(cur, len[b], e)) {
          plan_block(b, cur);
          block = C;
        }
      }
      run_step(in, y, lse, C, block, /*update_first=*/false);
    }
    cursors_.mark_changed();
    cursors_.upload(exec_);  // the device plans decode steps from these
    fence_step();
  }

  /// Continues each sequence b by len[b] tokens (0: not at all), one decode step per position t of the views
  /// (spec KVM.md §6; a decode step gives a prefill's bits), the other sequences inactive; y[b, :, t] is
  /// written where sequence b takes token t. The active set of set_active() is restored after.
  void prefill_continued(const inputs& in, const tokens_out& y, const lse_out& lse, const std::vector<long>& len) {
    const long longest = *std::max_element(len.begin(), len.end());
    if (longest == 0) return;
    std::vector<unsigned char> saved(batch()), step(batch());
    for (long b = 0; b < batch(); ++b) saved[b] = active_.host(b) != 0;
    for (long t = 0; t < longest; ++t) {
      for (long b = 0; b < batch(); ++b) step[b] = t < len[b];
      decode(in.token(t), detail::token_slice(y, t), step, detail::token_slice(lse, t));
    }
    set_active(saved);
  }
  void set_io(long b, long offset, long first, long last, long window_first, long read_rows) {
    auto& h = plan_.host;
    h(b, kernels::input_offset) = offset;
    h(b, kernels::write_begin) = first;
    h(b, kernels::write_end) = last;
    h(b, kernels::query_begin) = first;
    h(b, kernels::query_end) = last;
    h(b, kernels::window_begin_pos) = window_first;
    h(b, kernels::read_rows) = read_rows;
  }
  /// Whether the next block [covered, covered + C) of `cur` folds in once `seen` tokens of a sequence of
  /// `length` have been read out: when the window no longer holds it (lazy; spec KVM.md §4, §6) or, for
  /// an eager policy, as soon as it is complete (spec OVQ.md §5-§6).
  [[nodiscard]] bool fold_due(const state::SequenceCursor& cur, long length, long seen) const {
    const long horizon = Merge::commit_eagerly ? seen + 1 : std::min(length, seen + cfg_.chunk);
    return state::window_begin(horizon, cfg_.chunk, cfg_.window()) > cur.covered;
  }
  /// Plans the fold of `cur`'s next block for sequence b and advances the cursor past it.
  void plan_block(long b, state::SequenceCursor& cur) {
    // The schedule grants rows as if none were ever evicted (cur.granted); a fold appends what it grants.
    // Without row eviction granted == rows. With it, the growth of the budget becomes the number of fresh
    // rows per fold, the other tokens still merge, and as many stale rows are evicted.
    const auto up = state::plan_update(cfg_, budget_, cur.granted, cur.covered);
    set_block(b, cur.covered, cfg_.chunk, cur.rows, up.append);
    cur.granted = up.rows_after();
    cur.rows += up.append;
    if constexpr (RowPolicy::evicts) {
      const long evicted = std::max(0L, cur.rows - row_policy_.max_rows);
      plan_.host(b, kernels::rows_evicted) = evicted;
      cur.rows -= evicted;
    }
    cur.covered += cfg_.chunk;
  }
  void set_block(long b, long first, long count, long rows_before, long append) {
    auto& h = plan_.host;
    h(b, kernels::block_begin) = first;
    h(b, kernels::block_count) = count;
    h(b, kernels::rows_before) = rows_before;
    h(b, kernels::append_count) = append;
  }
  /// Launch bounds of a step: tokens written and read per sequence, the largest block folded, the most
  /// state rows any sequence holds during the step and the most it reads.
  struct Bounds {
    long tokens = 0, block = 0, most_rows = 1, most_read = 0;
  };
  /// The bounds of the step planned in plan_.host, given `tokens` and `block`.
  [[nodiscard]] Bounds host_bounds(long tokens, long block) const {
    Bounds bd{tokens, block, 1, 0};
    for (long b = 0; b < batch(); ++b) {  // before row eviction a fold may hold more rows than the cursor
      bd.most_rows = std::max({bd.most_rows, cursors_.host(b).rows,
                               plan_.host(b, kernels::rows_before) + plan_.host(b, kernels::append_count)});
      bd.most_read = std::max(bd.most_read, plan_.host(b, kernels::read_rows));
    }
    return bd;
  }
  [[nodiscard]] kernels::DecodeShape shape() const {
    long cap = -1;
    if constexpr (RowPolicy::evicts) cap = row_policy_.max_rows;
    return kernels::DecodeShape::of<Merge>(cfg_, cap);
  }
  /// Plans a decode step of the active sequences on the host (kernels::plan_decode_token into plan_.host,
  /// cursors advanced): on a host memory space the plan the kernels read, elsewhere the launch bounds of the
  /// plan the device works out alike. Extends the fold table first when a fold needs it.
  Bounds plan_on_host() {
    long needed = 0, block = 0, queries = 0;
    for (long b = 0; b < batch(); ++b)
      if (active_.host(b) != 0) needed = std::max(needed, cursors_.host(b).covered / cfg_.chunk + 1);
    folds_.cover(exec_, cfg_, budget_, Merge::first_chunk_verbatim, needed);
    plan_.clear();
    const auto s = shape();
    for (long b = 0; b < batch(); ++b) {
      if (active_.host(b) == 0) continue;
      const long folded = kernels::plan_decode_token(s, cursors_.host(b), folds_.host, folds_.folds,
                                                     kernels::PlanRow<decltype(plan_.host)>{plan_.host, b});
      if (folded < 0) throw std::logic_error("kvmem::Memory: a cursor the fold table does not describe");
      block = std::max(block, folded);
      queries = 1;
    }
    return host_bounds(queries, block);
  }
  /// Launches a step planned in plan_.device: the readout (kernels::readout_step: it chooses its form, writes
  /// the window and reads) with a lazy policy's fold between its window write and its read, the row
  /// statistics, then an eager policy's fold. A lazy fold of a block > 0 may read the new tokens (a sink, a
  /// verbatim first chunk), so the window is then written before it. No fence, no copy.
  void run_step(const inputs& in, const tokens_out& y, const lse_out& lse, const Bounds& bd, bool update_first) {
    const auto& [q, k, v, gate] = in;
    const auto w = LayerWeightsRef::of(weights_);
    auto update = [&] {
      kernels::update_state<Merge, Scorer, RowPolicy::evicts>(exec_, cfg_, w, rows_, ring_, scratch_, plan_, bd.block);
    };
    const kernels::ReadoutStep<memory_space, Storage> step{cfg_, w, rows_, ring_, plan_, batch(), bd.tokens,
                                                           update_first && bd.block > 0, RowPolicy::needs_probabilities};
    kernels::readout_step<Merge>(exec_, readout_, step, q, k, v, gate, y, lse_, lse, [&] {
      if (update_first) update();
    });
    if constexpr (RowPolicy::needs_probabilities)
      kernels::accumulate_row_attention<Merge>(exec_, cfg_, w, rows_, plan_, q, lse_, row_policy_, bd.most_read);
    if (!update_first) update();
  }
  /// A prefill step planned in plan_.host: the state grown to the plan's rows, the plan sent, the kernels
  /// launched.
  void run_step(const inputs& in, const tokens_out& y, const lse_out& lse, long tokens, long block, bool update_first) {
    const Bounds bd = host_bounds(tokens, block);
    rows_.grow(bd.most_rows);
    plan_.upload(exec_);
    run_step(in, y, lse, bd, update_first);
  }
  void fence_step() const {
    static const std::string fence_label = "kvmem::Memory::step";  // not Kokkos' default name, a heap string per call
    exec_.fence(fence_label);
  }
  void check_decode(const tokens_in& q, const tokens_in& k, const tokens_in& v, const gates_in& gate,
                    const tokens_out& y) const {
    // Checks here run every token: each builds its message only when it fails, so decode allocates no
    // host memory of its own (docs/reliability.md, soak runs).
    detail::check_one_token(q);
    check_inputs(q, k, v, gate, y, 1, "decode");
  }
  void check_inputs(const tokens_in& q, const tokens_in& k, const tokens_in& v, const gates_in& gate,
                    const tokens_out& y, long T, const char* where) const {
    // Messages are built only on failure: decode runs this every token (see decode()).
    detail::check_attention_views(q, k, v, y, where, batch(), cfg_.query_heads, cfg_.kv_heads, T, cfg_.head_dim,
                                  cfg_.value_dim);
    if (gate.data() != nullptr)
      detail::check_token_view(gate, "gate", where, batch(), {cfg_.kv_heads, "the kv-heads Hkv"}, T, {0, ""});
  }

  MemoryConfig cfg_;
  Budget budget_;
  LayerWeights<memory_space> weights_;
  ExecSpace exec_;
  state::SequenceCounts<state::SequenceCursor, memory_space> cursors_;  ///< per sequence; the device plans decode from them
  state::SequenceCounts<long, memory_space> active_;                    ///< 1 for a sequence a decode step advances
  kernels::FoldTable<memory_space> folds_;
  Kokkos::View<long[2], memory_space> plan_error_;  ///< kernels::plan_decode's refusal and position + 1
  long horizon_ = 0;                                ///< tokens reserve() prepared decode_async for (0: none)
  state::StateRows<memory_space, Storage> rows_;
  state::WindowRing<memory_space, Storage> ring_;
  kernels::UpdateScratch<memory_space> scratch_;
  kernels::StepPlan<memory_space> plan_;
  RowPolicy row_policy_{};
  Kokkos::View<float***, Kokkos::LayoutRight, memory_space> lse_;  ///< [B, Hq, max(L, C)], row eviction only
  kernels::ReadoutWork<memory_space, Storage> readout_;  ///< the readout's settings, buffers and last form
};

}  // namespace kvmem
