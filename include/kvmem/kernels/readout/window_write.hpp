#pragma once
/// \file window_write.hpp
/// Copies new tokens' keys, values and gate pre-activations into the block sliding window ring.

#include <Kokkos_Core.hpp>

#include "../../config.hpp"
#include "../../state/state_rows.hpp"
#include "../plan/step_launch.hpp"
#include "../plan/step_plan.hpp"

namespace kvmem::kernels {

/// Copies the token at position `pos` of plan row b (`p`: StepPlan::device) and kv-head h into its ring
/// slot pos % slots: the key from k [B, Hkv, T, D] through Merge::window_key, the value from v [B, Hkv, T,
/// Dv] (input index pos - input_offset), the gate pre-activation from gate [B, Hkv, T] (an empty `gate`
/// view writes z = 0). One thread's part of write_window, and of a readout that writes the window itself
/// (WindowTokens). Source: the block sliding window of the kvm-paper (Sec. 4), spec KVM.md §6.
template <class Merge, class Ring, class Plan, class KeysIn, class GateIn>
KOKKOS_INLINE_FUNCTION void write_window_token(const MemoryConfig& cfg, const Ring& ring, const Plan& p,
                                               const KeysIn& k, const KeysIn& v, const GateIn& gate, long b,
                                               long h, long pos) {
  const int Dv = static_cast<int>(ring.values.extent(3));
  const long t = pos - p(b, input_offset), s = ring.slot(pos);
  Merge::window_key(cfg, &k(b, h, t, 0), &ring.keys(b, h, s, 0));
  for (int c = 0; c < Dv; ++c) ring.values(b, h, s, c) = v(b, h, t, c);
  ring.gates(b, h, s) = gate.data() != nullptr ? to_float(gate(b, h, t)) : 0.0f;
}

/// The new tokens of a step, for a readout that writes them into the window itself before it reads the
/// window (kernels::readout with readout_writes_window: a decode step is then one launch fewer). k [B, Hkv,
/// T, D], v [B, Hkv, T, Dv], gate [B, Hkv, T] or empty, indexed as write_window reads them.
template <class KeysIn, class GateIn>
struct WindowTokens {
  static constexpr bool writes = true;
  KeysIn k, v;
  GateIn gate;
};
/// No new tokens: the readout reads a window that write_window already wrote.
struct NoWindowTokens {
  static constexpr bool writes = false;
};

/// For every sequence b and kv-head h, copies tokens at positions [write_begin, write_end) of plan row b
/// into ring slot position % slots (write_window_token). `max_tokens` bounds write_end - write_begin over
/// the batch (tokens). Keys and values are stored in the ring's storage type T (the inputs are of that
/// type; window_key computes in float32 and rounds once), gates as float32.
template <class Merge, class ExecSpace, StorageType T, class KeysIn, class GateIn>
void write_window(const ExecSpace& exec, const MemoryConfig& cfg,
                  const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                  const StepPlan<typename ExecSpace::memory_space>& plan, const KeysIn& k, const KeysIn& v,
                  const GateIn& gate, long max_tokens) {
  const long B = static_cast<long>(ring.keys.extent(0)), H = static_cast<long>(ring.keys.extent(1));
  if (max_tokens <= 0 || B == 0) return;
  const auto p = plan.device;
  // A label of at most 15 characters: Kokkos copies it into a std::string at every launch, and a longer
  // one would be a heap allocation per decoded token (docs/reliability.md).
  Kokkos::parallel_for(
      "kvmem::window", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B * H * max_tokens), KOKKOS_LAMBDA(long idx) {
        const long i = idx % max_tokens, h = (idx / max_tokens) % H, b = idx / (max_tokens * H);
        const long pos = p(b, write_begin) + i;
        if (pos >= p(b, write_end)) return;
        write_window_token<Merge>(cfg, ring, p, k, v, gate, b, h, pos);
      });
}

}  // namespace kvmem::kernels
