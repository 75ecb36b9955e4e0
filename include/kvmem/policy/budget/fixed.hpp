#pragma once
/// \file fixed.hpp
/// budget::Fixed — a constant number of state rows (kvm-paper Sec. 4 "fixed", KVM code `fixed`).

#include "../../errors.hpp"
#include "concept.hpp"

namespace kvmem::budget {

/// B(ctx) = min_rows, in rows. With the default -1 (or any value below the chunk) the state never
/// grows past its first chunk and every later overflow block is merged (spec KVM.md §5.2).
struct Fixed {
  static constexpr std::string_view name = "fixed";
  long min_rows = -1;  ///< rows; -1 = the first chunk's size

  [[nodiscard]] long rows(long /*ctx*/) const { return min_rows; }
  /// Throws kvmem::invalid_argument if min_rows < -1.
  void validate() const { require(min_rows >= -1, "min_rows", min_rows, "must be >= -1"); }
};
static_assert(BudgetSchedule<Fixed>);

}  // namespace kvmem::budget
