/// \file kinds_bf16.cpp
/// kvmem-eval's memories with bfloat16 tokens (--dtype bf16); see memories.hpp.

#include "memory_table.hpp"

namespace kvmem::tools::eval {
template std::vector<MemoryKind> memory_kinds<bfloat16>();
}  // namespace kvmem::tools::eval
