#pragma once
/// \file power_law.hpp
/// budget::PowerLaw — rows growing as a * ctx^p (kvm-paper Sec. 4, "16 sqrt(N)": a = 16, p = 0.5).

#include <cmath>

#include "../../errors.hpp"
#include "concept.hpp"

namespace kvmem::budget {

/// B(ctx) = max(rd(floor(growth_factor * ctx^growth_exponent)), min_rows), in rows, computed in double;
/// rd rounds down to a multiple of `round_down` (spec KVM.md §5.2). p = 0.5 uses sqrt, which is correctly
/// rounded, so exact squares give exact budgets (spec §9 #8).
struct PowerLaw {
  static constexpr std::string_view name = "power-law";
  long min_rows = -1;            ///< rows; lower bound of the budget
  double growth_factor = 1.0;    ///< a
  double growth_exponent = 0.5;  ///< p
  long round_down = 1;           ///< R >= 1: the budget is a multiple of R rows

  [[nodiscard]] long rows(long ctx) const {
    const double c = static_cast<double>(ctx);
    const double grown = growth_exponent == 0.5 ? std::sqrt(c) : std::pow(c, growth_exponent);
    const long b = detail::round_down(std::floor(growth_factor * grown), round_down);
    return b > min_rows ? b : min_rows;
  }
  /// Throws kvmem::invalid_argument for min_rows < -1, a non-finite or negative growth factor or
  /// exponent, or round_down < 1.
  void validate() const {
    require(min_rows >= -1, "min_rows", min_rows, "must be >= -1");
    require(std::isfinite(growth_factor) && growth_factor >= 0.0, "growth_factor", growth_factor,
            "must be finite and >= 0");
    require(std::isfinite(growth_exponent) && growth_exponent >= 0.0, "growth_exponent", growth_exponent,
            "must be finite and >= 0");
    require(round_down >= 1, "round_down", round_down, "must be >= 1");
  }
};
static_assert(BudgetSchedule<PowerLaw>);

}  // namespace kvmem::budget
