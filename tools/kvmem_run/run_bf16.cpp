/// \file run_bf16.cpp
/// kvmem-run's commands with bfloat16 tokens (the BF16 runs); see commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMANDS(, bfloat16)
}  // namespace kvmem::tools
