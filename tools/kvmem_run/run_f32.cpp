/// \file run_f32.cpp
/// kvmem-run's commands with float tokens (the F32 runs); see commands.hpp.

#include "commands.hpp"

namespace kvmem::tools {
KVMEM_RUN_COMMANDS(, float)
}  // namespace kvmem::tools
