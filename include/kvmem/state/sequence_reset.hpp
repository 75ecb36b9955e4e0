#pragma once
/// \file sequence_reset.hpp
/// What every memory's reset_sequence(b) shares: clearing one sequence's slice of a state view, and the
/// checks that come before (a finished request frees its slot; docs/design.md "Requests that come and go").

#include <Kokkos_Core.hpp>
#include <string>

#include "../errors.hpp"
#include "sequence_counts.hpp"

namespace kvmem::state {

/// Sets sequence b's slice view(b, ...) of a view whose first axis is the sequence (rank 1 to 4, any
/// layout) to `value`, enqueued on `exec` (no fence). Nothing for an unallocated view. Other sequences'
/// slices are not touched.
template <class ExecSpace, class View>
void fill_sequence(const ExecSpace& exec, const View& view, long b, typename View::non_const_value_type value) {
  if (view.data() == nullptr) return;
  constexpr auto all = Kokkos::ALL;
  if constexpr (View::rank() == 1)
    Kokkos::deep_copy(exec, Kokkos::subview(view, std::make_pair(b, b + 1)), value);
  else if constexpr (View::rank() == 2)
    Kokkos::deep_copy(exec, Kokkos::subview(view, b, all), value);
  else if constexpr (View::rank() == 3)
    Kokkos::deep_copy(exec, Kokkos::subview(view, b, all, all), value);
  else {
    static_assert(View::rank() == 4, "fill_sequence takes views of rank 1 to 4");
    Kokkos::deep_copy(exec, Kokkos::subview(view, b, all, all, all), value);
  }
}

/// The checks of a memory's reset_sequence(b), before anything changes: b in [0, B), and b is not a
/// sequence that launches already made (decode_async on a GPU, or after plan_on_device()) may still
/// advance: while the device counts steps on its own (`counts.replayable()`), a captured graph replays
/// the active set of its capture, so b must first leave it (set_active without b). Throws
/// kvmem::invalid_argument naming the sequence and its state.
template <class T, class MemorySpace>
void check_reset_sequence(long b, const SequenceCounts<T, MemorySpace>& counts,
                          const SequenceCounts<long, MemorySpace>& active) {
  require(b >= 0 && b < counts.size(), "reset_sequence: b", b,
          "must be in [0, batch = " + std::to_string(counts.size()) + ")");
  if (counts.replayable() && active.host(b) != 0)
    throw invalid_argument(detail::describe(
        "reset_sequence: sequence " + std::to_string(b), "active in decode_async's set",
        "a captured graph may still advance it; call set_active() without it (and sync()) first"));
}

}  // namespace kvmem::state
