// Must NOT compile: a merge policy without `name`. The test checks that the compiler's message names the
// missing requirement (kvmem::merge::MergePolicy's `M::name`).
#include <kvmem/kvmem.hpp>

struct Nameless : kvmem::merge::Defaults {};

using Broken = kvmem::Memory<Kokkos::DefaultHostExecutionSpace, Nameless, kvmem::budget::Fixed, kvmem::score::Novelty>;
Broken* instantiate = nullptr;
