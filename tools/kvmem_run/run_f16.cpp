/// \file run_f16.cpp
/// kvmem-run's `ovq`, `trellis` and `evict` commands with float16 tokens (`kvm`: run_kvm_f16.cpp); see
/// commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMAND(, run_ovq, OvqOptions, float16)
KVMEM_RUN_COMMAND(, run_trellis, TrellisOptions, float16)
KVMEM_RUN_COMMAND(, run_evict, EvictOptions, float16)
}  // namespace kvmem::tools
