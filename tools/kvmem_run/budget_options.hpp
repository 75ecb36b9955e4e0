#pragma once
/// \file budget_options.hpp
/// The budget-schedule flags shared by `kvmem-run kvm` and `kvmem-run ovq`, and the dispatch from a
/// schedule name to its kvmem::budget type.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include <kvmem/kvmem.hpp>

namespace kvmem::tools {

/// Flags of every budget schedule; each schedule reads its own (spec KVM.md §1, §5.2; OVQ.md §1, §3).
struct BudgetOptions {
  std::string kind;
  long min_rows = -1, round_down = 1;
  double growth_factor = 1.0, growth_exponent = 0.5, saturation_n = 1024, plateau_n = 0;
};

/// Registers --budget (one of `kinds`, default `o.kind`) and the schedules' parameter flags on `cmd`.
inline void add_budget_options(CLI::App* cmd, BudgetOptions& o, const std::vector<std::string>& kinds) {
  cmd->add_option("--budget", o.kind, "budget schedule")->check(CLI::IsMember(kinds))->capture_default_str();
  cmd->add_option("--min-rows", o.min_rows, "fixed/power-law/saturating: lower bound of the budget, rows (-1: none)")
      ->capture_default_str();
  cmd->add_option("--growth-factor", o.growth_factor, "power-law: a of a * ctx^p")->capture_default_str();
  cmd->add_option("--growth-exponent", o.growth_exponent, "power-law: p of a * ctx^p")->capture_default_str();
  cmd->add_option("--round-down", o.round_down, "power-law/saturating: round budgets down to a multiple of this")
      ->capture_default_str();
  cmd->add_option("--saturation-n", o.saturation_n, "saturating: N of N * ctx / (N + ctx)")->capture_default_str();
  cmd->add_option("--plateau-n", o.plateau_n, "plateau: N of t * N / (t + N) (default: ovq --max-centroids, kvm --saturation-n)");
}

/// Rethrows a kvmem::invalid_argument whose message starts with a config or budget field name
/// ("chunk = 0: ...") with the command-line flag the user typed instead ("--chunk = 0: ...").
[[noreturn]] inline void rethrow_with_flag(const invalid_argument& e) {
  static const char* fields[] = {"chunk",       "window_chunks", "rope_dims",    "sinks",       "max_rows",
                                 "min_rows",    "growth_factor", "growth_exponent", "round_down", "saturation_n",
                                 "max_centroids"};
  const std::string msg = e.what();
  for (const char* f : fields) {
    const std::string field(f);
    if (msg.rfind(field + " = ", 0) == 0) {
      std::string flag = "--" + field;
      std::replace(flag.begin(), flag.end(), '_', '-');
      throw invalid_argument(flag + msg.substr(field.size()));
    }
  }
  throw e;
}

/// Validates `cfg` (with the longest sequence, for sinks) and the schedule named by `o`, then calls
/// launch(budget) with the kvmem::budget value it names. Errors name the command-line flag.
template <class Launch>
void with_budget(const BudgetOptions& o, MemoryConfig cfg, long longest, Launch&& launch) {
  require(o.round_down >= 1, "--round-down", o.round_down, "must be an integer >= 1");
  auto checked = [&](const auto& budget) {
    try {
      cfg.validate();
      cfg.check_sinks(longest);
      budget.validate();
    } catch (const invalid_argument& e) {
      rethrow_with_flag(e);
    }
    launch(budget);
  };
  if (o.kind == "fixed") checked(budget::Fixed{o.min_rows});
  else if (o.kind == "power-law") checked(budget::PowerLaw{o.min_rows, o.growth_factor, o.growth_exponent, o.round_down});
  else if (o.kind == "saturating") checked(budget::Saturating{o.min_rows, o.saturation_n, o.round_down});
  else if (o.kind == "plateau") checked(budget::Plateau{o.plateau_n});
  else if (o.kind == "linear" || o.kind == "min") checked(budget::Linear{});
  else throw invalid_argument("--budget = " + o.kind + ": unknown budget schedule");
}

}  // namespace kvmem::tools
