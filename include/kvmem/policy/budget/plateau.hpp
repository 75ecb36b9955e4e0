#pragma once
/// \file plateau.hpp
/// budget::Plateau — OVQ's dictionary schedule N_t = t N / (t + N) (ovq-paper Sec. 3.2; spec OVQ.md §3).

#include "../../errors.hpp"
#include "concept.hpp"
#include "saturating.hpp"

namespace kvmem::budget {

/// B(t) = floor(t * N / (t + N)) rows after t tokens, computed in double: OVQ's name for the schedule KVM
/// calls saturating, without KVM's min_rows and round-down (the formula is budget::Saturating's). It
/// approaches but never reaches N; with N = 1 it is 0 forever. Pair it with MemoryConfig::max_rows = N.
struct Plateau {
  static constexpr std::string_view name = "plateau";
  double n = 2048;  ///< N, rows approached (OVQ `max_centroids`)

  [[nodiscard]] long rows(long ctx) const { return Saturating{-1, n, 1}.rows(ctx); }
  /// Throws kvmem::invalid_argument if n is not finite or < 1.
  void validate() const { require(std::isfinite(n) && n >= 1.0, "max_centroids", n, "must be >= 1"); }
};
static_assert(BudgetSchedule<Plateau>);

}  // namespace kvmem::budget
