/// \file kinds_f32.cpp
/// kvmem-eval's memories with float32 tokens (--dtype f32); see memories.hpp.

#include "memory_table.hpp"

namespace kvmem::tools::eval {
template std::vector<MemoryKind> memory_kinds<float>();
}  // namespace kvmem::tools::eval
