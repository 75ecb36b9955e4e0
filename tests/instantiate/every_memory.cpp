/// \file every_memory.cpp
/// Instantiates every memory facade with every merge policy, budget schedule and scorer that kvmem ships,
/// on Kokkos' default execution space (Kokkos::Cuda in a Cuda build, OpenMP or Serial on a CPU), so that
/// each member function of each composition is compiled for that space: explicit instantiation compiles
/// every member, also those that no example, tool or test calls. scripts/cuda-check builds it with nvcc.
/// This file: KVM, proportional merge and eviction; every_memory_ovq.cpp: OVQ and Trellis.

#include <kvmem/kvmem.hpp>

namespace kvmem {

using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;

// KVM and proportional merges under every budget schedule (spec KVM.md §5.2); OVQ's and Trellis' are in
// every_memory_ovq.cpp, a second file so that a build compiles the two halves on two cores.
template class Memory<exec, merge::WinnerTakeAll, budget::Fixed, score::Novelty>;
template class Memory<exec, merge::WinnerTakeAll, budget::PowerLaw, score::Novelty>;
template class Memory<exec, merge::WinnerTakeAll, budget::Saturating, score::Novelty>;
template class Memory<exec, merge::WinnerTakeAll, budget::Plateau, score::Novelty>;
template class Memory<exec, merge::WinnerTakeAll, budget::Linear, score::Novelty>;
template class Memory<exec, merge::Proportional, budget::Fixed, score::Novelty>;
template class Memory<exec, merge::Proportional, budget::PowerLaw, score::Novelty>;
template class Memory<exec, merge::Proportional, budget::Fixed, score::Novelty, score::KeepRows, bfloat16>;
// Merging memories whose state rows are also evicted (H2O over rows).
template class Memory<exec, merge::WinnerTakeAll, budget::PowerLaw, score::Novelty, score::RowAccumulatedAttention>;

// Fixed-budget eviction with every scorer (spec EVICTION.md).
template class EvictionMemory<exec, score::None>;
template class EvictionMemory<exec, score::KeyNorm>;
template class EvictionMemory<exec, score::AccumulatedAttention>;
template class EvictionMemory<exec, score::LastQueryAttention>;
template class EvictionMemory<exec, score::MLstm<mem>>;
template class EvictionMemory<exec, score::ObservationWindow, bfloat16>;  // SnapKV, compressing at a prompt's end

// Every family keeps the one contract an engine drives (memory_concept.hpp).
static_assert(AttentionMemory<Memory<exec, merge::WinnerTakeAll, budget::Fixed, score::Novelty>>);
static_assert(AttentionMemory<Memory<exec, merge::Proportional, budget::Fixed, score::Novelty, score::KeepRows, bfloat16>>);
static_assert(AttentionMemory<Memory<exec, merge::WinnerTakeAll, budget::PowerLaw, score::Novelty, score::RowAccumulatedAttention>>);
static_assert(AttentionMemory<EvictionMemory<exec, score::AccumulatedAttention>>);
static_assert(AttentionMemory<EvictionMemory<exec, score::MLstm<mem>, float16>>);

}  // namespace kvmem
