#pragma once
/// \file linear.hpp
/// budget::Linear — one row per token seen, up to the memory's row cap (OVQ code `ovq_use_min_state_size`).

#include "concept.hpp"

namespace kvmem::budget {

/// B(ctx) = ctx rows: the state grows as fast as tokens arrive until MemoryConfig::max_rows caps it
/// (OVQ's `min(t, N)` growth, spec OVQ.md §3).
struct Linear {
  static constexpr std::string_view name = "linear";
  [[nodiscard]] long rows(long ctx) const { return ctx; }
  void validate() const {}
};
static_assert(BudgetSchedule<Linear>);

}  // namespace kvmem::budget
