#pragma once
/// \file memories.hpp
/// The memories kvmem-eval compares, and the rule that sizes each one for a memory fraction.
///
/// Each memory is one `MemoryKind`: an id, a label, a one-line sizing rule, and a function that turns
/// (inputs, sizing options, fraction f) into a `Plan` (its configuration plus a function that runs it and
/// writes y). A new memory (OVQ, Trellis, an eviction policy, KVM + eviction) is one more entry in
/// memory_kinds(); the rest of the tool (metrics, table, JSON, plot) does not change.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <kvmem/kvmem.hpp>

#include "../kvmem_run/kvm_command.hpp"

namespace kvmem::tools::eval {

using exec = Kokkos::DefaultExecutionSpace;
using mem_space = exec::memory_space;
using Inputs = KvmInputs<mem_space>;
using OutView = Kokkos::View<float****, Kokkos::LayoutRight, mem_space>;

/// Options shared by every memory's sizing rule.
struct SizingOptions {
  double window_share = 0.25;  ///< share of the token budget f*T given to the block sliding window
  int window_chunks = 1;       ///< n_b: chunks in the window (KVM); the chunk is window / n_b tokens
  int sinks = 1;               ///< S: protected sink rows (KVM)
  int rope_dims = 0;           ///< r: key channels zeroed before LN_s (0 for models without RoPE)
};

/// What one run of a memory left behind (the inputs' batch; rows and window per sequence).
struct RunStats {
  std::vector<long> rows;         ///< state rows per sequence (the same for each kv-head)
  std::vector<long> window;       ///< tokens in the block sliding window per sequence
  long held_bytes = 0;            ///< the memory's own held_bytes() after the last token
  long peak_bytes = 0;            ///< the most it holds at any token (an upper bound where not exact)
  double seconds = 0;             ///< wall time of prefill (construction excluded)
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

/// Runs a KVM memory with budget `budget` over the inputs (prefill) and writes y.
template <class Budget>
RunStats run_kvm(const MemoryConfig& cfg, const Budget& budget, const Inputs& in, const OutView& y) {
  KvmMemory<exec, Budget> mem(cfg, budget, in.weights, static_cast<int>(in.B));
  Kokkos::fence();
  const auto start = std::chrono::steady_clock::now();
  mem.prefill(in.q, in.k, in.v, in.gate, y, in.lengths);
  Kokkos::fence();
  RunStats s;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (long b = 0; b < in.B; ++b) {
    s.rows.push_back(mem.cursor(b).rows);
    s.window.push_back(mem.window_tokens(b));
  }
  s.held_bytes = mem.held_bytes();
  // Rows only grow, and the window holds at most min(n, L) tokens, so rows + min(n, L) bounds what is held
  // at any token; it is exact when the last token ends a chunk (then the window holds L tokens).
  long units = 0;
  for (long b = 0; b < in.B; ++b) units += s.rows[b] + std::min(in.lengths[b], cfg.window());
  s.peak_bytes = units * in.Hkv * (in.D + in.Dv + 1) * static_cast<long>(sizeof(float));
  s.peak_bytes = std::max(s.peak_bytes, s.held_bytes);
  return s;
}

/// KVM sizing for a token budget M = f * T (T: longest sequence):
///   window L = n_b * C with chunk C = max(1, round(window_share * M / n_b)),
///   state rows R = max(min(T, C), round(M) - L)   (the first chunk always becomes C rows).
struct KvmSizing {
  MemoryConfig cfg;
  long rows = 0;  ///< R: state rows at the end of the longest sequence
};

inline KvmSizing kvm_sizing(const Inputs& in, const SizingOptions& o, double fraction, const std::string& label,
                            const std::string& memory) {
  const long T = longest(in);
  const double M = fraction * static_cast<double>(T);
  KvmSizing s;
  auto& c = s.cfg;
  c.head_dim = static_cast<int>(in.D);
  c.value_dim = static_cast<int>(in.Dv);
  c.query_heads = static_cast<int>(in.Hq);
  c.kv_heads = static_cast<int>(in.Hkv);
  c.window_chunks = o.window_chunks;
  c.chunk = static_cast<int>(std::max(1.0, std::round(o.window_share * M / o.window_chunks)));
  c.rope_dims = o.rope_dims;
  c.sinks = o.sinks;
  const long L = c.window();
  s.rows = std::max(std::min(T, static_cast<long>(c.chunk)), static_cast<long>(std::llround(M)) - L);
  c.max_rows = s.rows + c.chunk;  // the row cap never binds
  if (T > L + c.chunk)
    require(o.sinks < c.chunk, "--fractions = " + label, fraction,
            "too small for " + memory + ": a budget of " + std::to_string(M) + " tokens of a " + std::to_string(T) +
                "-token sequence gives chunk " + std::to_string(c.chunk) + ", which must exceed --sinks = " +
                std::to_string(o.sinks) + " (use a larger fraction, a larger --window-share or fewer --sinks)");
  return s;
}

inline nlohmann::json config_json(const MemoryConfig& c) {
  return {{"chunk", c.chunk}, {"window_chunks", c.window_chunks}, {"window", c.window()}, {"sinks", c.sinks},
          {"rope_dims", c.rope_dims}, {"max_rows", c.max_rows}};
}

/// The smallest growth factor a of a * sqrt(ctx) whose prefill of T tokens ends with `rows` state rows
/// (or as many as the schedule can reach); bisection on state::final_rows, which is monotone in a.
inline double growth_factor_for(const MemoryConfig& cfg, long T, long rows) {
  auto final_rows = [&](double a) { return state::final_rows(cfg, budget::PowerLaw{-1, a, 0.5, 1}, T); };
  double hi = static_cast<double>(std::max(rows, 1L)) + 1.0;  // a >= rows gives B(ctx) >= rows for ctx >= 1
  const long reachable = final_rows(hi);
  const long want = std::min(rows, reachable);
  if (final_rows(0.0) >= want) return 0.0;
  double lo = 0.0;
  for (int i = 0; i < 100 && hi - lo > 1e-9 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (final_rows(mid) >= want ? hi : lo) = mid;
  }
  // Rounded up to 4 decimals: a printable value, and a * sqrt(ctx) no longer sits on an integer, so the
  // floor in the schedule cannot flip with the last bit of another implementation.
  const double nice = std::ceil(hi * 1e4) / 1e4;
  return final_rows(nice) == final_rows(hi) ? nice : hi;
}

inline std::string fmt(const char* f, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

/// Every memory kvmem-eval knows, in table order. OVQ, Trellis, StreamingLLM, H2O, TOVA, KNorm and
/// KVM + eviction are added here as they land in include/kvmem.
inline std::vector<MemoryKind> memory_kinds() {
  std::vector<MemoryKind> kinds;
  kinds.push_back(
      {"kvm-fixed", "KVM fixed",
       "C = round(s*f*T/n_b), window n_b*C, budget::Fixed rows R = f*T - n_b*C (at least C): the state fills to R "
       "rows, then every overflow block merges",
       false, [](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
         const auto s = kvm_sizing(in, o, f, label, "kvm-fixed");
         const budget::Fixed b{s.rows};
         Plan p;
         p.params = {{"config", config_json(s.cfg)}, {"budget", {{"kind", "fixed"}, {"min_rows", b.min_rows}}}};
         p.summary = fmt("C=%d L=%dx%d R=%ld", s.cfg.chunk, s.cfg.window_chunks, s.cfg.chunk, s.rows);
         p.run = [cfg = s.cfg, b](const Inputs& i, const OutView& y) { return run_kvm(cfg, b, i, y); };
         return p;
       }});
  kinds.push_back(
      {"kvm-sqrt", "KVM a*sqrt(N)",
       "C and window as kvm-fixed; budget::PowerLaw a*sqrt(ctx) with a chosen so that the rows reach R = f*T - n_b*C "
       "at the last token (a = 16 is the paper's 16*sqrt(N)); rows grow from C",
       false, [](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
         const auto s = kvm_sizing(in, o, f, label, "kvm-sqrt");
         const double a = growth_factor_for(s.cfg, longest(in), s.rows);
         const budget::PowerLaw b{-1, a, 0.5, 1};
         Plan p;
         p.params = {{"config", config_json(s.cfg)},
                     {"budget", {{"kind", "power-law"}, {"min_rows", -1}, {"growth_factor", a},
                                 {"growth_exponent", 0.5}, {"round_down", 1}, {"target_rows", s.rows}}}};
         p.summary = fmt("C=%d L=%dx%d a=%.2f", s.cfg.chunk, s.cfg.window_chunks, s.cfg.chunk, a);
         p.run = [cfg = s.cfg, b](const Inputs& i, const OutView& y) { return run_kvm(cfg, b, i, y); };
         return p;
       }});
  kinds.push_back(
      {"kvm-16sqrt", "KVM 16*sqrt(N), C=256",
       "the paper's setting as scripts/setup runs it: C = 256, window 2 x 256, budget::PowerLaw 16*sqrt(ctx) "
       "(min 256 rows); one point at the memory that gives",
       true, [](const Inputs& in, const SizingOptions& o, double, const std::string&) {
         MemoryConfig c;
         c.head_dim = static_cast<int>(in.D);
         c.value_dim = static_cast<int>(in.Dv);
         c.query_heads = static_cast<int>(in.Hq);
         c.kv_heads = static_cast<int>(in.Hkv);
         c.chunk = 256;
         c.window_chunks = 2;
         c.rope_dims = o.rope_dims;
         c.sinks = o.sinks;
         c.max_rows = 256L * 10000;  // --max-chunks 10000
         const budget::PowerLaw b{256, 16.0, 0.5, 1};
         Plan p;
         p.params = {{"config", config_json(c)},
                     {"budget", {{"kind", "power-law"}, {"min_rows", 256}, {"growth_factor", 16.0},
                                 {"growth_exponent", 0.5}, {"round_down", 1}}}};
         p.summary = "C=256 L=2x256 a=16";
         p.run = [c, b](const Inputs& i, const OutView& y) { return run_kvm(c, b, i, y); };
         return p;
       }});
  return kinds;
}

}  // namespace kvmem::tools::eval
