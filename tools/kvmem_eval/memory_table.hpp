#pragma once
/// \file memory_table.hpp
/// The definition of memory_kinds<T>() (memories.hpp): the row families in table order. Included only by
/// the translation units that instantiate it for one storage type (kinds_f32.cpp, kinds_bf16.cpp,
/// kinds_f16.cpp).

#include <utility>
#include <vector>

#include "eviction_kinds.hpp"
#include "kvm_kinds.hpp"
#include "memories.hpp"
#include "ovq_kinds.hpp"
#include "trellis_kinds.hpp"

namespace kvmem::tools::eval {

template <StorageType T>
std::vector<MemoryKind> memory_kinds() {
  std::vector<MemoryKind> kinds;
  for (auto family : {kvm_kinds<T>, ovq_kinds<T>, trellis_kinds<T>, eviction_kinds<T>})
    for (auto& k : family()) kinds.push_back(std::move(k));
  return kinds;
}

}  // namespace kvmem::tools::eval
