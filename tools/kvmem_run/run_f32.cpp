/// \file run_f32.cpp
/// kvmem-run's `ovq`, `trellis` and `evict` commands with float tokens (`kvm`: run_kvm_f32.cpp); see
/// commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMAND(, run_ovq, OvqOptions, float)
KVMEM_RUN_COMMAND(, run_trellis, TrellisOptions, float)
KVMEM_RUN_COMMAND(, run_evict, EvictOptions, float)
}  // namespace kvmem::tools
