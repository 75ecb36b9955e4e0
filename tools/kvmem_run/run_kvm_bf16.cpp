/// \file run_kvm_bf16.cpp
/// `kvmem-run kvm` with bfloat16 tokens (the BF16 runs), in the library kvmem_run_kvm; see commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMAND(, run_kvm, KvmOptions, bfloat16)
}  // namespace kvmem::tools
