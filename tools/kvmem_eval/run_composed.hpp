#pragma once
/// \file run_composed.hpp
/// Runs a memory composed with kvmem::Memory (KVM, OVQ, and any other merge x budget x scorer) over the
/// inputs with prefill and reports what it held.

#include <Kokkos_Core.hpp>
#include <algorithm>

#include "memory_kind.hpp"
#include "timed_prefill.hpp"

namespace kvmem::tools::eval {

/// Bytes per kv-head of a composed memory holding `rows` state rows and `tokens` window tokens, as
/// Memory::held_bytes counts them: a state row (D + Dv + 1) float32 (key and value sums, radius or count),
/// a window token (D + Dv) elements of the storage type T and a float32 gate.
template <StorageType T>
long composed_bytes(long rows, long tokens, long D, long Dv) {
  return rows * (D + Dv + 1) * static_cast<long>(sizeof(float)) +
         tokens * ((D + Dv) * static_cast<long>(sizeof(T)) + static_cast<long>(sizeof(float)));
}

/// Prefills `mem` (empty, built for the inputs' batch) with the tokens `in` (storage type T; the first
/// `prompt` of them, the rest decode steps, when `prompt` >= 0) and writes y [B, Hq, T, Dv] of that type.
/// Held memory is the facade's accounting (composed_bytes).
template <class ComposedMemory, StorageType T, class Y>
RunStats run_composed(ComposedMemory& mem, const InputsOf<T>& in, const Y& y, long prompt = -1) {
  const auto& cfg = mem.config();
  RunStats s = timed_prefill(mem, typename ComposedMemory::inputs{in.q, in.k, in.v, in.gate}, y, in.lengths, prompt);
  for (long b = 0; b < in.B; ++b) {
    s.rows.push_back(mem.cursor(b).rows);
    s.window.push_back(mem.window_tokens(b));
  }
  // Rows only grow, and the window holds at most min(n, L) tokens, so rows + min(n, L) bounds what is held
  // at any token; it is exact when the last token ends a chunk (then the window holds L tokens).
  long bytes = 0;
  for (long b = 0; b < in.B; ++b) bytes += composed_bytes<T>(s.rows[b], std::min(in.lengths[b], cfg.window()), in.D, in.Dv);
  s.peak_bytes = bytes * in.Hkv;
  s.peak_bytes = std::max(s.peak_bytes, s.held_bytes);
  return s;
}

}  // namespace kvmem::tools::eval
