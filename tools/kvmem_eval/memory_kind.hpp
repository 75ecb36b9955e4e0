#pragma once
/// \file memory_kind.hpp
/// What kvmem-eval compares: a `MemoryKind` (one row family of the table) turns the inputs, the sizing
/// options and a memory fraction f into a `Plan` (the memory's parameters and a function that runs it over
/// the inputs and writes y). The families live in kvm_kinds.hpp, ovq_kinds.hpp, trellis_kinds.hpp and
/// eviction_kinds.hpp; the registry that lists them in table order is memories.hpp.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../kvmem_run/kvm_command.hpp"

namespace kvmem::tools::eval {

using exec = Kokkos::DefaultExecutionSpace;
using mem_space = exec::memory_space;
/// A `kvmem-run kvm` input file on the device: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv],
/// gate [B, Hkv, T], the layer weights and lengths [B] (tokens).
using Inputs = KvmInputs<mem_space>;
/// y [B, Hq, T, Dv], float32: what a memory writes and exact attention is compared with.
using OutView = Kokkos::View<float****, Kokkos::LayoutRight, mem_space>;

/// Options shared by every memory's sizing rule (kvmem-eval flags).
struct SizingOptions {
  double window_share = 0.25;  ///< s: share of the token budget f*T given to the window (KVM, OVQ open chunk, eviction)
  int window_chunks = 1;       ///< n_b: chunks in the window (KVM); the chunk is window / n_b tokens
  int sinks = 1;               ///< S: protected sink rows (KVM; eviction rows keep 4, sizing.hpp)
  int rope_dims = 0;           ///< r: key channels zeroed before LN_s (0 for models without RoPE)
};

/// What one run of a memory left behind (the inputs' batch; rows and window per sequence).
struct RunStats {
  std::vector<long> rows;         ///< state rows (Trellis: slots) per sequence, the same for each head
  std::vector<long> window;       ///< tokens in the block sliding window (open chunk) per sequence
  long held_bytes = 0;            ///< the memory's own held_bytes() after the last token
  long peak_bytes = 0;            ///< the most it holds at any token (an upper bound where not exact)
  double seconds = 0;             ///< wall time of prefill (construction and input preparation excluded)
};

/// One memory configured for one budget.
struct Plan {
  nlohmann::json params;  ///< everything that sets the memory (for the JSON report)
  std::string summary;    ///< short parameter string for the terminal table
  std::function<RunStats(const Inputs&, const OutView&)> run;
};

/// A row kind of the table.
struct MemoryKind {
  std::string id;      ///< command-line name
  std::string label;   ///< name in tables and plots
  std::string sizing;  ///< how a fraction f of a T-token cache becomes the memory's parameters
  bool own_size = false;  ///< evaluated once, at the memory its fixed parameters give (fractions ignored)
  std::function<Plan(const Inputs&, const SizingOptions&, double fraction, const std::string& fraction_label)> plan;
};

/// Longest sequence of the inputs, tokens.
inline long longest(const Inputs& in) { return *std::max_element(in.lengths.begin(), in.lengths.end()); }

/// printf into a std::string (short strings: parameter summaries, table cells).
inline std::string fmt(const char* f, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

}  // namespace kvmem::tools::eval
