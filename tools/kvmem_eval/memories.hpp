#pragma once
/// \file memories.hpp
/// Every memory kvmem-eval compares, in table order: the registry of the row families, declared here and
/// defined in memory_table.hpp.
///
/// A family is a header with a function template returning its `MemoryKind`s of storage type T
/// (memory_kind.hpp): an id, a label, a one-line sizing rule, and a function that turns (inputs, sizing
/// options, fraction f) into a `Plan`. Adding a family (StreamingLLM, H2O, TOVA, KNorm, KVM + eviction) is one
/// header beside these, sized with sizing.hpp and run with run_composed.hpp where it is a kvmem::Memory, and
/// one line in memory_table.hpp; the tool (metrics, table, JSON, plot, docs/fidelity.md) picks it up without
/// other changes.

#include <string>
#include <vector>

#include <kvmem/dtype.hpp>

#include "memory_kind.hpp"

namespace kvmem::tools::eval {

/// Every memory kind whose plans run in storage type T (float, kvmem::bfloat16 or kvmem::float16), in
/// table order. Instantiated once per storage type, each in its own translation unit (kinds_f32.cpp,
/// kinds_bf16.cpp, kinds_f16.cpp), so that the three compile in parallel and main.cpp compiles none.
template <StorageType T>
std::vector<MemoryKind> memory_kinds();

/// The ids of memory_kinds(), in order (the same for every storage type); `after_prompt`: also the kinds that
/// compress at the end of a prompt or per chunk (MemoryKind::after_prompt), which kvmem-eval's default
/// --memories leaves out.
inline std::vector<std::string> memory_ids(bool after_prompt = false) {
  std::vector<std::string> ids;
  for (const auto& k : memory_kinds<float>())
    if (after_prompt || !k.after_prompt) ids.push_back(k.id);
  return ids;
}

}  // namespace kvmem::tools::eval
