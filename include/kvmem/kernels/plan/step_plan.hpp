#pragma once
/// \file step_plan.hpp
/// The per-sequence work of one kernel step, written on the host and read by the kernels.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <utility>

namespace kvmem::kernels {

/// Fields of one row of a StepPlan (all in tokens, rows or flags; -1 never used).
enum PlanField : int {
  input_offset = 0,   ///< position of input token index 0 (0 in prefill, n in decode)
  write_begin,        ///< positions [write_begin, write_end) are copied into the window ring
  write_end,
  query_begin,        ///< positions [query_begin, query_end) are read out
  query_end,
  window_begin_pos,   ///< first window position the queries see (block sliding window start)
  read_rows,          ///< state rows the queries see (0 = the state is not read)
  block_begin,        ///< first token of the block folded into the state
  block_count,        ///< tokens of that block (0 = no state change this step)
  rows_before,        ///< state rows before the block is folded in
  append_count,       ///< tokens of the block that become new rows; the rest merge
  rows_evicted,       ///< state rows evicted after the fold (row eviction, score::RowEviction)
  plan_fields
};

/// Plan of one step for a batch: `device` [B, plan_fields] and its host mirror `host`.
template <class MemorySpace>
struct StepPlan {
  Kokkos::View<long**, Kokkos::LayoutRight, MemorySpace> device;
  decltype(Kokkos::create_mirror_view(std::declval<Kokkos::View<long**, Kokkos::LayoutRight, MemorySpace>>())) host;

  void allocate(int batch) {
    device = decltype(device)("kvmem::step_plan", batch, plan_fields);
    host = Kokkos::create_mirror_view(device);
  }
  /// Zeroes every field of the host mirror (no work for any sequence).
  void clear() { std::fill_n(host.data(), host.span(), 0L); }  // host memory; no Kokkos call (it allocates labels)
  /// Sends the host mirror to the device.
  template <class ExecSpace>
  void upload(const ExecSpace& exec) const { Kokkos::deep_copy(exec, device, host); }
};

}  // namespace kvmem::kernels
