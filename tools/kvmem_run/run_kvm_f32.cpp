/// \file run_kvm_f32.cpp
/// `kvmem-run kvm` with float tokens (the F32 runs), in the library kvmem_run_kvm; see commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMAND(, run_kvm, KvmOptions, float)
}  // namespace kvmem::tools
