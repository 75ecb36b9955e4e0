#pragma once
/// \file scratch.hpp
/// Team scratch: where a kernel's per-team working set goes.

#include <Kokkos_Core.hpp>
#include <cstddef>

namespace kvmem::kernels {

/// The scratch level for a team that needs `bytes`: level 0 (a GPU's shared memory, a CPU thread's
/// cache-resident scratch) when the policy allows that much there, else level 1 (larger, slower on a GPU).
template <class Policy>
int scratch_level(const Policy& policy, std::size_t bytes) {
  return bytes <= static_cast<std::size_t>(policy.scratch_size_max(0)) ? 0 : 1;
}

/// A team policy over `league` teams whose teams each get `floats` floats of scratch (at scratch_level);
/// `level` receives the level for team_scratch().
template <class Policy>
Policy with_float_scratch(Policy policy, long floats, int& level) {
  using scratch_t = Kokkos::View<float*, typename Policy::execution_space::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  const std::size_t bytes = scratch_t::shmem_size(floats);
  level = scratch_level(policy, bytes);
  return policy.set_scratch_size(level, Kokkos::PerTeam(bytes));
}

}  // namespace kvmem::kernels
