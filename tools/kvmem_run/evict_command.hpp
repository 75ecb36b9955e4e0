#pragma once
/// \file evict_command.hpp
/// `kvmem-run evict`: fixed-budget eviction (sinks + window + top-k) over a captured layer, with any
/// eviction scorer (spec EVICTION.md, "`kvmem-run evict` mapping").

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <kvmem/eviction.hpp>
#include <kvmem/io/safetensors.hpp>
#include <kvmem/kernels/readout/exact_attention.hpp>
#include <kvmem/kernels/common/zero_tail.hpp>

#include "batch.hpp"
#include "run_tokens.hpp"
#include "tensors.hpp"
#include "trained_inputs.hpp"

namespace kvmem::tools {

/// Command-line options of `kvmem-run evict` (defaults: 4 sinks, a 64-token window, top 448: 516 rows).
struct EvictOptions {
  std::string input, output, mode = "prefill", scorer = "h2o", weights, normalizer = "xlstm", dtype;
  int sinks = 4, window = 64, top_k = 448, decay_interval = 1, chunk = 1, observation_window = 64;
  long prompt = -1;  ///< --prompt: the first tokens one prefill, the rest decode steps (-1: every token)
  bool h2o_normalize = false, tova_layer_mean = false, mask = false, merge_evicted = false;
  long layer = -1;  ///< the layer of a kvmem weights file (--weights); -1: the input's metadata 'layer'
};

/// Registers the `evict` subcommand and its flags on `app`.
inline CLI::App* add_evict_command(CLI::App& app, EvictOptions& o) {
  auto* cmd = app.add_subcommand("evict", "fixed-budget eviction: sinks + window + top-k by an eviction scorer");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--input", o.input, "input safetensors: q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,Dv] [, lengths [B]]")->required();
  cmd->add_option("--output", o.output, "output safetensors: y, kept_positions, kept_rows [, mask]")->required();
  cmd->add_option("--mode", o.mode, "prefill or decode (token by token); the same results")
      ->check(CLI::IsMember({"prefill", "decode"}));
  add_dtype_option(cmd, o.dtype);
  cmd->add_option("--sinks", o.sinks, "s: first tokens never evicted")->capture_default_str();
  cmd->add_option("--window", o.window, "w: protected recent tokens, the current one included (SnapKV: W_obs)")->capture_default_str();
  cmd->add_option("--top-k", o.top_k, "k: retained tokens that left the window (SnapKV: C_max - W_obs)")->capture_default_str();
  cmd->add_option("--scorer", o.scorer, "eviction scorer")
      ->check(CLI::IsMember({"streaming", "knorm", "h2o", "tova", "snapkv", "kvpop"}))
      ->capture_default_str();
  cmd->add_option("--weights", o.weights,
                  "kvpop: safetensors with w_q, w_k, w_v, w_i, b_i, w_f, b_f, w_s, b_s, theta, or a kvmem weights file "
                  "of memory kvpop (tools/distill/distill.py --memory kvpop; its layer: --layer)");
  cmd->add_option("--layer", o.layer, "kvpop: the layer of a kvmem weights file (default: the input's metadata 'layer')");
  cmd->add_option("--decay-interval", o.decay_interval, "n of the per-head decay floor((q - t) / n) log gamma (kvpop)")
      ->capture_default_str();
  cmd->add_option("--normalizer", o.normalizer, "kvpop mLSTM normaliser")->check(CLI::IsMember({"xlstm", "plain"}))
      ->capture_default_str();
  cmd->add_flag("--h2o-normalize", o.h2o_normalize, "h2o: divide by the queries that saw the token and the group (kvpress)");
  cmd->add_flag("--tova-layer-mean", o.tova_layer_mean,
                "tova: every kv-head evicts the same token, by the mean over all query heads (original TOVA)");
  cmd->add_flag("--merge-evicted", o.merge_evicted,
                "fold each evicted row into its most similar kept row (count-weighted means, log-count bias)");
  cmd->add_flag("--mask", o.mask, "also write mask [B,Hkv,T,T] (U8): the keys each query attends (static scorers, n = 1)");
  cmd->add_option("--chunk", o.chunk,
                  "positions per compression: 1 every token (streaming), C > 1 once per chunk of C, 0 at the end of "
                  "the prompt (its first decode step; see --prompt); snapkv with --chunk != 1 runs as a memory")
      ->capture_default_str();
  cmd->add_option("--observation-window", o.observation_window,
                  "queries per chunk (--chunk 0: of the prompt) whose attention scores; 0: all")->capture_default_str();
  cmd->add_option("--prompt", o.prompt,
                  "--mode prefill: only the first N tokens are one prefill (the prompt), the rest decode steps");
  return cmd;
}

namespace detail {

/// Writes y [B, Hq, T, Dv] (in the run's dtype, Storage), kept_positions [B, Hkv, K] and kept_rows [B, Hkv]
/// (int64; K = the largest row count) and the optional mask, then prints the summary.
template <class MemorySpace, StorageType Storage, class Positions, class Rows, class Y>
void write_evict_output(const EvictOptions& o, const Batch<MemorySpace, Storage>& in, const Y& y, const Positions& positions,
                        const Rows& rows, const std::vector<unsigned char>& mask, long budget, double seconds) {
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  auto ph = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), positions);
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), rows);
  long K = 0, min_rows = -1, tokens = 0;
  for (long b = 0; b < in.B; ++b) {
    tokens += in.lengths[b];
    for (long h = 0; h < in.Hkv; ++h)
      K = std::max(K, static_cast<long>(rh(b, h))), min_rows = min_rows < 0 ? rh(b, h) : std::min<long>(min_rows, rh(b, h));
  }
  std::vector<std::int64_t> kept(in.B * in.Hkv * K), kept_rows(in.B * in.Hkv);
  for (long b = 0; b < in.B; ++b)
    for (long h = 0; h < in.Hkv; ++h) {
      kept_rows[b * in.Hkv + h] = rh(b, h);
      for (long i = 0; i < K; ++i) kept[(b * in.Hkv + h) * K + i] = ph(b, h, i);
    }
  io::SafetensorsFile out;
  out.put("y", {in.B, in.Hq, in.T, in.Dv}, yh.data());
  out.put("kept_positions", {in.B, in.Hkv, K}, kept.data());
  out.put("kept_rows", {in.B, in.Hkv}, kept_rows.data());
  if (o.mask) out.put("mask", {in.B, in.Hkv, in.T, in.T}, mask.data());
  out.metadata["memory"] = "evict";
  out.metadata["scorer"] = o.scorer;
  out.metadata["mode"] = o.mode;
  out.write(o.output);
  const long row_bytes = in.Hkv * (in.D + in.Dv) * static_cast<long>(sizeof(Storage));
  const long longest = *std::max_element(in.lengths.begin(), in.lengths.end());
  std::printf("kvmem-run evict  scorer=%s  mode=%s  dtype=%s  backend=%s (%d threads)\n", o.scorer.c_str(),
              o.mode.c_str(), in.dtype.flag().c_str(), Kokkos::DefaultExecutionSpace().name(),
              Kokkos::DefaultExecutionSpace().concurrency());
  std::printf("  input         %s%s\n", o.input.c_str(), in.dtype.conversion().c_str());
  std::printf("  shape         B=%ld  Hq=%ld  Hkv=%ld  T=%ld  D=%ld  Dv=%ld  (%ld tokens in all)\n", in.B, in.Hq, in.Hkv,
              in.T, in.D, in.Dv, tokens);
  std::printf("  policy        sinks=%d  window=%d  top-k=%d  chunk=%d  (budget %ld rows per kv-head)\n", o.sinks,
              o.window, o.top_k, o.chunk, budget);
  std::printf("  kept rows     %ld..%ld per kv-head (largest sequence: %ld tokens)\n", min_rows, K, longest);
  print_memory_held<Storage>(in.B * std::min(budget, longest) * row_bytes, "budget rows " + in.dtype.flag(), tokens,
                             in.Hkv, in.D + in.Dv);
  std::printf("  wall time     %.3f s  (%.0f tokens/s)\n", seconds, seconds > 0 ? tokens / seconds : 0.0);
  std::printf("  output        %s\n", o.output.c_str());
}

/// The dense mask [B, Hkv, T, T] (U8) of the policy with a static scorer (kvmem::training::eviction_masks).
template <class Scorer, class MemorySpace, StorageType Storage>
std::vector<unsigned char> dense_mask(const EvictionConfig& cfg, const Scorer& scorer, const Batch<MemorySpace, Storage>& in) {
  const auto masks = training::eviction_masks(Kokkos::DefaultExecutionSpace(), cfg, scorer, in.k, in.v, in.lengths);
  std::vector<unsigned char> mask(in.B * in.Hkv * in.T * in.T, 0);
  for (long b = 0; b < in.B; ++b)
    for (long h = 0; h < in.Hkv; ++h) {
      const auto& m = masks[b * in.Hkv + h];
      unsigned char* base = mask.data() + (b * in.Hkv + h) * in.T * in.T;
      for (long q = 0; q < m.tokens(); ++q)
        for (long t = 0; t <= q; ++t) base[q * in.T + t] = m.kept(q, t);
    }
  return mask;
}

/// Runs an EvictionMemory of the batch's storage type with `scorer` over `in` in the chosen mode and writes
/// the outputs.
template <class Scorer, class MemorySpace, StorageType Storage>
void run_eviction(const EvictOptions& o, const EvictionConfig& cfg, const Scorer& scorer,
                  const Batch<MemorySpace, Storage>& in) {
  using exec = Kokkos::DefaultExecutionSpace;
  std::vector<unsigned char> mask;
  if constexpr (!Scorer::needs_probabilities) {
    if (o.mask) mask = dense_mask(cfg, scorer, in);
  }
  using memory_t = EvictionMemory<exec, Scorer, Storage>;
  memory_t mem(cfg, static_cast<int>(in.B), scorer);
  Kokkos::View<Storage****, Kokkos::LayoutRight, MemorySpace> y("y", in.B, in.Hq, in.T, in.Dv);
  const double seconds = run_tokens(mem, typename memory_t::inputs{in.q, in.k, in.v}, y, o.mode, in.lengths, o.prompt);
  Kokkos::View<long***, Kokkos::LayoutRight, MemorySpace> positions("kept_positions", in.B, in.Hkv, mem.cache().slots());
  Kokkos::View<long**, Kokkos::LayoutRight, MemorySpace> rows("kept_rows", in.B, in.Hkv);
  mem.kept(positions, rows);
  write_evict_output(o, in, y, positions, rows, mask, cfg.budget(), seconds);
}

/// `x` itself: a float32 token view needs no widening (the overload below widens the others).
template <class View>
  requires std::is_same_v<typename View::non_const_value_type, float>
View widened(const View& x) {
  return x;
}
/// A float32 copy of the LayoutRight token view `x` (exact: every bfloat16 and float16 value is a float32
/// value). The return type is spelled out: nvcc's extended lambdas need a parent without a deduced one.
template <class View>
  requires(!std::is_same_v<typename View::non_const_value_type, float>)
Kokkos::View<float****, Kokkos::LayoutRight, typename View::memory_space> widened(const View& x) {
  Kokkos::View<float****, Kokkos::LayoutRight, typename View::memory_space> w(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, x.label() + " (float32)"), x.extent(0), x.extent(1),
      x.extent(2), x.extent(3));
  Kokkos::parallel_for("kvmem_run::widen", Kokkos::RangePolicy<typename View::execution_space>(0, x.span()),
                       KOKKOS_LAMBDA(std::size_t i) { w.data()[i] = to_float(x.data()[i]); });
  return w;
}

/// SnapKV (spec §6): y = exact causal attention for every query (in the batch's storage type), then the
/// one-shot selection (float64 arithmetic on q and k widened to float32, which is exact).
template <class MemorySpace, StorageType Storage>
void run_snapkv(const EvictOptions& o, const Batch<MemorySpace, Storage>& in) {
  using exec = Kokkos::DefaultExecutionSpace;
  Kokkos::View<Storage****, Kokkos::LayoutRight, MemorySpace> y("y", in.B, in.Hq, in.T, in.Dv);
  const auto start = std::chrono::steady_clock::now();
  kernels::exact_causal_attention(exec(), in.q, in.k, in.v, y);
  Kokkos::View<long*, MemorySpace> lengths("lengths", in.B);
  auto lh = Kokkos::create_mirror_view(lengths);
  for (long b = 0; b < in.B; ++b) lh(b) = in.lengths[b];
  Kokkos::deep_copy(lengths, lh);
  kernels::zero_tail(exec(), y, lengths);
  kernels::SnapKvScratch<MemorySpace> scratch;
  scratch.allocate(in.B, in.Hq, in.Hkv, in.T, o.window);
  const long K = std::min<long>(in.T, static_cast<long>(o.window) + o.top_k);
  Kokkos::View<long***, Kokkos::LayoutRight, MemorySpace> positions("kept_positions", in.B, in.Hkv, K);
  Kokkos::View<long**, Kokkos::LayoutRight, MemorySpace> rows("kept_rows", in.B, in.Hkv);
  kernels::snapkv_keep(exec(), widened(in.q), widened(in.k), lengths, o.window, o.top_k, scratch, positions, rows);
  Kokkos::fence();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  write_evict_output(o, in, y, positions, rows, {}, static_cast<long>(o.window) + o.top_k, seconds);
}

}  // namespace detail

/// `kvmem-run evict`: reads q, k, v [, lengths] of `file` (read from o.input) as `dtype`, of storage type
/// Storage, runs the eviction policy with the chosen scorer and writes y (Storage), kept_positions, kept_rows
/// [, mask]. Throws kvmem::invalid_argument naming the flag or tensor for bad input. One instantiation per
/// storage type, each in its own translation unit (commands.hpp).
template <StorageType Storage>
void run_evict(const EvictOptions& o, const io::SafetensorsFile& file, const TokenDtype& dtype) {
  using exec = Kokkos::DefaultExecutionSpace;
  using mem_space = exec::memory_space;
  require(o.window >= 1, "--window", o.window, "must be >= 1 (the window holds the current token)");
  require(o.top_k >= 0, "--top-k", o.top_k, "must be >= 0");
  require(o.sinks >= 0, "--sinks", o.sinks, "must be >= 0");
  require(static_cast<long>(o.sinks) + o.window + o.top_k <= (1L << 30), "--sinks + --window + --top-k",
          static_cast<long>(o.sinks) + o.window + o.top_k, "must be at most 2^30 rows");
  require(o.decay_interval >= 1, "--decay-interval", o.decay_interval, "must be >= 1");
  require(o.scorer == "kvpop" || o.weights.empty(), "--weights", o.weights, "only the kvpop scorer takes weights");
  require(o.scorer == "kvpop" || o.layer == -1, "--layer", o.layer, "selects the layer of the kvpop scorer's weights");
  require(o.scorer == "kvpop" || o.decay_interval == 1, "--decay-interval", o.decay_interval,
          "only the kvpop scorer has a decay (training-free scorers use log gamma = 0)");
  require(!o.mask || o.scorer == "streaming" || o.scorer == "knorm" || o.scorer == "kvpop", "--mask", o.scorer,
          "masks need a static scorer: streaming, knorm or kvpop (h2o, tova and snapkv depend on attention)");
  require(!o.mask || o.decay_interval == 1, "--mask", "--decay-interval " + std::to_string(o.decay_interval),
          "masks need --decay-interval 1 (spec EVICTION.md §4)");
  require(o.chunk >= 0, "--chunk", o.chunk, "must be >= 0 (1: every token, 0: at the end of the prompt)");
  require(o.observation_window >= 0, "--observation-window", o.observation_window, "must be >= 0 (0: every query)");
  require(o.prompt >= -1, "--prompt", o.prompt, "must be >= 0 (tokens of the prompt)");
  require(o.prompt < 0 || o.mode == "prefill", "--prompt", o.prompt, "applies to --mode prefill");
  const bool snapkv_once = o.scorer == "snapkv" && o.chunk == 1;  // SnapKV's one-shot selection (kernels::snapkv_keep)
  require(!snapkv_once || o.prompt < 0, "--prompt", o.prompt, "the one-shot snapkv (--chunk 1) reads every token as the prompt");
  require(!snapkv_once || o.sinks == 0, "--sinks", o.sinks, "must be 0 for snapkv (SnapKV keeps no sinks)");
  require(o.scorer != "kvpop" || !o.weights.empty(), "--weights", "(none)", "the kvpop scorer needs its learned weights");
  require(!o.merge_evicted || !snapkv_once, "--merge-evicted", o.scorer,
          "the one-shot snapkv (--chunk 1) selects once after the prompt; there is nothing to merge (--chunk 0 is "
          "SnapKV as a memory, which merges)");
  require(!o.mask || o.chunk == 1, "--mask", "--chunk " + std::to_string(o.chunk),
          "masks are the streaming eviction's (--chunk 1)");
  require(!o.merge_evicted || !o.mask, "--mask", "--merge-evicted",
          "a mask says which tokens a query attends, which merged rows no longer are");
  const auto in = Batch<mem_space, Storage>::load_qkv(file, dtype);
  if (snapkv_once) return detail::run_snapkv(o, in);
  EvictionConfig cfg;
  cfg.head_dim = static_cast<int>(in.D);
  cfg.value_dim = static_cast<int>(in.Dv);
  cfg.query_heads = static_cast<int>(in.Hq);
  cfg.kv_heads = static_cast<int>(in.Hkv);
  cfg.sinks = o.sinks;
  cfg.window = o.window;
  cfg.top_k = o.top_k;
  cfg.decay_interval = o.decay_interval;
  cfg.merge_evicted = o.merge_evicted;
  cfg.chunk = o.chunk;
  cfg.observation_window = o.observation_window;
  if (o.scorer == "streaming") return detail::run_eviction(o, cfg, score::None{}, in);
  if (o.scorer == "snapkv") return detail::run_eviction(o, cfg, score::ObservationWindow{}, in);
  if (o.scorer == "knorm") return detail::run_eviction(o, cfg, score::KeyNorm{}, in);
  require(o.scorer == "tova" || !o.tova_layer_mean, "--tova-layer-mean", o.scorer, "applies to the tova scorer only");
  require(o.scorer == "h2o" || !o.h2o_normalize, "--h2o-normalize", o.scorer, "applies to the h2o scorer only");
  if (o.scorer == "tova") {
    score::LastQueryAttention tova;
    tova.layer_mean = o.tova_layer_mean;
    return detail::run_eviction(o, cfg, tova, in);
  }
  if (o.scorer == "h2o") {
    score::AccumulatedAttention h2o;
    h2o.normalize = o.h2o_normalize;
    return detail::run_eviction(o, cfg, h2o, in);
  }
  require(in.D % 2 == 0, "tensor 'k' shape", shape_string({in.B, in.Hkv, in.T, in.D}),
          "head_dim D must be even for the kvpop scorer (h = D / 2, spec EVICTION.md §3)");
  auto weights_file = io::SafetensorsFile::read(o.weights);
  score::MLstmWeights<mem_space> weights;
  // A kvmem weights file (every layer; metadata format, memory, ...), or the tensors of one layer.
  if (weights_file.metadata.count("format") || weights_file.metadata.count("memory")) {
    const auto trained = io::MemoryWeightsFile::from(std::move(weights_file), o.weights, "kvpop");
    const auto model = file.metadata.find("source_model");
    if (model != file.metadata.end()) trained.expect_model(model->second);
    trained.expect_sizes(in.Hq, in.Hkv, in.D);
    require_adapters_captured(file, trained);
    try {
      weights = load_kvpop_layer<mem_space>(trained, weights_layer(file, o.layer), cfg);
    } catch (const invalid_argument& e) {
      throw invalid_argument("--weights " + o.weights + ": " + e.what());
    }
  } else {
    require(o.layer == -1, "--layer", o.layer, "selects a layer of a kvmem weights file; " + o.weights + " holds one layer");
    weights = score::load_mlstm_weights<mem_space>(weights_file, cfg);
  }
  detail::run_eviction(o, cfg,
                       score::MLstm<mem_space>(weights, o.normalizer == "plain" ? score::MLstmNormalizer::plain
                                                                                : score::MLstmNormalizer::xlstm),
                       in);
}

}  // namespace kvmem::tools
