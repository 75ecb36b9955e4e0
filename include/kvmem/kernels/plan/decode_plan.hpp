#pragma once
/// \file decode_plan.hpp
/// A decode step's plan worked out where the counts live: one token per active sequence (its window write,
/// readout and at most one fold), by one function that the host and a device kernel both run, so a decode
/// step on a GPU needs no plan from the host (spec KVM.md §6; docs/cuda.md, "A decode step: plan once, run
/// many").

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <utility>

#include "../../config.hpp"
#include "../../policy/budget/concept.hpp"
#include "../../state/schedule.hpp"
#include "step_launch.hpp"
#include "step_plan.hpp"

namespace kvmem::kernels {

/// What a decode step's plan depends on besides a sequence's cursor (tokens and rows).
struct DecodeShape {
  long chunk = 1;         ///< C, tokens
  long window = 0;        ///< L = window_chunks * C, tokens
  long row_cap = -1;      ///< RowPolicy::max_rows when state rows are evicted, else -1 (no cap), rows
  bool verbatim = false;  ///< Merge::first_chunk_verbatim: the first chunk's tokens become rows one by one
  bool eager = false;     ///< Merge::commit_eagerly: a block folds as soon as it is complete, before the readout

  /// The shape of a memory whose merge policy is `Merge`, with row cap `row_cap` (-1: rows are not evicted).
  template <class Merge>
  [[nodiscard]] static DecodeShape of(const MemoryConfig& cfg, long row_cap) {
    return {cfg.chunk, cfg.window(), row_cap, Merge::first_chunk_verbatim, Merge::commit_eagerly};
  }
};

/// The folds of a stream, by block: entry j = (rows granted before the fold of the block [jC, (j + 1)C), rows
/// that fold appends) [folds, 2], from state::plan_update along the one chain every sequence follows
/// (granted rows depend only on the tokens covered: spec KVM.md §5.1). A verbatim first chunk starts the
/// chain at block 1 with C rows (entry 0 holds -1, never a cursor's value); otherwise at block 0 with none.
/// Held on the device and on the host; extended by doubling on the host (cover()), never inside a step.
template <class MemorySpace>
struct FoldTable {
  using view_t = Kokkos::View<long* [2], Kokkos::LayoutRight, MemorySpace>;
  view_t device;
  decltype(Kokkos::create_mirror_view(std::declval<view_t>())) host;
  long folds = 0;  ///< entries held, blocks

  /// Makes the table hold at least `needed` blocks: nothing when it does; otherwise max(needed, 2 * folds,
  /// 16) blocks: one allocation, and on a GPU a host mirror's too and one copy to the device.
  template <class ExecSpace, budget::BudgetSchedule Budget>
  void cover(const ExecSpace& exec, const MemoryConfig& cfg, const Budget& budget, bool verbatim, long needed) {
    if (needed <= folds) return;
    const long n = std::max({needed, 2 * folds, 16L}), C = cfg.chunk;
    view_t grown(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kvmem::fold_table"), n);  // every entry written below
    auto mirror = Kokkos::create_mirror_view(grown);
    for (long j = 0; j < folds; ++j) mirror(j, 0) = host(j, 0), mirror(j, 1) = host(j, 1);
    long j = folds;
    long granted = folds > 0 ? host(folds - 1, 0) + host(folds - 1, 1) : (verbatim ? C : 0);
    if (verbatim && j == 0) mirror(j, 0) = -1, mirror(j, 1) = 0, ++j;
    for (; j < n; ++j) {
      const auto up = state::plan_update(cfg, budget, granted, j * C);
      mirror(j, 0) = granted;
      mirror(j, 1) = up.append;
      granted = up.rows_after();
    }
    if (mirror.data() != grown.data()) Kokkos::deep_copy(exec, grown, mirror);
    device = grown;
    host = mirror;
    folds = n;
  }
  /// Rows granted once blocks [0, j] have folded (j < folds), rows: what the state needs room for then.
  [[nodiscard]] long granted_after(long j) const { return host(j, 0) + host(j, 1); }
};

/// Writes plan_decode_token's fields into row b of a plan view [B, plan_fields] (a functor, not a lambda:
/// host and device code call it alike).
template <class Plan>
struct PlanRow {
  Plan plan;
  long b;
  KOKKOS_INLINE_FUNCTION void operator()(int field, long value) const { plan(b, field) = value; }
};

/// Plans one decode token of one sequence whose cursor is `cur` (spec KVM.md §6: push, direct append, at
/// most one fold, readout): calls row(field, value) for every PlanField of its plan row (e.g. a PlanRow)
/// and advances `cur`.
/// `table` is a FoldTable's host or device view with `folds` entries. Returns the tokens of the block the
/// step folds (0: none; C: a block; 1: a token of a verbatim first chunk that becomes a row), or -1 when the
/// table does not hold the fold the step needs or holds other granted rows for it (then nothing is written
/// and `cur` is kept). The host (Memory::decode) and the device (plan_decode) run this same function.
template <class Table, class Row>
KOKKOS_INLINE_FUNCTION long plan_decode_token(const DecodeShape& s, state::SequenceCursor& cur, const Table& table,
                                              long folds, const Row& row) {
  const long C = s.chunk, pos = cur.tokens, n = pos + 1, nb = state::window_begin(n, C, s.window);
  state::SequenceCursor next = cur;
  long block = 0, first = 0, before = 0, append = 0, evicted = 0;
  if (s.verbatim && cur.covered < (n < C ? n : C)) {
    first = cur.covered;
    block = append = n - cur.covered;
    before = cur.rows;
    next.rows = next.covered = next.granted = n;
  } else if (state::window_begin(s.eager ? n + 1 : n, C, s.window) > cur.covered) {  // the fold is due
    const long j = cur.covered / C;
    if (j >= folds || table(j, 0) != cur.granted) return -1;
    first = cur.covered;
    block = C;
    before = cur.rows;
    append = table(j, 1);
    next.granted = cur.granted + append;
    next.rows = cur.rows + append;
    if (s.row_cap >= 0 && next.rows > s.row_cap) evicted = next.rows - s.row_cap;
    next.rows -= evicted;
    next.covered = cur.covered + C;
  }
  const long read = s.eager ? cur.rows : next.rows;  // an eager policy reads before its fold, a lazy one after
  next.tokens = n;
  row(input_offset, pos);
  row(write_begin, pos);
  row(write_end, n);
  row(query_begin, pos);
  row(query_end, n);
  row(window_begin_pos, nb);
  row(read_rows, nb > 0 ? read : 0L);
  row(block_begin, first);
  row(block_count, block);
  row(rows_before, before);
  row(append_count, append);
  row(rows_evicted, evicted);
  cur = next;
  return block;
}

/// Why a device-planned decode step was refused (DecodeError; the step leaves that sequence untouched).
enum DecodeRefusal : long {
  decode_ok = 0,
  past_horizon = 1,  ///< the token's position is at or past the horizon reserved for launch-only steps
  past_table = 2,    ///< its fold is not in the fold table, or needs more state rows than allocated
};

/// The decode plan of every sequence, on the device: for each b with active(b) != 0, plan_decode_token
/// from cursors(b) into plan row b of `plan` [B, plan_fields] (zeros for an inactive sequence), and the
/// cursor advanced. A sequence whose token would reach position `horizon` or beyond, whose fold the table
/// lacks, or whose rows would pass `capacity` gets a zero row and keeps its cursor; error(0) then receives
/// the largest DecodeRefusal and error(1) the largest such position + 1 (atomic maxima, so the order of
/// threads changes nothing). One launch, "kvmem::plan", B threads.
template <class ExecSpace, class Cursors, class Table, class Active, class Plan, class Error>
void plan_decode(const ExecSpace& exec, const DecodeShape& s, const Cursors& cursors, const Table& table, long folds,
                 long capacity, long horizon, const Active& active, const Plan& plan, const Error& error) {
  const long B = static_cast<long>(cursors.extent(0));
  if (B == 0) return;
  Kokkos::parallel_for(
      "kvmem::plan", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B), KOKKOS_LAMBDA(long b) {
        for (int f = 0; f < plan_fields; ++f) plan(b, f) = 0;
        if (active(b) == 0) return;
        state::SequenceCursor cur = cursors(b);
        long refusal = cur.tokens + 1 > horizon ? long(past_horizon) : long(decode_ok);
        if (refusal == decode_ok) {
          const long block = plan_decode_token(s, cur, table, folds, PlanRow<Plan>{plan, b});
          if (block < 0 || plan(b, rows_before) + plan(b, append_count) > capacity) refusal = past_table;
        }
        if (refusal != decode_ok) {
          for (int f = 0; f < plan_fields; ++f) plan(b, f) = 0;
          Kokkos::atomic_max(&error(0), refusal);
          Kokkos::atomic_max(&error(1), cursors(b).tokens + 1);
          return;
        }
        cursors(b) = cur;
      });
}

/// Adds lengths(b) to counts(b) for every sequence b, on the device (one launch, "kvmem::advance", B
/// threads): the token counts of a memory whose step kernels read them (EvictionMemory, TrellisMemory).
template <class ExecSpace, class Counts, class Lengths>
void advance_counts(const ExecSpace& exec, const Counts& counts, const Lengths& lengths) {
  const long B = static_cast<long>(counts.extent(0));
  if (B == 0) return;
  Kokkos::parallel_for(
      "kvmem::advance", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B), KOKKOS_LAMBDA(long b) { counts(b) += lengths(b); });
}

}  // namespace kvmem::kernels
