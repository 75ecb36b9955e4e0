#pragma once
/// \file run_tokens.hpp
/// Runs a batch through any memory (kvmem::AttentionMemory) in prefill or decode mode: the one loop of
/// every `kvmem-run` command (kvm, ovq, evict, trellis) and of kvmem-eval's runs.

#include <Kokkos_Core.hpp>
#include <chrono>
#include <span>
#include <string>
#include <vector>

#include <kvmem/memory_concept.hpp>
#include <kvmem/token_checks.hpp>

namespace kvmem::tools {

/// Runs `in` (the memory's inputs, T tokens per sequence) through `mem` and writes y [B, Hq, T, Dv]:
/// "prefill", one prefill in which sequence b takes lengths[b] tokens; "decode", token by token, step t
/// advancing the sequences with t < lengths[b] (the rows of y past a length stay as they were). Both give
/// the same y (the memories' prefill == decode). `prompt` >= 0 in "prefill" mode: only the first `prompt`
/// tokens are one prefill (a prompt), the others decode steps (an answer; what a memory that compresses at
/// the end of a prompt needs, EvictionConfig::chunk = 0). Returns the wall time in seconds, fenced at both
/// ends. Throws what the memory's prefill() and decode() throw.
template <AttentionMemory M>
double run_tokens(M& mem, const typename M::inputs& in, const typename M::tokens_out& y, const std::string& mode,
                  const std::vector<long>& lengths, long prompt = -1) {
  Kokkos::fence();
  const auto start = std::chrono::steady_clock::now();
  if (mode == "prefill" && prompt < 0) {
    mem.prefill(in, y, lengths);
  } else {
    const long B = static_cast<long>(lengths.size()), T = static_cast<long>(y.extent(2));
    long first = 0;  // the first decode step
    if (mode == "prefill") {
      std::vector<long> head(lengths);
      for (auto& n : head) n = n < prompt ? n : prompt;
      mem.prefill(in, y, head);
      first = prompt < T ? prompt : T;
    }
    std::vector<unsigned char> active(B);
    for (long t = first; t < T; ++t) {
      for (long b = 0; b < B; ++b) active[b] = t < lengths[b];
      mem.decode(in.token(t), detail::token_slice(y, t), active);
    }
  }
  Kokkos::fence();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace kvmem::tools
