#pragma once
/// \file team_size.hpp
/// Threads per team of the kernels that give one team a whole (sequence, head) and split its passes over
/// the team's threads with team barriers between them (the KVM/OVQ update, the Trellis chunks). On Cuda the
/// update takes whole blocks of backend::cuda::rank_team threads instead, for CUB's block sort of its ranks
/// (kernels/common/team_select.hpp).

#include <Kokkos_Core.hpp>

namespace kvmem::kernels {

/// Whether ExecSpace runs on CPU threads (it can read host memory: Serial, OpenMP, Threads), as opposed
/// to a GPU's.
template <class ExecSpace>
inline constexpr bool runs_on_host = Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;

/// Threads per team when one team runs each of `heads` (sequence, head) pairs (heads = B x H) and a pass
/// spreads up to `items` work items (tokens, rows, state elements) over its threads: on CPU threads the
/// threads per pair, so that fewer pairs than threads still keep every thread busy and a batch of many
/// pairs runs one thread per team (no barrier waits); on GPUs a warp multiple that covers `items`, from
/// 32 to 256. At most `most` (the policy's team_size_max for the kernel; >= 1).
template <class ExecSpace>
int head_team_size(const ExecSpace& exec, long heads, long items, int most) {
  long size = 0;
  if constexpr (runs_on_host<ExecSpace>) {
    const long threads = exec.concurrency();
    size = threads / Kokkos::max(1L, heads);
  } else {
    size = Kokkos::min(256L, Kokkos::max(32L, (items + 31) / 32 * 32));
  }
  return static_cast<int>(Kokkos::max(1L, Kokkos::min(size, static_cast<long>(most))));
}

}  // namespace kvmem::kernels
