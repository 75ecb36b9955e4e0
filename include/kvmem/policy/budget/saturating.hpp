#pragma once
/// \file saturating.hpp
/// budget::Saturating — rows approaching saturation_n as n*ctx/(n+ctx) (KVM code `kvm_saturation`).

#include <cmath>

#include "../../errors.hpp"
#include "concept.hpp"

namespace kvmem::budget {

/// B(ctx) = max(rd(floor(saturation_n * ctx / (saturation_n + ctx))), min_rows), in rows, computed in
/// double (spec KVM.md §5.2); never reaches saturation_n.
struct Saturating {
  static constexpr std::string_view name = "saturating";
  long min_rows = -1;           ///< rows; lower bound of the budget
  double saturation_n = 1024;   ///< N_sat, rows approached for long contexts
  long round_down = 1;          ///< R >= 1

  [[nodiscard]] long rows(long ctx) const {
    const double c = static_cast<double>(ctx);
    const long b = detail::round_down(std::floor((saturation_n * c) / (saturation_n + c)), round_down);
    return b > min_rows ? b : min_rows;
  }
  /// Throws kvmem::invalid_argument for min_rows < -1, saturation_n not finite or <= 0, round_down < 1.
  void validate() const {
    require(min_rows >= -1, "min_rows", min_rows, "must be >= -1");
    require(std::isfinite(saturation_n) && saturation_n > 0.0, "saturation_n", saturation_n,
            "must be finite and > 0");
    require(round_down >= 1, "round_down", round_down, "must be >= 1");
  }
};
static_assert(BudgetSchedule<Saturating>);

}  // namespace kvmem::budget
