#pragma once
/// \file team_size.hpp
/// Threads per team of the kernels that give one team a whole (sequence, head) and split its passes over
/// the team's threads with team barriers between them (the KVM/OVQ update, the Trellis chunks).

#include <Kokkos_Core.hpp>

namespace kvmem::kernels {

/// Threads per team when one team runs each of `heads` (sequence, head) pairs (heads = B x H) and a pass
/// spreads up to `items` work items (tokens, rows) over its threads: on CPU threads (execution spaces
/// whose memory the host reads) the threads per pair, so that fewer pairs than threads still keep every
/// thread busy and a batch of many pairs runs one thread per team (no barrier waits); on GPUs a warp
/// multiple that covers `items`, from 32 to 256.
template <class ExecSpace>
int head_team_size(const ExecSpace& exec, long heads, long items) {
  if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible) {
    const long threads = exec.concurrency();
    return static_cast<int>(Kokkos::max(1L, Kokkos::min(threads, threads / Kokkos::max(1L, heads))));
  } else {
    return static_cast<int>(Kokkos::min(256L, Kokkos::max(32L, (items + 31) / 32 * 32)));
  }
}

}  // namespace kvmem::kernels
