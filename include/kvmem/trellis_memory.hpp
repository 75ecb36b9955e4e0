#pragma once
/// \file trellis_memory.hpp
/// TrellisMemory<ExecSpace, Storage>: a fixed-slot attention memory trained at test time by online gradient descent
/// (Trellis; trellis-paper Sec. 3, eqs. 4-14; spec TRELLIS.md).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtype.hpp"
#include "errors.hpp"
#include "kernels/plan/decode_plan.hpp"
#include "kernels/trellis/trellis.hpp"
#include "policy/merge/gradient_descent.hpp"
#include "state/sequence_counts.hpp"
#include "state/sequence_reset.hpp"
#include "state/slot_protocol.hpp"
#include "token_checks.hpp"
#include "trellis_config.hpp"

namespace kvmem {

/// The Trellis memory of one layer for a batch of sequences, running on the Kokkos execution space
/// `ExecSpace` with merge::GradientDescent (spec TRELLIS.md §1-§4).
///
/// Per (sequence b, head h) the memory holds two fast-weight matrices, M1 [m, D] (keys, pass 1) and
/// M2 [m, Dv] (values, pass 2), float32, zero after construction and reset() (§1 [R]). For every token t,
/// both memories take one gradient step on ||phi(M kin_t) - alpha_t||^2 with forget gate beta and step gamma
/// (trellis-paper eq. 8; spec §3.1):
///   M1_t = beta1_t M1_{t-1} - gamma1_t u1_t k_t^T,  u1_t = 2 J_phi(M1_{t-1} k_t)^T (phi(M1_{t-1} k_t) - alpha_t)
///   M2_t = beta2_t M2_{t-1} - gamma2_t u2_t v_t^T,  u2_t = 2 J_phi(M2_{t-1} v_t)^T (phi(M2_{t-1} v_t) - alpha_t)
/// (the factor 2 is TrellisConfig::grad_scale, §7 A2) and the layer output is read after the update through
/// both passes (eqs. 13-14; spec §2.4, §4):
///   yhat_t = M1_t q_t [m],  p_t = f(yhat_t) [m],  y_t = phi(M2_t^T p_t) [Dv]  (phi if readout2_phi).
/// prefill() runs the stale-gradient chunkwise form (§3.2/3.3: the gradients of a chunk of C tokens are
/// taken at the state before the chunk); decode() runs the exact recurrence one token at a time. With
/// chunk = 1 the two are the same computation and give the same bits; a prefill continues from the state
/// left by earlier calls, so a prompt split into prefills whose lengths (except the last) are multiples of
/// C gives the same bits as one prefill, and decode continues either.
///
/// Tensors are views in (sequence, head, token, channel) order with unit channel stride and any other
/// strides (LayoutStride), in ExecSpace's memory space, of the storage type `Storage` (kvmem/dtype.hpp:
/// float, the default, kvmem::bfloat16 or kvmem::float16; every sum and the state M1, M2 stay float32,
/// docs/numerics.md):
///   q, k [B, H, T, D], v [B, H, T, Dv], alpha [B, H, T, m] (latent target, eq. 4),
///   beta1, gamma1, beta2, gamma2 [B, H, T] (forget gates in [0, 1] and step sizes >= 0 of passes 1, 2),
///   y [B, H, T, Dv] (written; must not alias an input).
/// Results are deterministic: no atomics, every sum in a fixed order, the same bits on every run and on
/// any number of threads of a backend.
///
/// \code
/// kvmem::TrellisConfig cfg{.slots = 64, .head_dim = 64, .value_dim = 64, .heads = 12, .chunk = 16};
/// kvmem::TrellisMemory<Kokkos::DefaultExecutionSpace> memory(cfg, batch);
/// memory.prefill(q, k, v, alpha, beta1, gamma1, beta2, gamma2, y);      // the prompt, chunkwise
/// memory.decode(q1, k1, v1, alpha1, beta1_1, gamma1_1, beta2_1, gamma2_1, y1);  // then one token at a time
/// \endcode
template <class ExecSpace, StorageType Storage = float>
class TrellisMemory {
 public:
  using execution_space = ExecSpace;
  using storage_type = Storage;
  using memory_space = typename ExecSpace::memory_space;
  using merge_policy = merge::GradientDescent;
  /// q, k, v, alpha: [B, H, T, channels], unit channel stride.
  using tokens_in = Kokkos::View<const Storage****, Kokkos::LayoutStride, memory_space>;
  /// beta1, gamma1, beta2, gamma2: [B, H, T].
  using gates_in = Kokkos::View<const Storage***, Kokkos::LayoutStride, memory_space>;
  /// y: [B, H, T, Dv], unit channel stride.
  using tokens_out = Kokkos::View<Storage****, Kokkos::LayoutStride, memory_space>;
  /// The views one call reads, bundled (kvmem::AttentionMemory): q, k [B, H, T, D], v [B, H, T, Dv], alpha
  /// [B, H, T, m] and the gates beta1, gamma1, beta2, gamma2 [B, H, T].
  using inputs = kernels::TrellisInputs<tokens_in, gates_in>;
  /// y is read from the slots through phi (trellis-paper Sec. 3, two readouts), not as one softmax over keys
  /// and values: there is no log-sum-exp to merge it with another attention (kvmem::AttentionMemory).
  static constexpr bool softmax_readout = false;
  /// M1 [B, H, m, D] and M2 [B, H, m, Dv], slot-major, float32 whatever the storage type: the slots are
  /// trained by gradient steps, each smaller than a 16-bit type resolves (docs/numerics.md).
  using state_view = Kokkos::View<float****, Kokkos::LayoutRight, memory_space>;

  /// A zero memory for `batch` sequences without an LN affine. Throws kvmem::invalid_argument for a bad
  /// config field (TrellisConfig::validate) or `batch` < 1.
  TrellisMemory(const TrellisConfig& config, int batch, const ExecSpace& exec = ExecSpace())
      : TrellisMemory(config, TrellisWeights<memory_space>{}, batch, exec) {}

  /// A zero memory for `batch` sequences with the optional LN-SiLU affine `weights` (ln_weight, ln_bias [m]).
  /// Throws kvmem::invalid_argument for a bad config field, bad weights or `batch` < 1.
  TrellisMemory(const TrellisConfig& config, const TrellisWeights<memory_space>& weights, int batch,
                const ExecSpace& exec = ExecSpace())
      : cfg_(config), weights_(weights), exec_(exec) {
    cfg_.validate();
    weights_.validate(cfg_);
    require(batch >= 1, "batch", batch, "must be >= 1");
    tokens_.allocate("kvmem::trellis_tokens", batch, 0L);
    lengths_.allocate("kvmem::trellis_lengths", batch, 0L);
    active_.allocate("kvmem::trellis_active", batch, 1L);
    tokens_.upload(exec_);
    lengths_.upload(exec_);
    active_.upload(exec_);
    state_.m1 = state_view("kvmem::trellis_m1", batch, cfg_.heads, cfg_.slots, cfg_.head_dim);
    state_.m2 = state_view("kvmem::trellis_m2", batch, cfg_.heads, cfg_.slots, cfg_.value_dim);
    first_bad_gate_ = Kokkos::View<long, memory_space>("kvmem::trellis_first_bad_gate");
    scratch_.reserve(batch, cfg_.heads, 1, cfg_.slots, output_scratch());  // a decode step's: decode never allocates
  }

  /// Runs T tokens of every sequence through the memory with the chunkwise stale-gradient form
  /// (spec TRELLIS.md §3.2/3.3, chunk C = config().chunk; trellis-paper eqs. 9-14 as corrected in §7 A3, A5),
  /// continuing from the current state. Chunks start at token 0 of this call; the last may be short.
  /// Sequence b uses tokens [0, lengths[b]) (all T when `lengths` is empty); y[b, :, t] for t >= lengths[b]
  /// is written as zeros. T = 0 does nothing. Throws kvmem::invalid_argument, before the state or y
  /// changes, for mismatched shapes, a non-contiguous channel axis, a length outside [0, T], or (with
  /// check_gates) a beta outside [0, 1] or a negative or non-finite gamma among the tokens used; the message
  /// names the view or the gate element, e.g. "gamma1[0, 3, 17] = -0.5: ...", or, under
  /// set_strict_slots(true), a sequence with lengths[b] > 0 that holds tokens (extend() continues it).
  void prefill(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_in& alpha,
               const gates_in& beta1, const gates_in& gamma1, const gates_in& beta2, const gates_in& gamma2,
               const tokens_out& y, std::span<const long> lengths = {}) {
    run_prompt({q, k, v, alpha, beta1, gamma1, beta2, gamma2}, y, lengths, state::SlotCall::prefill);
  }

  /// prefill() that only continues prompts (chunked prefill; chunks start at this call's first token):
  /// sequence b takes lengths[b] tokens after the ones it holds. Throws as prefill(), and
  /// kvmem::invalid_argument naming the sequence when one with lengths[b] > 0 holds no token
  /// (state::SlotCall::extend), before anything changes.
  void extend(const inputs& in, const tokens_out& y, std::span<const long> lengths = {}) {
    run_prompt(in, y, lengths, state::SlotCall::extend);
  }
  /// The strict slot protocol (off by default; state/slot_protocol.hpp): prefill() then refuses a sequence
  /// that holds tokens (a request in a busy slot) and decode() one that holds none (a step of a request
  /// that never started), naming the sequence, before anything changes; extend() continues prompts.
  /// decode_async() does not check (the host's counts may be behind a GPU's).
  void set_strict_slots(bool on) { strict_slots_ = on; }
  [[nodiscard]] bool strict_slots() const { return strict_slots_; }

 private:
  void run_prompt(const inputs& in, const tokens_out& y, std::span<const long> lengths, state::SlotCall call) {
    const auto& [q, k, v, alpha, beta1, gamma1, beta2, gamma2] = in;
    const long T = static_cast<long>(q.extent(2));
    check_inputs(q, k, v, alpha, beta1, gamma1, beta2, gamma2, y, T, call == state::SlotCall::prefill ? "prefill" : "extend");
    detail::check_lengths(lengths, batch(), T);
    bool ragged = false;
    for (long b = 0; b < batch(); ++b) ragged = ragged || (!lengths.empty() && lengths[b] < T);
    sync();
    state::check_slots(call, strict_slots_, batch(), lengths, T, [&](long b) { return tokens_.host(b); });
    long longest = 0;
    for (long b = 0; b < batch(); ++b) {
      lengths_.set(b, lengths.empty() ? T : lengths[b]);
      longest = std::max(longest, lengths_.host(b));
    }
    lengths_.upload(exec_);
    if (cfg_.check_gates) check_gates(in, T, lengths_);
    if (ragged) kernels::zero_tail(exec_, y, lengths_.device());
    const long C = cfg_.chunk;
    scratch_.reserve(batch(), cfg_.heads, std::max(1L, std::min(C, longest)), cfg_.slots, output_scratch());
    const auto prm = kernels::TrellisParams::of(cfg_, C);
    kernels::trellis_chunks(exec_, prm, state_, scratch_, in, weights_.ln_weight, weights_.ln_bias, y, lengths_.device(),
                            longest);
    advance(lengths_);
    fence_step();
  }

 public:
  /// prefill() above with the inputs bundled (the AttentionMemory contract).
  void prefill(const inputs& in, const tokens_out& y, std::span<const long> lengths = {}) {
    prefill(in.q, in.k, in.v, in.alpha, in.beta1, in.gamma1, in.beta2, in.gamma2, y, lengths);
  }
  /// decode() below with the inputs bundled (the AttentionMemory contract).
  void decode(const inputs& in, const tokens_out& y, std::span<const unsigned char> active = {}) {
    decode(in.q, in.k, in.v, in.alpha, in.beta1, in.gamma1, in.beta2, in.gamma2, y, active);
  }
  /// decode_async() below with the inputs bundled (the AttentionMemory contract).
  void decode_async(const inputs& in, const tokens_out& y) {
    decode_async(in.q, in.k, in.v, in.alpha, in.beta1, in.gamma1, in.beta2, in.gamma2, y);
  }

  /// Runs one token of every sequence b with active[b] != 0 (all when `active` is empty) through the exact
  /// recurrence (spec TRELLIS.md §3.1, trellis-paper eq. 8; both passes, §4), continuing from the current
  /// state: q, k [B, H, 1, D], v [B, H, 1, Dv], alpha [B, H, 1, m], gates [B, H, 1], y [B, H, 1, Dv].
  /// Inactive sequences keep their state and their rows of y are left untouched. Throws
  /// kvmem::invalid_argument, before the state or y changes, for mismatched shapes, a token count other
  /// than 1, an `active` of another size than the batch, (with check_gates) an out-of-range gate of an
  /// active sequence, or, under set_strict_slots(true), an active sequence that holds no token. Returns when y is written (one fence); copies `active` only when it changes
  /// (set_active()), nothing else.
  void decode(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_in& alpha,
              const gates_in& beta1, const gates_in& gamma1, const gates_in& beta2, const gates_in& gamma2,
              const tokens_out& y, std::span<const unsigned char> active = {}) {
    detail::check_one_token(q);
    check_inputs(q, k, v, alpha, beta1, gamma1, beta2, gamma2, y, 1, "decode");
    sync();
    state::check_slots(state::SlotCall::decode, strict_slots_, batch(), active, [&](long b) { return tokens_.host(b); });
    set_active(active);
    const inputs_t in{q, k, v, alpha, beta1, gamma1, beta2, gamma2};
    if (cfg_.check_gates) check_gates(in, 1, active_);
    run_decode(in, y);
    advance(active_);
    fence_step();
  }

  /// decode() as launches only, for capture in a CUDA graph and replay: no host allocation, copy, fence or
  /// read of device data; y is written when the execution space is fenced. The sequences set_active() chose
  /// each take one token; on a GPU the host's token counts stay behind until sync(). What must stay fixed
  /// between replays: the batch, the active set and the views' addresses. On a host memory space this is
  /// decode() without the fence. Throws kvmem::invalid_argument, before anything is launched, for
  /// mismatched shapes, a token count other than 1, or check_gates = true (the check reads its result from
  /// the device: use decode()).
  void decode_async(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_in& alpha,
                    const gates_in& beta1, const gates_in& gamma1, const gates_in& beta2, const gates_in& gamma2,
                    const tokens_out& y) {
    detail::check_one_token(q);
    check_inputs(q, k, v, alpha, beta1, gamma1, beta2, gamma2, y, 1, "decode");
    require(!cfg_.check_gates, "check_gates", "true",
            "decode_async launches only, and the gate check reads its result from the device: use decode()");
    run_decode({q, k, v, alpha, beta1, gamma1, beta2, gamma2}, y);
    if (tokens_.shared())  // a host backend: the host advances the counts the kernel reads
      advance(active_);
    else {
      kernels::advance_counts(exec_, tokens_.device(), active_.device());
      tokens_.device_advanced();
    }
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

  /// Chooses the sequences the next decode steps advance: active[b] != 0 (all when `active` is empty). One
  /// copy to the device when the set changes, none otherwise. Throws kvmem::invalid_argument for a size
  /// other than the batch.
  void set_active(std::span<const unsigned char> active) { state::set_active(active_, active, exec_); }

  /// Brings the host's token counts (tokens()) up to the device's after decode_async steps on a GPU and
  /// their replays: one fence and one copy; nothing on a host memory space (unless plan_on_device())
  /// or before the first decode_async. The host cannot see a graph's replays, so from then until reset() every call reads back
  /// (decode() and prefill() call it).
  void sync() {
    static const std::string label = "kvmem::TrellisMemory::sync";
    tokens_.sync(exec_, label);
  }

  /// Sets both memories of every sequence to zero (the initial state, spec TRELLIS.md §1) and the token
  /// counts to 0; keeps the allocations.
  void reset() {
    Kokkos::deep_copy(exec_, state_.m1, 0.0f);
    Kokkos::deep_copy(exec_, state_.m2, 0.0f);
    exec_.fence();
    tokens_.forget_replays();
    for (long b = 0; b < batch(); ++b) tokens_.host(b) = 0;
    tokens_.mark_changed();  // the device's counts may have moved without the host
    tokens_.upload(exec_);
  }

  /// Sets both memories of sequence b to zero and its token count to 0 (a finished request frees its
  /// slot), so that its next tokens run as in a new memory, bit for bit; every other sequence keeps its
  /// state bit for bit. The active set stays. Throws kvmem::invalid_argument, before anything changes, for
  /// b outside [0, B), or for a sequence in decode_async's active set once the device counts steps on its
  /// own (a GPU after decode_async, or plan_on_device()): a captured graph would go on advancing it.
  void reset_sequence(long b) {
    state::check_reset_sequence(b, tokens_, active_);
    sync();
    state::fill_sequence(exec_, state_.m1, b, 0.0f);
    state::fill_sequence(exec_, state_.m2, b, 0.0f);
    exec_.fence();
    tokens_.host(b) = 0;
    tokens_.mark_changed();
    tokens_.upload(exec_);
  }

  /// Loads a caller-supplied state (spec TRELLIS.md §1: "allow a caller-supplied state"): m1 [B, H, m, D],
  /// m2 [B, H, m, Dv], any layout of this memory space. Token counts are kept. Throws
  /// kvmem::invalid_argument for other extents.
  template <class M1, class M2>
  void set_state(const M1& m1, const M2& m2) {
    static_assert(M1::rank() == 4 && M2::rank() == 4, "set_state takes rank-4 views [B, H, m, D] and [B, H, m, Dv]");
    check_state_extents(m1, "m1", cfg_.head_dim);
    check_state_extents(m2, "m2", cfg_.value_dim);
    Kokkos::deep_copy(exec_, state_.m1, m1);
    Kokkos::deep_copy(exec_, state_.m2, m2);
    exec_.fence();
  }

  [[nodiscard]] const TrellisConfig& config() const { return cfg_; }
  [[nodiscard]] const TrellisWeights<memory_space>& weights() const { return weights_; }
  [[nodiscard]] long batch() const { return tokens_.size(); }
  /// Tokens sequence b has seen since construction or reset().
  /// Throws kvmem::invalid_argument for b outside [0, B) or when decode_async steps ran on a GPU since the
  /// last sync().
  [[nodiscard]] long tokens(long b) const {
    detail::check_sequence(b, batch(), tokens_.ahead(), "tokens(b)");
    return tokens_.host(b);
  }
  /// Key memory M1 [B, H, m, D] (pass 1), the state after the last token.
  [[nodiscard]] const state_view& m1() const { return state_.m1; }
  /// Value memory M2 [B, H, m, Dv] (pass 2), the state after the last token.
  [[nodiscard]] const state_view& m2() const { return state_.m2; }
  /// Bytes of state the batch holds, float32: B * H * m * (D + Dv) * 4, whatever the token count.
  [[nodiscard]] long held_bytes() const {
    return batch() * cfg_.heads * static_cast<long>(cfg_.slots) * (cfg_.head_dim + cfg_.value_dim) *
           static_cast<long>(sizeof(float));
  }
  /// Bytes this object has allocated on the device (state, per-chunk scratch, lengths, the gate check's result).
  [[nodiscard]] long allocated_bytes() const {
    return static_cast<long>(state_.m1.span() + state_.m2.span() + scratch_.u1.span() + scratch_.u2.span() +
                             scratch_.g1.span() + scratch_.g2.span() + scratch_.p.span() + scratch_.y.span()) *
               static_cast<long>(sizeof(float)) +
           static_cast<long>((3 * tokens_.device().span() + first_bad_gate_.span()) * sizeof(long));
  }

 private:
  using inputs_t = inputs;

  /// Channels of the float32 readout scratch: Dv for a 16-bit storage type, none for float.
  [[nodiscard]] long output_scratch() const { return std::is_same_v<Storage, float> ? 0 : cfg_.value_dim; }
  void fence_step() const {
    static const std::string label = "kvmem::TrellisMemory::step";  // not Kokkos' default name, a heap string per call
    exec_.fence(label);
  }

  /// One decode step of the sequences active_ holds (no fence, no copy).
  void run_decode(const inputs_t& in, const tokens_out& y) {
    kernels::trellis_chunks(exec_, kernels::TrellisParams::of(cfg_, 1), state_, scratch_, in, weights_.ln_weight,
                            weights_.ln_bias, y, active_.device(), 1);
  }
  /// Adds a step's token counts to the host's and the device's token counts (on a host memory space one
  /// view; elsewhere a kernel): no copy.
  void advance(const state::SequenceCounts<long, memory_space>& lengths) {
    if (!tokens_.shared()) kernels::advance_counts(exec_, tokens_.device(), lengths.device());
    for (long b = 0; b < batch(); ++b) tokens_.host(b) += lengths.host(b);
  }

  void check_gates(const inputs_t& in, long T, const state::SequenceCounts<long, memory_space>& lengths) const {
    const long H = cfg_.heads;
    const long bad = kernels::trellis_first_bad_gate(exec_, in, lengths.device(), H, T, first_bad_gate_);
    if (bad < 0) return;
    const long B = batch(), t = bad % T, h = (bad / T) % H, b = (bad / (T * H)) % B, g = bad / (T * H * B);
    static const char* names[] = {"beta1", "gamma1", "beta2", "gamma2"};
    const gates_in& view = g == 0 ? in.beta1 : g == 1 ? in.gamma1 : g == 2 ? in.beta2 : in.gamma2;
    Storage stored{};
    Kokkos::deep_copy(stored, Kokkos::subview(view, b, h, t));
    const float value = to_float(stored);
    const std::string where = std::string(names[g]) + "[" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                              std::to_string(t) + "]";
    if (g % 2 == 0)
      throw invalid_argument(detail::describe(where, value, "a forget gate must be in [0, 1] (spec TRELLIS.md §1)"));
    throw invalid_argument(detail::describe(where, value, "a step size must be finite and >= 0 (spec TRELLIS.md §1)"));
  }

  template <class V>
  void check_state_extents(const V& x, const char* name, long channels) const {
    const std::string n(name);
    require(static_cast<long>(x.extent(0)) == batch(), n + ".extent(0)", x.extent(0),
            "must equal the batch size " + std::to_string(batch()));
    require(static_cast<long>(x.extent(1)) == cfg_.heads, n + ".extent(1)", x.extent(1),
            "must equal the head count " + std::to_string(cfg_.heads));
    require(static_cast<long>(x.extent(2)) == cfg_.slots, n + ".extent(2)", x.extent(2),
            "must equal the slot count m = " + std::to_string(cfg_.slots));
    require(static_cast<long>(x.extent(3)) == channels, n + ".extent(3)", x.extent(3),
            "must equal " + std::to_string(channels) + " channels");
  }

  void check_inputs(const tokens_in& q, const tokens_in& k, const tokens_in& v, const tokens_in& alpha,
                    const gates_in& beta1, const gates_in& gamma1, const gates_in& beta2, const gates_in& gamma2,
                    const tokens_out& y, long T, const char* where) const {
    // Messages are built only on failure: decode runs this every token and must not allocate.
    const detail::ExpectedExtent h{cfg_.heads, "the head count H"}, none{0, ""};
    const detail::ExpectedExtent d{cfg_.head_dim, "head_dim D"}, dv{cfg_.value_dim, "value_dim Dv"};
    detail::check_token_view(q, "q", where, batch(), h, T, d);
    detail::check_token_view(k, "k", where, batch(), h, T, d);
    detail::check_token_view(v, "v", where, batch(), h, T, dv);
    detail::check_token_view(alpha, "alpha", where, batch(), h, T, {cfg_.slots, "the slot count m"});
    detail::check_token_view(beta1, "beta1", where, batch(), h, T, none);
    detail::check_token_view(gamma1, "gamma1", where, batch(), h, T, none);
    detail::check_token_view(beta2, "beta2", where, batch(), h, T, none);
    detail::check_token_view(gamma2, "gamma2", where, batch(), h, T, none);
    detail::check_token_view(y, "y", where, batch(), h, T, dv);
  }

  TrellisConfig cfg_;
  TrellisWeights<memory_space> weights_;
  ExecSpace exec_;
  state::SequenceCounts<long, memory_space> tokens_;   ///< tokens seen per sequence
  state::SequenceCounts<long, memory_space> lengths_;  ///< a prefill's tokens per sequence
  state::SequenceCounts<long, memory_space> active_;   ///< a decode step's tokens per sequence: 1 or 0
  kernels::TrellisState<memory_space> state_;
  kernels::TrellisScratch<memory_space> scratch_;
  Kokkos::View<long, memory_space> first_bad_gate_;  // check_gates' result (device scalar)
  bool strict_slots_ = false;                        ///< set_strict_slots()
};

}  // namespace kvmem
