/// \file every_memory_ovq.cpp
/// The second half of every_memory.cpp (see there): OVQ's merge under every budget schedule, with and
/// without row eviction, and the Trellis slot memory, explicitly instantiated on Kokkos' default execution
/// space so that each member function is compiled for it.

#include <kvmem/kvmem.hpp>

namespace kvmem {

using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;

// OVQ merges under every budget schedule (spec OVQ.md §3), and with H2O over rows.
template class Memory<exec, merge::KMeansCount, budget::Fixed, score::Novelty>;
template class Memory<exec, merge::KMeansCount, budget::PowerLaw, score::Novelty>;
template class Memory<exec, merge::KMeansCount, budget::Saturating, score::Novelty>;
template class Memory<exec, merge::KMeansCount, budget::Plateau, score::Novelty>;
template class Memory<exec, merge::KMeansCount, budget::Linear, score::Novelty>;
template class Memory<exec, merge::KMeansCount, budget::Plateau, score::Novelty, score::RowAccumulatedAttention>;

// Trellis slot memory (spec TRELLIS.md).
template class TrellisMemory<exec>;

// The one contract an engine drives (memory_concept.hpp).
static_assert(AttentionMemory<Memory<exec, merge::KMeansCount, budget::Plateau, score::Novelty>>);
static_assert(AttentionMemory<TrellisMemory<exec>>);
static_assert(AttentionMemory<TrellisMemory<exec, bfloat16>>);

}  // namespace kvmem
