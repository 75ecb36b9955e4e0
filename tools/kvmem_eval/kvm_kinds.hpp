#pragma once
/// \file kvm_kinds.hpp
/// The KVM rows of kvmem-eval (kvm-paper; spec KVM.md): `kvm-fixed` and `kvm-sqrt` sized for each memory
/// fraction, and `kvm-16sqrt`, the paper's setting at its own size; and `proportional`, the training-free
/// merge::Proportional sized as kvm-fixed.

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "memory_kind.hpp"
#include "run_composed.hpp"
#include "sizing.hpp"

namespace kvmem::tools::eval {

/// Builds a memory of storage type T merging by `Merge` (KVM's merge::WinnerTakeAll by default) with
/// `budget` for the inputs (their ln_weight, ln_bias, tau_state, tau_bswa) and runs it.
template <StorageType T, class Budget, class Merge = merge::WinnerTakeAll>
RunStats run_kvm(const MemoryConfig& cfg, const Budget& budget, const StoredInputs& in, const OutView& y) {
  return run_stored<T>(in, y, [&](const InputsOf<T>& i, const auto& yt) {
    Memory<exec, Merge, Budget, score::Novelty, score::KeepRows, T> mem(cfg, budget, i.weights, static_cast<int>(i.B));
    return run_composed(mem, i, yt, in.prompt);
  });
}

/// A plan that runs a memory of storage type T merging by `Merge` with `cfg` and `budget`; `budget_json`
/// describes the schedule in the report.
template <StorageType T, class Budget, class Merge = merge::WinnerTakeAll>
Plan kvm_plan(const MemoryConfig& cfg, const Budget& budget, nlohmann::json budget_json, std::string summary) {
  return {{{"config", config_json(cfg)}, {"budget", std::move(budget_json)}, {"merge", std::string(Merge::name)}},
          std::move(summary),
          [cfg, budget](const StoredInputs& i, const OutView& y) { return run_kvm<T, Budget, Merge>(cfg, budget, i, y); }};
}

/// KVM sizing for a fraction f: split_budget with n_b = --window-chunks and the first chunk as rows
/// (C = round(s*f*T/n_b), L = n_b*C, R = max(min(T, C), round(f*T) - L)); sinks and rope_dims from the
/// options; the row cap R + C never binds.
struct KvmSizing {
  MemoryConfig cfg;
  long rows = 0;  ///< R: state rows at the end of the longest sequence
};

inline KvmSizing kvm_sizing(const Inputs& in, const SizingOptions& o, double fraction, const std::string& label,
                            const std::string& memory) {
  const long T = longest(in);
  const auto s = split_budget(T, fraction, o, o.window_chunks, /*first_chunk_rows=*/true);
  KvmSizing k{composed_config(in, s, o.window_chunks), s.rows};
  k.cfg.rope_dims = o.rope_dims;
  k.cfg.sinks = o.sinks;
  k.cfg.max_rows = s.rows + s.chunk;
  if (T > s.window + s.chunk)
    require(o.sinks < s.chunk, "--fractions = " + label, fraction,
            "too small for " + memory + ": a budget of " + std::to_string(s.tokens) + " tokens of a " +
                std::to_string(T) + "-token sequence gives chunk " + std::to_string(s.chunk) +
                ", which must exceed --sinks = " + std::to_string(o.sinks) +
                " (use a larger fraction, a larger --window-share or fewer --sinks)");
  return k;
}

/// The smallest growth factor a of a * sqrt(ctx) whose prefill of T tokens ends with `rows` state rows
/// (or as many as the schedule can reach), rounded up to 4 decimals where that keeps the row count.
inline double growth_factor_for(const MemoryConfig& cfg, long T, long rows) {
  auto final_rows = [&](double a) { return state::final_rows(cfg, budget::PowerLaw{-1, a, 0.5, 1}, T); };
  // a >= rows gives B(ctx) >= rows for ctx >= 1.
  const double a = smallest_reaching(final_rows, rows, 0.0, static_cast<double>(std::max(rows, 1L)) + 1.0, false);
  // A printable value, and a * sqrt(ctx) no longer sits on an integer, so the floor in the schedule cannot
  // flip with the last bit of another implementation.
  const double nice = std::ceil(a * 1e4) / 1e4;
  return final_rows(nice) == final_rows(a) ? nice : a;
}

/// kvm-fixed, kvm-sqrt and kvm-16sqrt of storage type T, in table order.
template <StorageType T>
std::vector<MemoryKind> kvm_kinds() {
  std::vector<MemoryKind> kinds;
  kinds.push_back(
      {"kvm-fixed", "KVM fixed",
       "C = round(s*f*T/n_b), window n_b*C, budget::Fixed rows R = f*T - n_b*C (at least C): the state fills to R "
       "rows, then every overflow block merges",
       false, [](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
         const auto s = kvm_sizing(in, o, f, label, "kvm-fixed");
         return kvm_plan<T>(s.cfg, budget::Fixed{s.rows}, {{"kind", "fixed"}, {"min_rows", s.rows}},
                         fmt("C=%d L=%dx%d R=%ld", s.cfg.chunk, s.cfg.window_chunks, s.cfg.chunk, s.rows));
       }});
  kinds.push_back(
      {"proportional", "Proportional merge",
       "merge::Proportional (rows read as their tokens' mean key and value with the bias log(count); no learned "
       "parameter) sized as kvm-fixed: budget::Fixed rows R, window n_b*C",
       false, [](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
         const auto s = kvm_sizing(in, o, f, label, "proportional");
         return kvm_plan<T, budget::Fixed, merge::Proportional>(
             s.cfg, budget::Fixed{s.rows}, {{"kind", "fixed"}, {"min_rows", s.rows}},
             fmt("C=%d L=%dx%d R=%ld", s.cfg.chunk, s.cfg.window_chunks, s.cfg.chunk, s.rows));
       }});
  kinds.push_back(
      {"kvm-sqrt", "KVM a*sqrt(N)",
       "C and window as kvm-fixed; budget::PowerLaw a*sqrt(ctx) with a chosen so that the rows reach R = f*T - n_b*C "
       "at the last token (a = 16 is the paper's 16*sqrt(N)); rows grow from C",
       false, [](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
         const auto s = kvm_sizing(in, o, f, label, "kvm-sqrt");
         const double a = growth_factor_for(s.cfg, longest(in), s.rows);
         return kvm_plan<T>(s.cfg, budget::PowerLaw{-1, a, 0.5, 1},
                         {{"kind", "power-law"}, {"min_rows", -1}, {"growth_factor", a}, {"growth_exponent", 0.5},
                          {"round_down", 1}, {"target_rows", s.rows}},
                         fmt("C=%d L=%dx%d a=%.2f", s.cfg.chunk, s.cfg.window_chunks, s.cfg.chunk, a));
       }});
  kinds.push_back(
      {"kvm-16sqrt", "KVM 16*sqrt(N), C=256",
       "the paper's setting as scripts/setup runs it: C = 256, window 2 x 256, budget::PowerLaw 16*sqrt(ctx) "
       "(min 256 rows); one point at the memory that gives",
       true, [](const Inputs& in, const SizingOptions& o, double, const std::string&) {
         TokenBudget paper;
         paper.chunk = 256;
         auto c = composed_config(in, paper, 2);
         c.rope_dims = o.rope_dims;
         c.sinks = o.sinks;
         c.max_rows = 256L * 10000;  // --max-chunks 10000
         return kvm_plan<T>(c, budget::PowerLaw{256, 16.0, 0.5, 1},
                         {{"kind", "power-law"}, {"min_rows", 256}, {"growth_factor", 16.0}, {"growth_exponent", 0.5},
                          {"round_down", 1}},
                         "C=256 L=2x256 a=16");
       }});
  return kinds;
}

}  // namespace kvmem::tools::eval
