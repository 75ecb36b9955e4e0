#pragma once
/// \file step_launch.hpp
/// How the kernels of a decode step are launched, so that a CUDA graph can capture them.

#include <Kokkos_Core.hpp>

namespace kvmem::kernels {

/// The launch property of the kernels of a decode step (Kokkos' work-item hint): on Cuda the functor goes
/// to the kernel as its argument (Kokkos' "local memory" launch, for functors under 4 KiB) rather than
/// through constant memory, whose launch waits on an event and copies the functor from a staging buffer
/// that a captured CUDA graph would replay stale (docs/cuda.md, "A decode step"). Host backends ignore it.
using step_launch = Kokkos::Experimental::WorkItemProperty::HintLightWeight_t;

}  // namespace kvmem::kernels
