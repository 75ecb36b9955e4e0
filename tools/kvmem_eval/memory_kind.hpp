#pragma once
/// \file memory_kind.hpp
/// What kvmem-eval compares: a `MemoryKind` (one row family of the table) turns the inputs, the sizing
/// options and a memory fraction f into a `Plan` (the memory's parameters and a function that runs it over
/// the inputs and writes y). The families live in kvm_kinds.hpp, ovq_kinds.hpp, trellis_kinds.hpp and
/// eviction_kinds.hpp, each a template over the run's storage type (--dtype: float, kvmem::bfloat16 or
/// kvmem::float16); the registry that lists them in table order is memory_table.hpp (memories.hpp declares it).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <kvmem/dtype.hpp>

#include <nlohmann/json.hpp>

#include "../kvmem_run/kvm_command.hpp"

namespace kvmem::tools::eval {

using exec = Kokkos::DefaultExecutionSpace;
using mem_space = exec::memory_space;
/// A `kvmem-run kvm` input file on the device: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv],
/// gate [B, Hkv, T], the layer weights and lengths [B] (tokens).
using Inputs = KvmInputs<mem_space>;
/// The same input file with its tokens (q, k, v, gate) in storage type T; layer weights float32.
template <StorageType T>
using InputsOf = KvmInputs<mem_space, T>;
/// y [B, Hq, T, Dv], float32: what a memory writes (widened from its storage type) and exact attention is
/// compared with.
using OutView = Kokkos::View<float****, Kokkos::LayoutRight, mem_space>;

/// The inputs of one evaluation: the tokens widened to float32 (`f32`: sizing and exact attention, the
/// ground truth) and, when the memories run in a 16-bit storage type (--dtype, or a BF16/F16 input file),
/// the tokens as read in that type (`bf16` or `f16`: what the memories see). Only the run's type is filled.
struct StoredInputs {
  Inputs f32;
  InputsOf<bfloat16> bf16;
  InputsOf<float16> f16;
  /// --prompt: the first `prompt` tokens of each sequence are one prefill, the others decode steps (-1: the
  /// whole sequence in one prefill); every family runs its memory so (timed_prefill).
  long prompt = -1;

  /// The tokens in storage type T.
  template <StorageType T>
  [[nodiscard]] const InputsOf<T>& as() const {
    if constexpr (std::is_same_v<T, bfloat16>) return bf16;
    else if constexpr (std::is_same_v<T, float16>) return f16;
    else return f32;
  }
};

/// y [B, Hq, T, Dv] in storage type T, as a memory of that type writes it.
template <StorageType T>
using OutOf = Kokkos::View<T****, Kokkos::LayoutRight, mem_space>;

/// y = x widened to float32, element by element (exact).
template <StorageType T>
void widen_into(const OutOf<T>& x, const OutView& y) {
  Kokkos::parallel_for("kvmem_eval::widen", Kokkos::RangePolicy<exec>(0, x.span()),
                       KOKKOS_LAMBDA(std::size_t i) { y.data()[i] = to_float(x.data()[i]); });
}

/// Runs body(tokens, y_T) with the inputs' tokens in storage type T and a y of that type, then widens y_T
/// into y (float32: body writes y itself). Returns what body returns.
template <StorageType T, class Body>
auto run_stored(const StoredInputs& in, const OutView& y, Body&& body) {
  if constexpr (std::is_same_v<T, float>) {
    return body(in.f32, y);
  } else {
    OutOf<T> yt("y_stored", y.extent(0), y.extent(1), y.extent(2), y.extent(3));
    auto stats = body(in.as<T>(), yt);
    widen_into<T>(yt, y);
    Kokkos::fence();
    return stats;
  }
}

/// Options shared by every memory's sizing rule (kvmem-eval flags).
struct SizingOptions {
  double window_share = 0.25;  ///< s: share of the token budget f*T given to the window (KVM, OVQ open chunk, eviction)
  int window_chunks = 1;       ///< n_b: chunks in the window (KVM); the chunk is window / n_b tokens
  int sinks = 1;               ///< S: protected sink rows (KVM; eviction rows keep 4, sizing.hpp)
  int rope_dims = 0;           ///< r: key channels zeroed before LN_s (0 for models without RoPE)
  long prompt = -1;            ///< P (--prompt): tokens in one prefill, the rest decode steps (-1: every token)
};

/// What one run of a memory left behind (the inputs' batch; rows and window per sequence).
struct RunStats {
  std::vector<long> rows;         ///< state rows (Trellis: slots) per sequence, the same for each head
  std::vector<long> window;       ///< tokens in the block sliding window (open chunk) per sequence
  long held_bytes = 0;            ///< the memory's own held_bytes() after the last token
  long peak_bytes = 0;            ///< the most it holds at any token (an upper bound where not exact)
  double seconds = 0;             ///< wall time of prefill (construction and input preparation excluded)
};

/// One memory configured for one budget, in the run's storage type.
struct Plan {
  nlohmann::json params;  ///< everything that sets the memory (for the JSON report)
  std::string summary;    ///< short parameter string for the terminal table
  std::function<RunStats(const StoredInputs&, const OutView&)> run;  ///< writes y widened to float32
};

/// A row kind of the table.
struct MemoryKind {
  std::string id;      ///< command-line name
  std::string label;   ///< name in tables and plots
  std::string sizing;  ///< how a fraction f of a T-token cache becomes the memory's parameters
  bool own_size = false;  ///< evaluated once, at the memory its fixed parameters give (fractions ignored)
  /// The plan for the float32 inputs (their shape and lengths size it), a fraction and its label.
  std::function<Plan(const Inputs&, const SizingOptions&, double fraction, const std::string& fraction_label)> plan;
  /// Compresses at the end of a prompt or per chunk of it (EvictionConfig::chunk != 1): runs only with
  /// --prompt (over one prefill its output is exact attention) and is not in the default --memories.
  bool after_prompt = false;
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
