#pragma once
/// \file ovq_command.hpp
/// `kvmem-run ovq`: an OVQ memory (online k-means with counts) over one layer (spec OVQ.md §1 contract).

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <string>

#include <kvmem/io/safetensors.hpp>
#include <kvmem/kvmem.hpp>

#include "budget_options.hpp"
#include "run_memory.hpp"
#include "tensors.hpp"
#include "trained_inputs.hpp"

namespace kvmem::tools {

/// Options of `kvmem-run ovq`; defaults are the OVQ code defaults (spec OVQ.md §1).
struct OvqOptions {
  std::string input, output, mode = "prefill", dtype;
  int chunk = 128;
  long max_centroids = 2048;
  bool normalize_centroids = false;
  BudgetOptions budget{.kind = "plateau"};
  TrainedWeightsOptions trained;  ///< --weights, --layer: OVQ's trained beta instead of the input's
};

/// Registers the `ovq` subcommand and its flags on `app`.
inline CLI::App* add_ovq_command(CLI::App& app, OvqOptions& o) {
  auto* cmd = app.add_subcommand("ovq", "OVQ memory (online vector quantization) over q/k/v of one layer");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--input", o.input, "input safetensors: q, k, v, beta (or --weights) [, lengths]")->required();
  cmd->add_option("--output", o.output, "output safetensors: y, centroid_keys, centroid_values, counts, centroid_rows")
      ->required();
  cmd->add_option("--mode", o.mode, "prefill (chunk-parallel) or decode (token by token)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  add_dtype_option(cmd, o.dtype);
  cmd->add_option("--chunk", o.chunk, "C: tokens per chunk")->capture_default_str();
  cmd->add_option("--max-centroids", o.max_centroids, "N: centroid cap and plateau parameter")->capture_default_str();
  cmd->add_flag("--normalize-centroids", o.normalize_centroids, "L2-normalize centroids after every commit");
  add_budget_options(cmd, o.budget, {"plateau", "linear", "min", "fixed", "power-law", "saturating"});
  add_trained_weights_options(cmd, o.trained, "ovq");
  return cmd;
}

/// `kvmem-run ovq`: reads q, k [B, H, T, D], v [B, H, T, Dv] (as `dtype`, of storage type Storage), beta [H]
/// (or the trained beta of --weights) and optional lengths [B] of `f`, runs an OvqMemory (window of one chunk, no sinks, row cap N, tau = beta)
/// under the chosen budget schedule and writes y [B, H, T, Dv] (Storage), centroid_keys [B, H, M, D],
/// centroid_values [B, H, M, Dv], counts [B, H, M] (float32), centroid_rows [B, H]. Throws
/// kvmem::invalid_argument naming the tensor or flag for bad input. One instantiation per storage type.
template <StorageType Storage>
void run_ovq(const OvqOptions& o, const io::SafetensorsFile& f, const TokenDtype& dtype) {
  require_weights_for_layer(o.trained);
  if (!o.trained.path.empty()) {  // the trained beta in place of the input's, then the same run
    OvqOptions plain = o;
    plain.trained = {};
    return run_ovq<Storage>(plain, with_trained_weights(f, o.trained, "ovq"), dtype);
  }
  using exec = Kokkos::DefaultExecutionSpace;
  using mem_space = exec::memory_space;
  const auto& q = token_tensor(f, "q", 4, "[B, H, T, D]", dtype);
  const auto& k = token_tensor(f, "k", 4, "[B, H, T, D]", dtype);
  const auto& v = token_tensor(f, "v", 4, "[B, H, T, Dv]", dtype);
  const auto& beta = float_tensor(f, "beta", 1, "[H]");
  Batch<mem_space, Storage> in;
  in.dtype = dtype;
  in.B = q.shape[0], in.Hq = in.Hkv = q.shape[1], in.T = q.shape[2], in.D = q.shape[3], in.Dv = v.shape[3];
  for (std::size_t axis = 0; axis < 4; ++axis) expect_dim(k, "k", axis, q.shape[axis], "the same dimension of q");
  for (std::size_t axis = 0; axis < 3; ++axis) expect_dim(v, "v", axis, q.shape[axis], "the same dimension of q");
  expect_dim(beta, "beta", 0, in.Hq, "H (from q)");
  require(in.B >= 1 && in.Hq >= 1, "tensor 'q' shape", shape_string(q.shape), "needs B >= 1 and H >= 1");
  in.lengths = load_lengths(f, in.B, in.T);
  in.q = to_view<4, mem_space, Storage>(q, "q");
  in.k = to_view<4, mem_space, Storage>(k, "k");
  in.v = to_view<4, mem_space, Storage>(v, "v");
  const auto betas = to_view<1, mem_space>(beta, "beta");
  const LayerWeights<mem_space> weights{{}, {}, betas, betas};

  require(o.max_centroids >= 1, "--max-centroids", o.max_centroids, "must be >= 1");
  MemoryConfig cfg;
  cfg.head_dim = static_cast<int>(in.D);
  cfg.value_dim = static_cast<int>(in.Dv);
  cfg.query_heads = cfg.kv_heads = static_cast<int>(in.Hq);
  cfg.chunk = o.chunk;
  cfg.window_chunks = 1;  // OVQ attends to the open chunk only (spec OVQ.md §4)
  cfg.rope_dims = 0;
  cfg.sinks = 0;
  cfg.max_rows = o.max_centroids;
  cfg.normalize_rows = o.normalize_centroids;
  BudgetOptions budget = o.budget;
  if (budget.plateau_n <= 0) budget.plateau_n = static_cast<double>(o.max_centroids);
  const std::string details = "chunk=" + std::to_string(o.chunk) + "  max_centroids=" + std::to_string(o.max_centroids) +
                              (o.normalize_centroids ? "  normalized centroids" : "");
  with_budget(budget, cfg, *std::max_element(in.lengths.begin(), in.lengths.end()), [&](const auto& b) {
    OvqMemory<exec, std::remove_cvref_t<decltype(b)>, Storage> mem(cfg, b, weights, static_cast<int>(in.B));
    run_memory(mem, in, o.mode, {"ovq", "centroid_keys", "centroid_values", "counts", "centroid_rows", true}, o.input,
               o.output, details);
  });
}

}  // namespace kvmem::tools
