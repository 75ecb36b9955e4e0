/// \file run_kvm_f16.cpp
/// `kvmem-run kvm` with float16 tokens (the F16 runs), in the library kvmem_run_kvm; see commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMAND(, run_kvm, KvmOptions, float16)
}  // namespace kvmem::tools
