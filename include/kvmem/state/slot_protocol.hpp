#pragma once
/// \file slot_protocol.hpp
/// The strict slot protocol every memory offers an engine (set_strict_slots(true); docs/design.md
/// "Requests that come and go"): prefill() starts a prompt in a free slot, extend() continues one, decode()
/// continues one, and a call that does not fit a slot's state is refused before anything changes.

#include <span>
#include <string>

#include "../errors.hpp"

namespace kvmem::state {

/// What a call does to the sequences it takes tokens for.
enum class SlotCall {
  prefill,  ///< starts prompts: under the strict protocol, only in free slots (no token held)
  extend,   ///< continues prompts (chunked prefill): only in sequences that hold tokens, always
  decode,   ///< one step: under the strict protocol, only for sequences that hold tokens
};

/// Throws kvmem::invalid_argument, naming the call, the sequence and its state, for the first sequence b
/// that `call` takes tokens for (takes(b)) whose state does not allow it: a prefill (strict) of a sequence
/// that holds tokens, an extend of one that holds none, a decode (strict) of one that holds none. held(b):
/// tokens sequence b holds. Nothing for the permissive protocol's prefill and decode.
template <class Takes, class Held>
void check_slots(SlotCall call, bool strict, long batch, Takes takes, Held held) {
  if (call != SlotCall::extend && !strict) return;
  for (long b = 0; b < batch; ++b) {
    if (!takes(b)) continue;
    const long n = held(b);
    const std::string seq = " sequence " + std::to_string(b);
    if (call == SlotCall::prefill && n > 0)
      throw invalid_argument(detail::describe(
          "prefill:" + seq, "busy (holds " + std::to_string(n) + " tokens)",
          "a prefill starts a prompt in a free slot (strict slots); continue it with extend(), or free the slot "
          "with reset_sequence(" + std::to_string(b) + ") first"));
    if (call != SlotCall::prefill && n == 0)
      throw invalid_argument(detail::describe(
          std::string(call == SlotCall::extend ? "extend:" : "decode:") + seq, "empty (holds no token)",
          call == SlotCall::extend ? "extend continues a prompt that prefill() started; start it with prefill()"
                                   : "a decode step continues a prompt (strict slots); start it with prefill()"));
  }
}

/// check_slots for the sequences with lengths[b] > 0 (all, when `lengths` is empty and T > 0).
template <class Held>
void check_slots(SlotCall call, bool strict, long batch, std::span<const long> lengths, long T, Held held) {
  check_slots(call, strict, batch, [&](long b) { return lengths.empty() ? T > 0 : lengths[b] > 0; }, held);
}

/// check_slots for the sequences with active[b] != 0 (all, when `active` is empty). Nothing for an `active`
/// of another size than the batch, which set_active() then refuses.
template <class Held>
void check_slots(SlotCall call, bool strict, long batch, std::span<const unsigned char> active, Held held) {
  if (!active.empty() && static_cast<long>(active.size()) != batch) return;
  check_slots(call, strict, batch, [&](long b) { return active.empty() || active[b] != 0; }, held);
}

}  // namespace kvmem::state
