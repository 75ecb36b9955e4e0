#pragma once
/// \file eviction_memory.hpp
/// EvictionMemory<ExecSpace, Scorer, Storage>: a fixed-budget KV cache that keeps sinks, a protected window and the
/// top-k tokens by an eviction scorer, read with one softmax (kvpop-paper Sec. 2; spec EVICTION.md §1-§4, §6).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "eviction_config.hpp"
#include "kernels/plan/decode_plan.hpp"
#include "kernels/eviction/eviction_prompt.hpp"
#include "kernels/eviction/eviction_step.hpp"
#include "kernels/readout/exact_attention.hpp"
#include "kernels/common/zero_tail.hpp"
#include "policy/score/eviction_scorer.hpp"
#include "prompt_calls.hpp"
#include "state/eviction_cache.hpp"
#include "state/sequence_counts.hpp"
#include "state/sequence_reset.hpp"
#include "state/slot_protocol.hpp"
#include "token_checks.hpp"

namespace kvmem {

/// The eviction memory of one layer for a batch of sequences on the Kokkos execution space `ExecSpace`.
///
/// Per (sequence b, kv-head h) it caches at most B = sinks + window + top_k tokens (rows): the first s
/// tokens (sinks), the last w (protected window, the current token included) and at most k of the tokens
/// in between, those with the highest effective score (score::EvictionScorer; spec EVICTION.md §1, §4).
/// At step q token q enters; when token q - w leaves the window it joins the retained set R, and while
/// |R| > k the row with the lowest effective score is evicted (ties: the older token) and its slot freed:
/// the memory really is bounded, B + 1 rows per (b, h) whatever the sequence length. Then every query
/// head of the group reads the cached rows with one softmax (q . k / sqrt(D), no temperature).
/// With EvictionConfig::merge_evicted, eviction merges where it would forget: the evicted row is first
/// folded into the kept row (sinks excepted) of most similar key (cosine), as count-weighted means, and
/// rows are read with the logit bias log(count) (kernels::eviction_merge; docs/eviction.md).
/// Delayed scorers (score::MLstm) score a token when it leaves the window (§2); scorers that need attention
/// probabilities (score::AccumulatedAttention, score::LastQueryAttention, score::ObservationWindow) get them
/// from the readout, the others pay nothing for them.
/// With EvictionConfig::chunk != 1 the memory evicts once per chunk of C positions (C > 1: holds at most
/// B + C rows) or at the end of each prompt (C = 0, SnapKV's and kvpress's setting: prefill() and extend()
/// attend exactly, their last observation_window queries score, the first decode() step evicts; holds at
/// most B + 1 + the prompt, growing its rows at prefill()), scored by the observation window of queries
/// (docs/eviction.md "Compression per chunk and at the end of a prompt"). A chunk of one token is the
/// streaming eviction above, bit for bit. With C = 0 a prompt decoded token by token is not a prompt
/// (each decode step evicts), so prefill and decode then differ by definition.
///
/// Tensors are views in (sequence, head, token, channel) order with unit channel stride and any other
/// strides (LayoutStride), in ExecSpace's memory space, of the storage type `Storage` (kvmem/dtype.hpp:
/// float, the default, kvmem::bfloat16 or kvmem::float16), which is also the type the cache holds its keys
/// and values in (logits, softmax and sums float32, scorer statistics float64; docs/numerics.md):
///   q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] in, y [B, Hq, T, Dv] out (must not alias an input).
/// prefill() and decode() both run the per-token state machine, one token after the other per (b, h) and
/// the heads and sequences in parallel, so a prompt through prefill, through decode, or split between them
/// gives the same bits, and results are the same on any number of threads of a backend.
///
/// \code
/// kvmem::EvictionConfig cfg{.head_dim = 64, .value_dim = 64, .query_heads = 8, .kv_heads = 2,
///                           .sinks = 4, .window = 64, .top_k = 448};
/// kvmem::EvictionMemory<Kokkos::DefaultExecutionSpace, kvmem::score::AccumulatedAttention> memory(cfg, batch);
/// memory.prefill(q, k, v, y);     // the prompt
/// memory.decode(q1, k1, v1, y1);  // then one token at a time
/// \endcode
template <class ExecSpace, score::EvictionScorer Scorer, StorageType Storage = float>
class EvictionMemory : public detail::PromptCalls<EvictionMemory<ExecSpace, Scorer, Storage>> {
  using Calls = detail::PromptCalls<EvictionMemory>;
  friend Calls;

 public:
  using Calls::extend;
  using Calls::prefill;
  using execution_space = ExecSpace;
  using storage_type = Storage;
  using memory_space = typename ExecSpace::memory_space;
  using scorer_type = Scorer;
  /// q, k, v: [B, heads, T, channels], unit channel stride.
  using tokens_in = Kokkos::View<const Storage****, Kokkos::LayoutStride, memory_space>;
  /// y: [B, Hq, T, Dv], unit channel stride.
  using tokens_out = Kokkos::View<Storage****, Kokkos::LayoutStride, memory_space>;
  /// The views one call reads, bundled (kvmem::AttentionMemory): q [B, Hq, T, D], k [B, Hkv, T, D], v [B,
  /// Hkv, T, Dv].
  struct inputs {
    tokens_in q, k, v;

    /// Token t of every input ([B, heads, 1, channels], the same strides, no copy): the inputs of one
    /// decode step out of a prompt's (kvmem::AttentionMemory).
    [[nodiscard]] inputs token(long t) const {
      return {detail::token_slice(q, t), detail::token_slice(k, t), detail::token_slice(v, t)};
    }
  };
  /// The readout's log-sum-exp [B, Hq, T], float32, any strides (kvmem::AttentionMemory): lse[b, h, t] =
  /// log sum_i exp(logit_i) over the rows query (b, h, t) reads (each logit with its log(count) for a merging
  /// eviction), so that y can be merged with another attention over other keys. -inf at t >= lengths[b] in a
  /// prefill.
  using lse_out = Kokkos::View<float***, Kokkos::LayoutStride, memory_space>;
  /// y is one softmax over the cached rows, so the readout has a log-sum-exp (lse_out).
  static constexpr bool softmax_readout = true;

  /// An empty memory for `batch` sequences with the scorer `scorer` (its parameters and weights). Throws
  /// kvmem::invalid_argument for a bad config field (EvictionConfig::validate), `batch` < 1, a chunk other
  /// than 1 with a layer-wide scorer (TOVA's layer mean), or what the scorer's bind() rejects (e.g. a
  /// missing or misshapen mLSTM weight, naming it).
  EvictionMemory(const EvictionConfig& config, int batch, const Scorer& scorer = Scorer{},
                 const ExecSpace& exec = ExecSpace())
      : cfg_(config), scorer_(scorer), exec_(exec) {
    cfg_.validate();
    require(batch >= 1, "batch", batch, "must be >= 1");
    require(cfg_.chunk == 1 || !scorer_.layer_wide(), "chunk", cfg_.chunk,
            "must be 1 with a layer-wide scorer (TOVA's layer mean evicts from every kv-head at every token)");
    scorer_.bind(batch, cfg_);
    tokens_.allocate("kvmem::evict_first", batch, 0L);
    lengths_.allocate("kvmem::evict_lengths", batch, 0L);
    active_.allocate("kvmem::evict_active", batch, 1L);
    prompt_zero_.allocate("kvmem::evict_prompt_zero", batch, 0L);
    observed_.allocate("kvmem::evict_observed", batch, 0L);
    pending_.assign(static_cast<std::size_t>(batch), 0L);
    cache_.allocate(batch, cfg_.kv_heads, cfg_.budget() + std::max(cfg_.chunk, 1), cfg_.head_dim, cfg_.value_dim,
                    Scorer::needs_probabilities, cfg_.merge_evicted, score::pool_width<Scorer> > 1);
    tokens_.upload(exec_);
    lengths_.upload(exec_);
    active_.upload(exec_);
    prompt_zero_.upload(exec_);
  }

  /// Runs T tokens of every sequence through the policy, continuing from the current cache (spec
  /// EVICTION.md §1). Sequence b uses tokens [0, lengths[b]) (all T when `lengths` is empty); y[b, :, t] for
  /// t >= lengths[b] is written as zeros. Throws kvmem::invalid_argument, before anything changes, for
  /// mismatched shapes, a non-contiguous channel axis, a length outside [0, T], at chunk = 0 a sequence
  /// that holds nothing given 0 < lengths[b] < observation_window tokens (the window is longer than its
  /// prompt) or, under set_strict_slots(true), a sequence with lengths[b] > 0 that holds tokens (extend()
  /// continues it).
  void prefill(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_out& y,
               std::span<const long> lengths = {}) {
    run_prompt(inputs{q, k, v}, y, lengths, lse_out{}, state::SlotCall::prefill);
  }

 private:
  void run_prompt(const inputs& in, const tokens_out& y, std::span<const long> lengths, const lse_out& lse,
                  state::SlotCall call) {
    const char* where = call == state::SlotCall::prefill ? "prefill" : "extend";
    const auto& [q, k, v] = in;
    const long T = static_cast<long>(q.extent(2));
    check_inputs(q, k, v, y, T, where);
    detail::check_lse_view(lse, where, batch(), cfg_.query_heads, T);
    detail::check_lengths(lengths, batch(), T);
    bool ragged = false;
    for (long b = 0; b < batch(); ++b) ragged = ragged || (!lengths.empty() && lengths[b] < T);
    sync();
    state::check_slots(call, this->strict_slots_, batch(), lengths, T, [&](long b) { return tokens_.host(b); });
    if (cfg_.chunk == 0)  // the observation window reads the prompt's last queries: a prompt has that many
      for (long b = 0; b < batch(); ++b) {
        const long n = lengths.empty() ? T : lengths[b];
        require(n == 0 || tokens_.host(b) > 0 || n >= cfg_.observation_window, "observation_window",
                cfg_.observation_window, "is longer than the prompt of sequence " + std::to_string(b) + " (" +
                std::to_string(n) + " tokens; at chunk = 0 a prompt needs at least observation_window tokens, 0: all)");
      }
    for (long b = 0; b < batch(); ++b) lengths_.set(b, lengths.empty() ? T : lengths[b]);
    lengths_.upload(exec_);
    if (cfg_.chunk == 0) {  // the prompt is held whole until the first decode step: room for it, once
      long rows = 0;
      for (long b = 0; b < batch(); ++b) rows = std::max(rows, pending_[b] + lengths_.host(b));
      cache_.grow(exec_, cfg_.budget() + 1 + rows);
      for (long b = 0; b < batch(); ++b) pending_[b] += lengths_.host(b);
    }
    // A prompt into sequences that hold nothing, which no step of it evicts (chunk = 0): exact attention.
    bool whole = cfg_.chunk == 0 && !Scorer::delayed;
    for (long b = 0; b < batch(); ++b) whole = whole && (lengths_.host(b) == 0 || tokens_.host(b) == 0);
    if (whole) run_whole_prompt(in, y, lse);
    if (ragged) {
      kernels::zero_tail(exec_, y, lengths_.device());
      if (lse.data() != nullptr)
        kernels::fill_tail(exec_, lse, lengths_.device(), -std::numeric_limits<float>::infinity());
    }
    if (whole) advance(lengths_, /*wait=*/true);
    else run(in, y, lse, lengths_, /*wait=*/true);
  }

  /// The prompt of every sequence with lengths_ > 0, each holding nothing, at chunk = 0 (no step of it
  /// evicts): y (and lse when asked) exact causal attention over the prompt (kernels::exact_causal_attention,
  /// the tiled readout), the tokens appended in order (kernels::eviction_prompt_append), and the statistics of
  /// the last observation_window queries (kernels::prompt_observation): what eviction_tokens gives one token
  /// after the other, in the time of exact attention (tests/unit/test_chunk_eviction.cpp).
  void run_whole_prompt(const inputs& in, const tokens_out& y, const lse_out& lse) {
    const auto p = kernels::EvictionParams::of(cfg_);
    kernels::exact_causal_attention(exec_, in.q, in.k, in.v, y);
    kernels::eviction_prompt_append(exec_, p, cache_, scorer_, in.k, in.v, lengths_.device());
    if (lse.data() != nullptr) kernels::prompt_lse(exec_, p, in.q, in.k, lengths_.device(), prompt_zero_.device(), lse);
    if constexpr (Scorer::needs_probabilities) {
      const long T = static_cast<long>(in.q.extent(2));
      const long W = cfg_.observation_window > 0 && cfg_.observation_window < T ? cfg_.observation_window : T;
      for (long b = 0; b < batch(); ++b) observed_.set(b, std::max(0L, lengths_.host(b) - W));
      observed_.upload(exec_);
      if (static_cast<long>(observed_lse_.extent(2)) < W || observed_lse_.extent(1) != static_cast<std::size_t>(cfg_.query_heads))
        observed_lse_ = decltype(observed_lse_)("kvmem::evict_observed_lse", batch(), cfg_.query_heads, W);
      kernels::prompt_lse(exec_, p, in.q, in.k, lengths_.device(), observed_.device(), observed_lse_);
      kernels::prompt_observation(exec_, p, cache_, scorer_, in.q, lengths_.device(), observed_.device(), observed_lse_);
    }
  }

 public:

  /// decode() below with the inputs bundled (the AttentionMemory contract).
  void decode(const inputs& in, const tokens_out& y, std::span<const unsigned char> active = {}) {
    decode(in, y, active, lse_out{});
  }
  /// decode() that also writes the readout's log-sum-exp lse [B, Hq, 1] (lse_out) of the active sequences
  /// (not written when empty). Throws as decode(), and for an lse of other extents than [B, Hq, 1].
  void decode(const inputs& in, const tokens_out& y, std::span<const unsigned char> active, const lse_out& lse) {
    const auto& [q, k, v] = in;
    check_decode(q, k, v, y);
    detail::check_lse_view(lse, "decode", batch(), cfg_.query_heads, 1);
    sync();
    state::check_slots(state::SlotCall::decode, this->strict_slots_, batch(), active, [&](long b) { return tokens_.host(b); });
    set_active(active);
    run(in, y, lse, active_, /*wait=*/true, /*decode=*/true);
  }
  /// decode_async() below with the inputs bundled (the AttentionMemory contract).
  void decode_async(const inputs& in, const tokens_out& y) { decode_async(in, y, lse_out{}); }
  /// decode_async() that also writes the readout's log-sum-exp lse [B, Hq, 1] (lse_out) of the active
  /// sequences (not written when empty; its address, too, must stay fixed between replays). Throws as
  /// decode_async(), and for an lse of other extents than [B, Hq, 1].
  void decode_async(const inputs& in, const tokens_out& y, const lse_out& lse) {
    const auto& [q, k, v] = in;
    check_decode(q, k, v, y);
    detail::check_lse_view(lse, "decode", batch(), cfg_.query_heads, 1);
    if (tokens_.shared()) {  // a host backend: the host advances the counts the kernel reads
      run(in, y, lse, active_, /*wait=*/false, /*decode=*/true);
    } else {  // launches only (perhaps captured): pending_ keeps its rows until a fenced decode() clears it
      kernels::eviction_tokens(exec_, kernels::EvictionParams::of(cfg_), cache_, scorer_, q, k, v, y, tokens_.device(),
                               active_.device(), 0, lse, /*decode=*/true);
      kernels::advance_counts(exec_, tokens_.device(), active_.device());
      tokens_.device_advanced();
    }
  }

  /// Runs one token of every sequence b with active[b] != 0 (all when `active` is empty): q [B, Hq, 1, D],
  /// k [B, Hkv, 1, D], v [B, Hkv, 1, Dv], y [B, Hq, 1, Dv]. Inactive sequences keep their cache and their
  /// rows of y are left untouched. Returns when y is written (one fence). The kernel reads each sequence's
  /// position from counts on the device, which the step advances there: no copy, except `active` when it
  /// changes (set_active()). Throws kvmem::invalid_argument, before anything changes, for mismatched shapes,
  /// a token count other than 1, an `active` of another size than the batch or, under
  /// set_strict_slots(true), an active sequence that holds no token.
  void decode(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_out& y,
              std::span<const unsigned char> active = {}) {
    decode(inputs{q, k, v}, y, active, lse_out{});
  }

  /// decode() as launches only, for capture in a CUDA graph and replay: no host allocation, copy, fence or
  /// read of device data; y is written when the execution space is fenced. The sequences set_active() chose
  /// each take one token, at the position the device counts (the host's counts stay behind until sync() on
  /// a GPU). What must stay fixed between replays: the batch, the active set and the views' addresses. On a
  /// host memory space this is decode() without the fence. Throws kvmem::invalid_argument, before anything
  /// is launched, for mismatched shapes or a token count other than 1.
  void decode_async(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_out& y) {
    decode_async(inputs{q, k, v}, y, lse_out{});
  }

  /// Counts decode steps as a GPU does, on any execution space: from now on the device's token counts are
  /// kept apart from the host's, and decode_async() advances them with a kernel of its own and leaves the
  /// host's behind until sync(). On a GPU that is how it always runs; on a host backend it costs a copy of
  /// the counts and one more launch per decode_async(), and exists so that CPU machines run and test the
  /// GPU's path (tests/unit/test_decode_async.cpp). Keeps every count and the state; idempotent.
  void plan_on_device() {
    sync();
    state::keep_apart(exec_, tokens_, lengths_, active_);
  }

  /// With chunk = 0: grows the rows now to hold a prompt of `tokens` tokens per sequence (budget + 1 +
  /// tokens per (sequence, kv-head)), so that no prefill() of at most that many tokens moves the cache
  /// later, e.g. under a CUDA graph of decode steps captured in between (a prefill that needs more rows
  /// grows them, and a graph captured before must be captured again). Nothing for another chunk (their rows
  /// are fixed at construction) or when the rows suffice. Throws kvmem::invalid_argument for tokens < 0.
  void reserve_prompt(long tokens) {
    require(tokens >= 0, "tokens", tokens, "must be >= 0");
    if (cfg_.chunk == 0) cache_.grow(exec_, cfg_.budget() + 1 + tokens);
  }

  /// Chooses the sequences the next decode steps advance: active[b] != 0 (all when `active` is empty). One
  /// copy to the device when the set changes, none otherwise. Throws kvmem::invalid_argument for a size
  /// other than the batch.
  void set_active(std::span<const unsigned char> active) { state::set_active(active_, active, exec_); }

  /// Brings the host's token counts (tokens()) up to the device's after decode_async steps on a GPU and
  /// their replays: one fence and one copy; nothing on a host memory space (unless plan_on_device())
  /// or before the first decode_async. The host cannot see a graph's replays, so from then until reset() every call reads back
  /// (decode() and prefill() call it).
  void sync() {
    static const std::string label = "kvmem::EvictionMemory::sync";
    tokens_.sync(exec_, label);
  }

  /// Empties the cache of every sequence and resets the scorer's state; keeps the allocations.
  void reset() {
    Kokkos::deep_copy(exec_, cache_.positions, -1L);
    Kokkos::deep_copy(exec_, cache_.live, 0L);
    exec_.fence();
    scorer_.reset();
    Kokkos::fence();
    std::fill(pending_.begin(), pending_.end(), 0L);
    tokens_.forget_replays();
    for (long b = 0; b < batch(); ++b) tokens_.host(b) = 0;
    tokens_.mark_changed();  // the device's counts may have moved without the host
    tokens_.upload(exec_);
  }

  /// Empties the cache of sequence b and resets its scorer state (a finished request frees its slot), so
  /// that its next tokens run as in a new memory, bit for bit; every other sequence keeps its cache and
  /// scorer state bit for bit. The active set stays. Throws kvmem::invalid_argument, before anything
  /// changes, for b outside [0, B), or for a sequence in decode_async's active set once the device counts
  /// steps on its own (a GPU after decode_async, or plan_on_device()): a captured graph would go on
  /// advancing it.
  void reset_sequence(long b) {
    state::check_reset_sequence(b, tokens_, active_);
    sync();
    state::fill_sequence(exec_, cache_.positions, b, -1L);
    state::fill_sequence(exec_, cache_.live, b, 0L);
    exec_.fence();
    scorer_.reset_sequence(b);
    Kokkos::fence();
    pending_[b] = 0;
    tokens_.host(b) = 0;
    tokens_.mark_changed();
    tokens_.upload(exec_);
  }

  /// Writes the cached tokens after the last step: positions [B, Hkv, K] (increasing, -1 past the row
  /// count; K >= 0, positions beyond K are not written) and rows [B, Hkv] (cached rows, <= budget and <=
  /// tokens seen). Views of this memory space, any layout. Throws kvmem::invalid_argument for other
  /// leading extents.
  template <class Positions, class Rows>
  void kept(const Positions& positions, const Rows& rows) const {
    require(static_cast<long>(positions.extent(0)) == batch() && static_cast<long>(positions.extent(1)) == cfg_.kv_heads,
            "positions extents", std::to_string(positions.extent(0)) + " x " + std::to_string(positions.extent(1)),
            "must be [B = " + std::to_string(batch()) + ", Hkv = " + std::to_string(cfg_.kv_heads) + ", K]");
    require(static_cast<long>(rows.extent(0)) == batch() && static_cast<long>(rows.extent(1)) == cfg_.kv_heads,
            "rows extents", std::to_string(rows.extent(0)) + " x " + std::to_string(rows.extent(1)),
            "must be [B = " + std::to_string(batch()) + ", Hkv = " + std::to_string(cfg_.kv_heads) + "]");
    kernels::eviction_kept(exec_, cache_, positions, rows);
    exec_.fence();
  }

  [[nodiscard]] const EvictionConfig& config() const { return cfg_; }
  [[nodiscard]] const Scorer& scorer() const { return scorer_; }
  [[nodiscard]] long batch() const { return tokens_.size(); }
  /// Tokens sequence b has seen since construction or reset(). Throws kvmem::invalid_argument for b outside
  /// [0, B) or when decode_async steps ran on a GPU since the last sync().
  [[nodiscard]] long tokens(long b) const {
    detail::check_sequence(b, batch(), tokens_.ahead(), "tokens(b)");
    return tokens_.host(b);
  }
  /// The device cache (slots, positions, statistics, order), for inspection.
  [[nodiscard]] const state::EvictionCache<memory_space, Storage>& cache() const { return cache_; }
  /// Bytes of keys and values the batch holds at most: B * Hkv * R * (D + Dv) * sizeof(Storage), plus
  /// B * Hkv * R * 4 for the float32 counts of a merging eviction (merge_evicted), with R the rows of a
  /// (sequence, kv-head): budget + 1 when streaming (the + 1 is the row a step holds between its append and
  /// its eviction), whatever the token count; budget + chunk with chunk > 1; with chunk = 0 budget + 1 + the
  /// longest prompt held so far (the rows grow at prefill()).
  [[nodiscard]] long held_bytes() const {
    const long rows = batch() * cfg_.kv_heads * cache_.slots();
    return rows * (cfg_.head_dim + cfg_.value_dim) * static_cast<long>(sizeof(Storage)) +
           (cfg_.merge_evicted ? rows * static_cast<long>(sizeof(float)) : 0L);
  }
  /// Bytes this object has allocated on the device for its cache and scratch (the scorer's own state,
  /// e.g. the mLSTM's, is not counted). Fixed at construction, but with chunk = 0, where prefill() grows
  /// the rows to hold the prompt.
  [[nodiscard]] long allocated_bytes() const {
    const auto& c = cache_;
    return static_cast<long>((c.keys.span() + c.values.span()) * sizeof(Storage) + (c.logits.span() + c.probabilities.span() + c.counts.span() + observed_lse_.span()) * sizeof(float) +
                             (c.stats.span() + c.pooled.span()) * sizeof(double) +
                             (c.positions.span() + c.live.span() + 5 * tokens_.device().span()) * sizeof(long) +
                             (c.order.span() + c.shift.span()) * sizeof(int));
  }

 private:
  /// Runs `lengths`(b) tokens of every sequence from the positions tokens_ holds, and advances those on both
  /// sides (on a host memory space one view): no copy. Fences when `wait`.
  void run(const inputs& in, const tokens_out& y, const lse_out& lse,
           const state::SequenceCounts<long, memory_space>& lengths, bool wait, bool decode = false) {
    if (decode) forget_pending(lengths);
    kernels::eviction_tokens(exec_, kernels::EvictionParams::of(cfg_), cache_, scorer_, in.q, in.k, in.v, y,
                             tokens_.device(), lengths.device(), 0, lse, decode);
    advance(lengths, wait);
  }
  /// Advances the token counts by `lengths`(b) on both sides (on a host memory space one view): no copy.
  /// Fences when `wait`.
  void advance(const state::SequenceCounts<long, memory_space>& lengths, bool wait) {
    if (!tokens_.shared()) kernels::advance_counts(exec_, tokens_.device(), lengths.device());
    for (long b = 0; b < batch(); ++b) tokens_.host(b) += lengths.host(b);
    if (wait) {
      static const std::string fence_label = "kvmem::EvictionMemory::step";  // not a heap string per call
      exec_.fence(fence_label);
    }
  }
  /// A decode step of the sequences with active(b) != 0 evicts down to the budget: their prompts are no
  /// longer pending (chunk = 0's room for rows, run_prompt).
  void forget_pending(const state::SequenceCounts<long, memory_space>& active) {
    for (long b = 0; b < batch(); ++b)
      if (active.host(b) != 0) pending_[b] = 0;
  }
  void check_decode(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_out& y) const {
    detail::check_one_token(q);
    check_inputs(q, k, v, y, 1, "decode");
  }

  void check_inputs(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_out& y, long T,
                    const char* where) const {
    // Messages are built only on failure: decode runs this every token and must not allocate.
    detail::check_attention_views(q, k, v, y, where, batch(), cfg_.query_heads, cfg_.kv_heads, T, cfg_.head_dim,
                                  cfg_.value_dim);
  }

  EvictionConfig cfg_;
  Scorer scorer_;
  ExecSpace exec_;
  state::SequenceCounts<long, memory_space> tokens_;   ///< tokens seen per sequence: the next step's first position
  state::SequenceCounts<long, memory_space> lengths_;  ///< a prefill's tokens per sequence
  state::SequenceCounts<long, memory_space> active_;   ///< a decode step's tokens per sequence: 1 or 0
  std::vector<long> pending_;  ///< chunk = 0: prompt tokens per sequence since its last decode step (rows to hold)
  state::SequenceCounts<long, memory_space> prompt_zero_;  ///< zeros: run_whole_prompt's lse from the first query
  state::SequenceCounts<long, memory_space> observed_;     ///< run_whole_prompt: the first observing query
  Kokkos::View<float***, Kokkos::LayoutRight, memory_space> observed_lse_;  ///< [B, Hq, W_obs] their lse
  state::EvictionCache<memory_space, Storage> cache_;
};

}  // namespace kvmem
