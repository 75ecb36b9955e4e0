/// \file run_f16.cpp
/// kvmem-run's commands with float16 tokens (the F16 runs); see commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMANDS(, float16)
}  // namespace kvmem::tools
