#pragma once
/// \file kvm_command.hpp
/// `kvmem-run kvm`: a KVM memory over a captured attention layer (spec KVM.md §1 tensor contract).

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <kvmem/io/safetensors.hpp>
#include <kvmem/kvmem.hpp>

#include "budget_options.hpp"
#include "run_memory.hpp"
#include "tensors.hpp"
#include "trained_inputs.hpp"

namespace kvmem::tools {

/// Command-line options of `kvmem-run kvm`; defaults are the KVM code defaults (spec KVM.md §1).
struct KvmOptions {
  std::string input, output, mode = "prefill", dtype, merge = "kvm";
  int chunk = 256, window_chunks = 2, rope_dims = 64, sinks = 1;
  long max_chunks = 1, evict_rows_above = 0;
  BudgetOptions budget{.kind = "fixed"};
  TrainedWeightsOptions trained;  ///< --weights, --layer: KVM's trained parameters instead of the input's
};

/// Registers the `kvm` subcommand and its flags on `app`.
inline CLI::App* add_kvm_command(CLI::App& app, KvmOptions& o) {
  auto* cmd = app.add_subcommand("kvm", "KVM memory (Key-Value Means) over q/k/v/gate of one layer");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a repeated flag: the last wins
  cmd->add_option("--input", o.input, "input safetensors: q, k, v, gate, ln_weight, ln_bias, tau_state, tau_bswa [, lengths]")->required();
  cmd->add_option("--output", o.output, "output safetensors: y, state_keys, state_values, state_radius, state_rows")->required();
  cmd->add_option("--mode", o.mode, "prefill (chunk-parallel) or decode (token by token)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  add_dtype_option(cmd, o.dtype);
  cmd->add_option("--chunk", o.chunk, "C: tokens per chunk")->capture_default_str();
  cmd->add_option("--window-chunks", o.window_chunks, "n_b: chunks in the block sliding window")->capture_default_str();
  cmd->add_option("--rope-dims", o.rope_dims, "r: key channels zeroed before the memory LayerNorm")->capture_default_str();
  cmd->add_option("--sinks", o.sinks, "S: protected sink rows")->capture_default_str();
  add_budget_options(cmd, o.budget, {"fixed", "power-law", "saturating", "plateau", "linear"});
  cmd->add_option("--max-chunks", o.max_chunks, "rows are capped at chunk * max-chunks")->capture_default_str();
  cmd->add_option("--merge", o.merge,
                  "kvm: KVM's gated winner-take-all (merge::WinnerTakeAll); proportional: rows read as their tokens' "
                  "mean key and value with the bias log(count) (merge::Proportional; reads tau_state and tau_bswa, "
                  "ignores gate and the LayerNorm; writes state_counts instead of state_radius)")
      ->check(CLI::IsMember({"kvm", "proportional"}))
      ->capture_default_str();
  cmd->add_option("--evict-rows-above", o.evict_rows_above,
                  "also evict state rows by H2O (accumulated attention) down to this many after every fold (0 = off)")
      ->capture_default_str();
  add_trained_weights_options(cmd, o.trained, "kvm");
  return cmd;
}

/// The inputs of `kvmem-run kvm` checked against each other, as device views: tokens (q, k, v, gate) of
/// Storage, layer weights float32.
template <class MemorySpace, StorageType Storage = float>
struct KvmInputs : Batch<MemorySpace, Storage> {
  LayerWeights<MemorySpace> weights;

  /// Reads and checks every tensor, the tokens as `dtype`; throws kvmem::invalid_argument naming the first
  /// bad one.
  static KvmInputs load(const io::SafetensorsFile& f, const TokenDtype& dtype) {
    KvmInputs in;
    static_cast<Batch<MemorySpace, Storage>&>(in) = Batch<MemorySpace, Storage>::load_qkv(f, dtype);
    in.load_parameters(f, dtype);
    return in;
  }

  /// Reads and checks gate [B, Hkv, T] (as `dtype`), ln_weight, ln_bias [D], tau_state and tau_bswa [Hq]
  /// of `f` against the sizes of the tokens already loaded, in place of this input's; throws
  /// kvmem::invalid_argument naming the first bad tensor.
  void load_parameters(const io::SafetensorsFile& f, const TokenDtype& dtype) {
    auto& in = *this;
    const auto& g = token_tensor(f, "gate", 3, "[B, Hkv, T]", dtype);
    const auto& lw = float_tensor(f, "ln_weight", 1, "[D]");
    const auto& lb = float_tensor(f, "ln_bias", 1, "[D]");
    const auto& ts = float_tensor(f, "tau_state", 1, "[Hq]");
    const auto& tb = float_tensor(f, "tau_bswa", 1, "[Hq]");
    require_token_fits(f, g, "gate", 2);
    expect_dim(g, "gate", 0, in.B, "B (from q)");
    expect_dim(g, "gate", 1, in.Hkv, "Hkv (from k)");
    expect_dim(g, "gate", 2, in.T, "T (from q)");
    expect_dim(lw, "ln_weight", 0, in.D, "D (from q)");
    expect_dim(lb, "ln_bias", 0, in.D, "D (from q)");
    expect_dim(ts, "tau_state", 0, in.Hq, "Hq (from q)");
    expect_dim(tb, "tau_bswa", 0, in.Hq, "Hq (from q)");
    in.gate = to_view<3, MemorySpace, Storage>(g, "gate");
    in.weights = {to_view<1, MemorySpace>(lw, "ln_weight"), to_view<1, MemorySpace>(lb, "ln_bias"),
                  to_view<1, MemorySpace>(ts, "tau_state"), to_view<1, MemorySpace>(tb, "tau_bswa")};
  }
};

/// `kvmem-run kvm`: builds the KVM memory the options describe, of storage type Storage (the run's dtype
/// `dtype`, TokenDtype::of), and runs it over `file` (read from o.input). Throws kvmem::invalid_argument for
/// bad options or inputs. Instantiated once per storage type, each in its own translation unit (commands.hpp).
template <StorageType Storage>
void run_kvm(const KvmOptions& o, const io::SafetensorsFile& file, const TokenDtype& dtype) {
  using exec = Kokkos::DefaultExecutionSpace;
  using mem_space = exec::memory_space;
  require_weights_for_layer(o.trained);
  require(o.trained.path.empty() || o.merge == "kvm", "--weights", o.trained.path,
          "holds KVM's trained parameters; --merge " + o.merge + " was not trained with them");
  const auto in = o.trained.path.empty()
                      ? KvmInputs<mem_space, Storage>::load(file, dtype)
                      : KvmInputs<mem_space, Storage>::load(with_trained_weights(file, o.trained, "kvm"), dtype);
  MemoryConfig cfg;
  cfg.head_dim = static_cast<int>(in.D);
  cfg.value_dim = static_cast<int>(in.Dv);
  cfg.query_heads = static_cast<int>(in.Hq);
  cfg.kv_heads = static_cast<int>(in.Hkv);
  cfg.chunk = o.chunk;
  cfg.window_chunks = o.window_chunks;
  cfg.rope_dims = o.rope_dims;
  cfg.sinks = o.sinks;
  require(o.chunk >= 1, "--chunk", o.chunk, "must be >= 1");
  require(o.max_chunks >= 1 && o.max_chunks <= (1L << 40) / o.chunk, "--max-chunks", o.max_chunks,
          "must be >= 1 and chunk * max-chunks must fit in 2^40 rows");
  cfg.max_rows = static_cast<long>(o.chunk) * o.max_chunks;
  require(o.evict_rows_above == 0 || o.evict_rows_above > o.sinks, "--evict-rows-above", o.evict_rows_above,
          "must be 0 (off) or exceed --sinks = " + std::to_string(o.sinks) + " (sink rows are never evicted)");
  require(o.merge == "kvm" || o.evict_rows_above == 0, "--evict-rows-above", o.evict_rows_above,
          "row eviction is compiled for --merge kvm only (use 0 with --merge " + o.merge + ")");
  const std::string details = "chunk=" + std::to_string(o.chunk) + "  window=" + std::to_string(o.window_chunks) +
                              " x " + std::to_string(o.chunk) + " tokens  sinks=" + std::to_string(o.sinks) +
                              "  rope_dims=" + std::to_string(o.rope_dims);
  BudgetOptions budget = o.budget;
  if (budget.plateau_n <= 0) budget.plateau_n = o.budget.saturation_n;
  with_budget(budget, cfg, *std::max_element(in.lengths.begin(), in.lengths.end()), [&](const auto& b) {
    const StateNames names{"kvm", "state_keys", "state_values", "state_radius", "state_rows", false};
    using budget_t = std::remove_cvref_t<decltype(b)>;
    if (o.merge == "proportional") {
      Memory<exec, merge::Proportional, budget_t, score::Novelty, score::KeepRows, Storage> mem(cfg, b, in.weights,
                                                                                            static_cast<int>(in.B));
      run_memory(mem, in, o.mode, {"proportional", "state_keys", "state_values", "state_counts", "state_rows", true},
                 o.input, o.output, details + "  merge=proportional");
    } else if (o.evict_rows_above == 0) {
      KvmMemory<exec, budget_t, Storage> mem(cfg, b, in.weights, static_cast<int>(in.B));
      run_memory(mem, in, o.mode, names, o.input, o.output, details);
    } else {
      KvmMemoryWithRowEviction<exec, budget_t, score::RowAccumulatedAttention, Storage> mem(
          cfg, b, in.weights, static_cast<int>(in.B), score::RowAccumulatedAttention{.max_rows = o.evict_rows_above});
      run_memory(mem, in, o.mode, names, o.input, o.output,
                 details + "  rows evicted by h2o above " + std::to_string(o.evict_rows_above));
    }
  });
}

}  // namespace kvmem::tools
