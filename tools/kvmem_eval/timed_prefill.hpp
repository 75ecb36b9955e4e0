#pragma once
/// \file timed_prefill.hpp
/// The part of a kvmem-eval run that every memory family shares, through the one memory contract
/// (kvmem::AttentionMemory): a timed prefill and the memory's own accounting of what it holds.

#include <vector>

#include <kvmem/memory_concept.hpp>

#include "../kvmem_run/run_tokens.hpp"
#include "memory_kind.hpp"

namespace kvmem::tools::eval {

/// Prefills `mem` (empty, built for the inputs' batch) with `in`, lengths[b] tokens of sequence b, and
/// writes y [B, Hq, T, Dv]; with `prompt` >= 0 only the first `prompt` tokens are the prefill and the others
/// decode steps (run_tokens; kvmem-eval --prompt). Returns the RunStats every family fills alike: the wall
/// time and held_bytes() after it, also as the peak (the caller refines the peak and adds rows and window,
/// which are the family's).
template <AttentionMemory M>
RunStats timed_prefill(M& mem, const typename M::inputs& in, const typename M::tokens_out& y,
                       const std::vector<long>& lengths, long prompt = -1) {
  RunStats s;
  s.seconds = run_tokens(mem, in, y, "prefill", lengths, prompt);
  s.held_bytes = s.peak_bytes = mem.held_bytes();
  return s;
}

}  // namespace kvmem::tools::eval
