#pragma once
/// \file prompt_calls.hpp
/// The prompt calls that the softmax memories (Memory, EvictionMemory) offer alike through the one memory
/// contract (kvmem::AttentionMemory): prefill and extend, with or without the readout's log-sum-exp, and
/// the strict slot protocol's switch. Each forwards to the facade's own run_prompt().

#include <span>

#include "state/slot_protocol.hpp"

namespace kvmem::detail {

/// Base of a facade Derived (CRTP) whose private `run_prompt(in, y, lengths, lse, call)` runs a prompt
/// (state::SlotCall prefill or extend) and which befriends this class. Derived provides the types `inputs`,
/// `tokens_out` and `lse_out` (lse [B, Hq, T], float32); the calls name them through D = Derived, which is
/// complete where they are used. Derived declares `using PromptCalls<Derived>::prefill;` beside its own.
template <class Derived>
class PromptCalls {
 public:
  /// Runs lengths[b] tokens of each sequence b (all T when `lengths` is empty) after those it holds (the
  /// facade's prefill; under set_strict_slots(true), a sequence with lengths[b] > 0 that holds tokens is
  /// refused: extend() continues it).
  template <class D = Derived>
  void prefill(const typename D::inputs& in, const typename D::tokens_out& y, std::span<const long> lengths = {}) {
    self().run_prompt(in, y, lengths, typename D::lse_out{}, state::SlotCall::prefill);
  }
  /// prefill() that also writes the readout's log-sum-exp lse [B, Hq, T] (-inf at t >= lengths[b]; not
  /// written when empty). Throws as prefill(), and kvmem::invalid_argument for an lse of other extents.
  template <class D = Derived>
  void prefill(const typename D::inputs& in, const typename D::tokens_out& y, std::span<const long> lengths,
               const typename D::lse_out& lse) {
    self().run_prompt(in, y, lengths, lse, state::SlotCall::prefill);
  }
  /// prefill() that only continues prompts (chunked prefill): sequence b takes lengths[b] tokens after the
  /// ones it holds. Throws as prefill(), and kvmem::invalid_argument naming the sequence when one with
  /// lengths[b] > 0 holds no token (state::SlotCall::extend), before anything changes.
  template <class D = Derived>
  void extend(const typename D::inputs& in, const typename D::tokens_out& y, std::span<const long> lengths = {}) {
    self().run_prompt(in, y, lengths, typename D::lse_out{}, state::SlotCall::extend);
  }
  /// extend() that also writes the readout's log-sum-exp, as prefill() with lse.
  template <class D = Derived>
  void extend(const typename D::inputs& in, const typename D::tokens_out& y, std::span<const long> lengths,
              const typename D::lse_out& lse) {
    self().run_prompt(in, y, lengths, lse, state::SlotCall::extend);
  }
  /// The strict slot protocol (off by default; state/slot_protocol.hpp): prefill() then refuses a sequence
  /// that holds tokens (a request in a busy slot) and decode() one that holds none (a step of a request
  /// that never started), naming the sequence, before anything changes; extend() continues prompts.
  /// decode_async() does not check (the host's counts may be behind a GPU's).
  void set_strict_slots(bool on) { strict_slots_ = on; }
  [[nodiscard]] bool strict_slots() const { return strict_slots_; }

 protected:
  bool strict_slots_ = false;  ///< set_strict_slots()

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

}  // namespace kvmem::detail
