#pragma once
/// \file step_launch.hpp
/// How the kernels of a decode step are launched, so that a CUDA graph can capture them (docs/cuda.md, "A
/// decode step: plan once, run many").

#include <Kokkos_Core.hpp>

#include <type_traits>

namespace kvmem::kernels {

/// The launch property of the kernels of a decode step (Kokkos' work-item hint): on Cuda the functor goes
/// to the kernel as its argument (Kokkos' "local memory" launch, for functors under 4 KiB) rather than
/// through constant memory, whose launch waits on an event and copies the functor from a staging buffer
/// that a captured CUDA graph would replay stale. A functor of 4 KiB or more would still go through global
/// memory with a copy from the host, which a graph cannot replay either. Host backends ignore the hint.
using step_launch = Kokkos::Experimental::WorkItemProperty::HintLightWeight_t;

/// Whether a decode step's kernel (functor `Functor` under `Policy`) goes to the kernel as its argument on
/// Cuda, as step_launch asks: Kokkos' local-memory launch takes a driver (the functor and the policy) under
/// Kokkos::Impl::CudaTraits::KernelArgumentLimit (4 KiB). A larger one goes through global memory, copied
/// from an object on the host's stack that a captured CUDA graph replays from a dead address (seen on an
/// H200: the update kernel's driver of 6,312 bytes, 2026-11-29). `kvmem::update`, the one step kernel whose
/// functor captures many views, static_asserts it; a probe of every global-memory launch in the decode
/// tests' translation units found no other. True on other backends.
template <class Policy, class Functor>
consteval bool launches_as_argument() {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<typename Policy::execution_space, Kokkos::Cuda>)
    return sizeof(Kokkos::Impl::ParallelFor<Functor, Policy, Kokkos::Cuda>) <
           Kokkos::Impl::CudaTraits::KernelArgumentLimit;
#endif
  return true;
}

/// Gives Kokkos' team-scratch pool of `exec` some memory: one team kernel with 256 bytes of level-1 scratch,
/// then a fence. On Cuda, while an instance's pool is empty, every team launch asks the driver for a
/// zero-byte pool (cudaMalloc), which a CUDA graph capture in cudaStreamCaptureModeGlobal refuses; with a
/// pool of any size a launch that needs no level-1 scratch allocates nothing. Call it once on the instance
/// before capturing decode_async (docs/cuda.md, "Capturing a decode step in a CUDA graph"). On host
/// backends it is one empty launch.
template <class ExecSpace>
void warm_team_scratch(const ExecSpace& exec) {
  using policy_t = Kokkos::TeamPolicy<ExecSpace, step_launch>;
  const auto policy = policy_t(exec, 1, 1).set_scratch_size(1, Kokkos::PerTeam(256));
  Kokkos::parallel_for("kvmem::warm_scratch", policy, KOKKOS_LAMBDA(const typename policy_t::member_type&){});
  exec.fence("kvmem::warm_team_scratch");
}

}  // namespace kvmem::kernels
