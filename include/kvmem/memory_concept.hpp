#pragma once
/// \file memory_concept.hpp
/// kvmem::AttentionMemory: the one contract every memory facade keeps (Memory, EvictionMemory,
/// TrellisMemory), so that an engine, a tool or a binding drives any of them through the same calls
/// (docs/design.md, "One memory contract").

#include <concepts>
#include <span>

namespace kvmem {

/// A memory of one layer for a batch of B sequences (slots), driven by an engine. M provides:
/// - the types `execution_space`, `memory_space`, `storage_type`, `tokens_out` (y [B, Hq, T, Dv], strided,
///   unit channel stride) and `inputs`, an aggregate of the views one call reads (the family's own: q, k, v
///   [B, heads, T, channels] for eviction; with the merge gates [B, Hkv, T] for KVM/OVQ/proportional; with
///   Trellis's targets and gates), T tokens per sequence, whose `token(t)` is token t of each (T = 1, no
///   copy: a prompt decoded token by token);
/// - `prefill(in, y, lengths)`: sequence b takes lengths[b] tokens (all T when empty) after those it holds,
///   0 leaving it alone, with the meaning of one prefill of its whole prompt; `decode(in, y, active)`: one
///   token (T = 1) for each sequence with active[b] != 0 (all when empty); `decode_async(in, y)`: decode's
///   launches only, for the active set of `set_active(active)`, to capture in a CUDA graph; `sync()` brings
///   the host's counts up to the device's; `plan_on_device()` makes a host backend count as a GPU does;
/// - `extend(in, y, lengths)`: prefill() that only continues prompts (chunked prefill), refusing a sequence
///   with lengths[b] > 0 that holds no token; `set_strict_slots(on)` / `strict_slots()`: the strict slot
///   protocol, under which prefill() refuses a sequence that holds tokens and decode() one that holds none
///   (state/slot_protocol.hpp), each naming the sequence before anything changes;
/// - `reset()` forgets every sequence, `reset_sequence(b)` sequence b alone (a finished request frees its
///   slot; the others keep their state bit for bit);
/// - `batch()` (sequences), `tokens(b)` (tokens sequence b has seen), `held_bytes()` (bytes its keys,
///   values and state hold for the tokens seen) and `allocated_bytes()` (bytes allocated on the device).
/// - `softmax_readout`: whether y is one softmax over keys (Memory, EvictionMemory: true; TrellisMemory, read
///   through its slots: false). When true, M also has `lse_out` (lse [B, Hq, T], float32, any strides) and
///   the overloads `prefill(in, y, lengths, lse)`, `decode(in, y, active, lse)` and `decode_async(in, y,
///   lse)`, which also write the readout's log-sum-exp (-inf for a query that reads no key), so that y can be
///   merged with attention over other keys (a shared prefix, another memory) by log-sum-exp, as FlashInfer's
///   MergeState or vLLM's merge_attn_states do.
/// Each call throws kvmem::invalid_argument for bad input before anything changes (see each facade).
/// What stays family-specific (docs/design.md): construction (config, budget, weights, scorer), the
/// inputs' contents, reserve() (KVM/OVQ: the fold table a graph replays), kept() (eviction), set_state()
/// (Trellis) and the state one reads back.
template <class M>
concept AttentionMemory =
    requires(M m, const M cm, const typename M::inputs& in, const typename M::tokens_out& y,
             std::span<const long> lengths, std::span<const unsigned char> active, long b) {
      { in.token(b) } -> std::same_as<typename M::inputs>;
      typename M::execution_space;
      typename M::memory_space;
      typename M::storage_type;
      m.prefill(in, y, lengths);
      m.extend(in, y, lengths);
      m.decode(in, y, active);
      m.set_strict_slots(true);
      { cm.strict_slots() } -> std::same_as<bool>;
      m.decode_async(in, y);
      m.set_active(active);
      m.sync();
      m.plan_on_device();
      m.reset();
      m.reset_sequence(b);
      { cm.batch() } -> std::same_as<long>;
      { cm.tokens(b) } -> std::same_as<long>;
      { cm.held_bytes() } -> std::same_as<long>;
      { cm.allocated_bytes() } -> std::same_as<long>;
      { M::softmax_readout } -> std::convertible_to<bool>;
    } && (!M::softmax_readout || requires(M m, const typename M::inputs& in, const typename M::tokens_out& y,
                                          const typename M::lse_out& lse, std::span<const long> lengths,
                                          std::span<const unsigned char> active) {
      m.prefill(in, y, lengths, lse);
      m.extend(in, y, lengths, lse);
      m.decode(in, y, active, lse);
      m.decode_async(in, y, lse);
    });

}  // namespace kvmem
