#pragma once
/// \file window_write.hpp
/// Copies new tokens' keys, values and gate pre-activations into the block sliding window ring.

#include <Kokkos_Core.hpp>

#include "../config.hpp"
#include "../state/state_rows.hpp"
#include "step_launch.hpp"
#include "step_plan.hpp"

namespace kvmem::kernels {

/// For every sequence b and kv-head h, copies tokens at positions [write_begin, write_end) of plan row b
/// from k [B, Hkv, T, D] (through Merge::window_key), v [B, Hkv, T, Dv] (input index = position -
/// input_offset) and gate [B, Hkv, T] into ring slot position % slots. `max_tokens` bounds
/// write_end - write_begin over the batch. An empty `gate` view writes z = 0. Keys and values are stored
/// in the ring's storage type T (the inputs are of that type; window_key computes in float32 and rounds
/// once), gates as float32.
template <class Merge, class ExecSpace, StorageType T, class KeysIn, class GateIn>
void write_window(const ExecSpace& exec, const MemoryConfig& cfg,
                  const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                  const StepPlan<typename ExecSpace::memory_space>& plan, const KeysIn& k, const KeysIn& v,
                  const GateIn& gate, long max_tokens) {
  const long B = static_cast<long>(ring.keys.extent(0)), H = static_cast<long>(ring.keys.extent(1));
  const int Dv = static_cast<int>(ring.values.extent(3));
  if (max_tokens <= 0 || B == 0) return;
  const auto p = plan.device;
  const bool has_gate = gate.data() != nullptr;
  // A label of at most 15 characters: Kokkos copies it into a std::string at every launch, and a longer
  // one would be a heap allocation per decoded token (docs/reliability.md).
  Kokkos::parallel_for(
      "kvmem::window", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B * H * max_tokens), KOKKOS_LAMBDA(long idx) {
        const long i = idx % max_tokens, h = (idx / max_tokens) % H, b = idx / (max_tokens * H);
        const long pos = p(b, write_begin) + i;
        if (pos >= p(b, write_end)) return;
        const long t = pos - p(b, input_offset), s = ring.slot(pos);
        Merge::window_key(cfg, &k(b, h, t, 0), &ring.keys(b, h, s, 0));
        for (int c = 0; c < Dv; ++c) ring.values(b, h, s, c) = v(b, h, t, c);
        ring.gates(b, h, s) = has_gate ? to_float(gate(b, h, t)) : 0.0f;
      });
}

}  // namespace kvmem::kernels
