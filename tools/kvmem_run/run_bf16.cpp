/// \file run_bf16.cpp
/// kvmem-run's `ovq`, `trellis` and `evict` commands with bfloat16 tokens (`kvm`: run_kvm_bf16.cpp); see
/// commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMAND(, run_ovq, OvqOptions, bfloat16)
KVMEM_RUN_COMMAND(, run_trellis, TrellisOptions, bfloat16)
KVMEM_RUN_COMMAND(, run_evict, EvictOptions, bfloat16)
}  // namespace kvmem::tools
