#pragma once
/// \file concept.hpp
/// The BudgetSchedule concept: how many state rows a memory may hold after a number of tokens.

#include <concepts>
#include <limits>
#include <string_view>

namespace kvmem::budget {

/// A budget schedule is a small host-side value type. `rows(ctx)` gives the budget B(ctx) in rows for a
/// context of `ctx` tokens; it must be non-decreasing in ctx and may be negative (meaning "no growth").
/// The memory caps it by the tokens available and by MemoryConfig::max_rows (spec KVM.md §5.1), so a
/// schedule needs no knowledge of the merge policy. `validate()` throws kvmem::invalid_argument for bad
/// parameters; `name` is the identifier used by tools and in messages.
template <class B>
concept BudgetSchedule = std::copyable<B> && requires(const B& b, long ctx) {
  { b.rows(ctx) } -> std::same_as<long>;
  { b.validate() };
  { B::name } -> std::convertible_to<std::string_view>;
};

namespace detail {
/// rd(x) of spec KVM.md §5.2: floor(max(x, 0) / R) * R for an already floored x, R >= 1. An x past the
/// range of long (a huge growth factor or exponent, or +inf) saturates to LONG_MAX instead of converting,
/// which would be undefined behaviour; NaN counts as 0. The memory caps the result by max_rows anyway.
[[nodiscard]] inline long round_down(double floored, long multiple) {
  constexpr double past_long = 9223372036854775808.0;  // 2^63
  const long x = floored > 0.0 ? (floored < past_long ? static_cast<long>(floored) : std::numeric_limits<long>::max()) : 0L;
  return (x / multiple) * multiple;
}
}  // namespace detail

}  // namespace kvmem::budget
