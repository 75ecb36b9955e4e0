#pragma once
/// \file run_composed.hpp
/// Runs a memory composed with kvmem::Memory (KVM, OVQ, and any other merge x budget x scorer) over the
/// inputs with prefill and reports what it held.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>

#include "memory_kind.hpp"

namespace kvmem::tools::eval {

/// Prefills `mem` (empty, built for the inputs' batch) with the inputs and writes y [B, Hq, T, Dv].
/// Held memory is the facade's accounting: per kv-head, (state rows + window tokens) x (D + Dv + 1)
/// float32 (key, value, and the row's radius or count / the token's gate).
template <class ComposedMemory>
RunStats run_composed(ComposedMemory& mem, const Inputs& in, const OutView& y) {
  const auto& cfg = mem.config();
  Kokkos::fence();
  const auto start = std::chrono::steady_clock::now();
  mem.prefill(in.q, in.k, in.v, in.gate, y, in.lengths);
  Kokkos::fence();
  RunStats s;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (long b = 0; b < in.B; ++b) {
    s.rows.push_back(mem.cursor(b).rows);
    s.window.push_back(mem.window_tokens(b));
  }
  s.held_bytes = mem.held_bytes();
  // Rows only grow, and the window holds at most min(n, L) tokens, so rows + min(n, L) bounds what is held
  // at any token; it is exact when the last token ends a chunk (then the window holds L tokens).
  long units = 0;
  for (long b = 0; b < in.B; ++b) units += s.rows[b] + std::min(in.lengths[b], cfg.window());
  s.peak_bytes = units * in.Hkv * (in.D + in.Dv + 1) * static_cast<long>(sizeof(float));
  s.peak_bytes = std::max(s.peak_bytes, s.held_bytes);
  return s;
}

}  // namespace kvmem::tools::eval
