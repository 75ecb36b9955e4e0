#pragma once
/// \file memories.hpp
/// Every memory kvmem-eval compares, in table order: the registry of the row families.
///
/// A family is a header with a function returning its `MemoryKind`s (memory_kind.hpp): an id, a label, a
/// one-line sizing rule, and a function that turns (inputs, sizing options, fraction f) into a `Plan`.
/// Adding a family (StreamingLLM, H2O, TOVA, KNorm, KVM + eviction) is one header beside these, sized with
/// sizing.hpp and run with run_composed.hpp where it is a kvmem::Memory, and one line below; the tool
/// (metrics, table, JSON, plot, docs/fidelity.md) picks it up without other changes.

#include <string>
#include <utility>
#include <vector>

#include "eviction_kinds.hpp"
#include "kvm_kinds.hpp"
#include "memory_kind.hpp"
#include "ovq_kinds.hpp"
#include "trellis_kinds.hpp"

namespace kvmem::tools::eval {

/// Every memory kind, in table order.
inline std::vector<MemoryKind> memory_kinds() {
  std::vector<MemoryKind> kinds;
  for (auto family : {kvm_kinds, ovq_kinds, trellis_kinds, eviction_kinds})
    for (auto& k : family()) kinds.push_back(std::move(k));
  return kinds;
}

/// The ids of memory_kinds(), in order (kvmem-eval's default --memories).
inline std::vector<std::string> memory_ids() {
  std::vector<std::string> ids;
  for (const auto& k : memory_kinds()) ids.push_back(k.id);
  return ids;
}

}  // namespace kvmem::tools::eval
