#pragma once
/// \file schedule.hpp
/// Host-side bookkeeping of one sequence: tokens seen, tokens covered by the state, state rows.
///
/// Everything here depends only on the token counts and the budget schedule, never on the data, so
/// the host knows each kernel's work before it launches it and never waits on the device
/// (the "plan" step of FlashInfer-style engines). Source: spec KVM.md §2, §4, §5.1, §6.

#include <Kokkos_Core.hpp>
#include <algorithm>

#include "../config.hpp"
#include "../policy/budget/concept.hpp"

namespace kvmem::state {

/// Start of the block sliding window once `n` tokens exist, in tokens:
/// max(0, ceil(n / C) * C - L) (spec KVM.md §2). Always a multiple of C. Host and device code.
[[nodiscard]] KOKKOS_INLINE_FUNCTION long window_begin(long n, long chunk, long window) {
  const long end = ((n + chunk - 1) / chunk) * chunk;
  return end > window ? end - window : 0L;
}

/// One state update with the overflow block [block_begin, block_begin + chunk) (spec KVM.md §5.1).
struct UpdatePlan {
  long block_begin = 0;  ///< first token of the overflow block
  long ctx = 0;          ///< context length used by the budget: L + block_begin, tokens
  long rows_before = 0;  ///< m: rows before the update
  long append = 0;       ///< n_app in [0, chunk]: rows appended; the other chunk - n_app tokens merge
  [[nodiscard]] long rows_after() const { return rows_before + append; }
};

/// Desired size M* = max(m, min(B(ctx), avail, max_rows)) and n_app = min(M* - m, C)
/// for the block starting at `block_begin`, with ctx = L + block_begin and avail = block_begin + C.
template <budget::BudgetSchedule Budget>
[[nodiscard]] UpdatePlan plan_update(const MemoryConfig& cfg, const Budget& budget, long rows, long block_begin) {
  UpdatePlan p;
  p.block_begin = block_begin;
  p.ctx = cfg.window() + block_begin;
  p.rows_before = rows;
  const long avail = block_begin + cfg.chunk;
  const long target = std::max(rows, std::min({budget.rows(p.ctx), avail, cfg.max_rows}));
  p.append = std::min(target - rows, static_cast<long>(cfg.chunk));
  return p;
}

/// Token counts of one sequence as its memory sees them (a plain struct: host vectors and device views
/// hold it alike).
struct SequenceCursor {
  long tokens = 0;   ///< n: tokens seen so far
  long covered = 0;  ///< cov: tokens [0, cov) are represented by the state
  long rows = 0;     ///< m: state rows (the same for every kv-head of the sequence)
  long granted = 0;  ///< rows the budget schedule has granted: rows plus those evicted (row eviction)
};

/// The rows a sequence of `tokens` tokens ends with after prefill, without running it (for sizing).
template <budget::BudgetSchedule Budget>
[[nodiscard]] long final_rows(const MemoryConfig& cfg, const Budget& budget, long tokens) {
  long rows = std::min<long>(tokens, cfg.chunk);
  long cov = rows;
  const long target = std::max(rows, window_begin(tokens, cfg.chunk, cfg.window()));
  while (cov < target) {
    rows = plan_update(cfg, budget, rows, cov).rows_after();
    cov += cfg.chunk;
  }
  return rows;
}

}  // namespace kvmem::state
