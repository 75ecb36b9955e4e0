#pragma once
/// \file row_eviction.hpp
/// Row eviction for merging memories: a KVM or OVQ memory whose state rows are also evicted by a score
/// when they exceed a cap (a combination of kvm-paper / ovq-paper merging with H2O eviction, Zhang et al.
/// 2023; no paper runs it). The RowEviction concept, score::KeepRows (no eviction, the default) and
/// score::RowAccumulatedAttention (H2O over state rows).

#include <Kokkos_Core.hpp>
#include <concepts>
#include <string_view>

#include "../../errors.hpp"

namespace kvmem::score {

/// A row-eviction policy for Memory: `name`, `evicts` (false: rows are never evicted, nothing is paid),
/// `needs_probabilities` (the readout then also writes each query's log-sum-exp and the memory accumulates
/// every state row's attention probability), `max_rows` (the cap, rows per kv-head, checked by
/// validate()), and the float64 device hook `attended(stat, p)` on a row's statistic after each query
/// (p = sum over the query heads of the group of the row's probability). When a fold leaves more than
/// max_rows rows, the rows with the lowest statistic are evicted (ties: the older row, the lower index),
/// never the first MemoryConfig::sinks rows. New rows start at statistic 0; merged rows keep theirs.
template <class P>
concept RowEviction = std::copy_constructible<P> && requires(const P p, double stat) {
  { P::name } -> std::convertible_to<std::string_view>;
  { P::evicts } -> std::convertible_to<bool>;
  { P::needs_probabilities } -> std::convertible_to<bool>;
  { p.max_rows } -> std::convertible_to<long>;
  { p.attended(stat, stat) } -> std::same_as<double>;
  p.validate();
};

/// No row eviction: the budget schedule alone bounds the rows (KVM, OVQ as in their papers).
struct KeepRows {
  static constexpr std::string_view name = "none";
  static constexpr bool evicts = false;
  static constexpr bool needs_probabilities = false;
  long max_rows = 0;
  KOKKOS_INLINE_FUNCTION double attended(double stat, double) const { return stat; }
  void validate() const {}
};
static_assert(RowEviction<KeepRows>);

/// H2O over state rows: a row's statistic is the attention probability it received from every query
/// since it was founded, summed over the query heads of the group; after a fold leaves more than
/// `max_rows` rows, the rows with the lowest statistic are evicted (sinks kept). Stale rows, those no query
/// reads any more, go first; merged rows keep what they earned.
struct RowAccumulatedAttention {
  static constexpr std::string_view name = "h2o";
  static constexpr bool evicts = true;
  static constexpr bool needs_probabilities = true;
  long max_rows = 256;  ///< cap on state rows per kv-head after every fold (>= 1)
  KOKKOS_INLINE_FUNCTION double attended(double stat, double p) const { return stat + p; }
  /// Throws kvmem::invalid_argument naming `max_rows` unless >= 1.
  void validate() const { require(max_rows >= 1, "max_rows (row eviction)", max_rows, "must be >= 1"); }
};
static_assert(RowEviction<RowAccumulatedAttention>);

}  // namespace kvmem::score
