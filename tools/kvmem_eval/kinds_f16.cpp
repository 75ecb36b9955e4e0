/// \file kinds_f16.cpp
/// kvmem-eval's memories with float16 tokens (--dtype f16); see memories.hpp.

#include "memory_table.hpp"

namespace kvmem::tools::eval {
template std::vector<MemoryKind> memory_kinds<float16>();
}  // namespace kvmem::tools::eval
