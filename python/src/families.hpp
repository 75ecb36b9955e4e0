#pragma once
/// \file families.hpp
/// The memory families the Python module compiles, one source file each, and the plain-data arguments
/// their constructors take from Python.

#include <nanobind/nanobind.h>

#include <string>

namespace kvmem::python {

namespace nb = nanobind;

/// A budget schedule by name and its parameters (kvmem::budget; spec KVM.md §5.2, OVQ.md §3): `kind` is
/// fixed, power-law, saturating or plateau; each schedule reads its own fields (rows for min_rows and
/// round_down, tokens-like row counts for saturation_n and plateau_n).
struct BudgetArgs {
  std::string kind = "fixed";
  long min_rows = -1;
  double growth_factor = 1.0;
  double growth_exponent = 0.5;
  long round_down = 1;
  double saturation_n = 1024;
  double plateau_n = 1024;
};

/// KVM and OVQ (merge_memories.cpp).
void bind_merge_memories(nb::module_& m);
/// EvictionMemory with every scorer (eviction_memories.cpp).
void bind_eviction_memories(nb::module_& m);
/// TrellisMemory (trellis_memory.cpp).
void bind_trellis_memory(nb::module_& m);

}  // namespace kvmem::python
