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

#include "tensors.hpp"

namespace kvmem::tools {

/// Command-line options of `kvmem-run kvm`; defaults are the KVM code defaults (spec KVM.md §1).
struct KvmOptions {
  std::string input, output, mode = "prefill", budget = "fixed";
  int chunk = 256, window_chunks = 2, rope_dims = 64, sinks = 1;
  long min_rows = -1, round_down = 1, max_chunks = 1;
  double growth_factor = 1.0, growth_exponent = 0.5, saturation_n = 1024;
};

/// Registers the `kvm` subcommand and its flags on `app`.
inline CLI::App* add_kvm_command(CLI::App& app, KvmOptions& o) {
  auto* cmd = app.add_subcommand("kvm", "KVM memory (Key-Value Means) over q/k/v/gate of one layer");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a repeated flag: the last wins
  cmd->add_option("--input", o.input, "input safetensors: q, k, v, gate, ln_weight, ln_bias, tau_state, tau_bswa [, lengths]")->required();
  cmd->add_option("--output", o.output, "output safetensors: y, state_keys, state_values, state_radius, state_rows")->required();
  cmd->add_option("--mode", o.mode, "prefill (chunk-parallel) or decode (token by token)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  cmd->add_option("--chunk", o.chunk, "C: tokens per chunk")->capture_default_str();
  cmd->add_option("--window-chunks", o.window_chunks, "n_b: chunks in the block sliding window")->capture_default_str();
  cmd->add_option("--rope-dims", o.rope_dims, "r: key channels zeroed before the memory LayerNorm")->capture_default_str();
  cmd->add_option("--sinks", o.sinks, "S: protected sink rows")->capture_default_str();
  cmd->add_option("--budget", o.budget, "budget schedule")->check(CLI::IsMember({"fixed", "power-law", "saturating"}))->capture_default_str();
  cmd->add_option("--min-rows", o.min_rows, "lower bound of the budget, rows (-1: the first chunk)")->capture_default_str();
  cmd->add_option("--growth-factor", o.growth_factor, "a of power-law a * ctx^p")->capture_default_str();
  cmd->add_option("--growth-exponent", o.growth_exponent, "p of power-law a * ctx^p")->capture_default_str();
  cmd->add_option("--round-down", o.round_down, "budgets round down to a multiple of this many rows")->capture_default_str();
  cmd->add_option("--saturation-n", o.saturation_n, "N of saturating N * ctx / (N + ctx)")->capture_default_str();
  cmd->add_option("--max-chunks", o.max_chunks, "rows are capped at chunk * max-chunks")->capture_default_str();
  return cmd;
}

/// The inputs of `kvmem-run kvm` checked against each other, as device views.
template <class MemorySpace>
struct KvmInputs {
  Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace> q, k, v;
  Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> gate;
  LayerWeights<MemorySpace> weights;
  std::vector<long> lengths;
  long B = 0, Hq = 0, Hkv = 0, T = 0, D = 0, Dv = 0;

  /// Reads and checks every tensor; throws kvmem::invalid_argument naming the first bad one.
  static KvmInputs load(const io::SafetensorsFile& f) {
    KvmInputs in;
    const auto& q = float_tensor(f, "q", 4, "[B, Hq, T, D]");
    const auto& k = float_tensor(f, "k", 4, "[B, Hkv, T, D]");
    const auto& v = float_tensor(f, "v", 4, "[B, Hkv, T, Dv]");
    const auto& g = float_tensor(f, "gate", 3, "[B, Hkv, T]");
    const auto& lw = float_tensor(f, "ln_weight", 1, "[D]");
    const auto& lb = float_tensor(f, "ln_bias", 1, "[D]");
    const auto& ts = float_tensor(f, "tau_state", 1, "[Hq]");
    const auto& tb = float_tensor(f, "tau_bswa", 1, "[Hq]");
    in.B = q.shape[0], in.Hq = q.shape[1], in.T = q.shape[2], in.D = q.shape[3];
    in.Hkv = k.shape[1], in.Dv = v.shape[3];
    expect_dim(k, "k", 0, in.B, "B (from q)");
    expect_dim(k, "k", 2, in.T, "T (from q)");
    expect_dim(k, "k", 3, in.D, "D (from q)");
    expect_dim(v, "v", 0, in.B, "B (from q)");
    expect_dim(v, "v", 1, in.Hkv, "Hkv (from k)");
    expect_dim(v, "v", 2, in.T, "T (from q)");
    expect_dim(g, "gate", 0, in.B, "B (from q)");
    expect_dim(g, "gate", 1, in.Hkv, "Hkv (from k)");
    expect_dim(g, "gate", 2, in.T, "T (from q)");
    expect_dim(lw, "ln_weight", 0, in.D, "D (from q)");
    expect_dim(lb, "ln_bias", 0, in.D, "D (from q)");
    expect_dim(ts, "tau_state", 0, in.Hq, "Hq (from q)");
    expect_dim(tb, "tau_bswa", 0, in.Hq, "Hq (from q)");
    require(in.B >= 1, "tensor 'q' shape", shape_string(q.shape), "needs at least one sequence (B >= 1)");
    require(in.Hkv >= 1 && in.Hq % in.Hkv == 0, "tensor 'q' shape", shape_string(q.shape),
            "query heads Hq = " + std::to_string(in.Hq) + " must be a positive multiple of the kv-heads Hkv = " +
                std::to_string(in.Hkv) + " of tensor 'k'");
    in.lengths.assign(in.B, in.T);
    if (f.has("lengths")) {
      const auto& l = f.at("lengths");
      require(l.dtype == "I64" || l.dtype == "I32", "tensor 'lengths' dtype", l.dtype, "must be I64 (or I32)");
      require(l.shape.size() == 1 && l.shape[0] == in.B, "tensor 'lengths' shape", shape_string(l.shape),
              "must be [B] with B = " + std::to_string(in.B));
      const auto vals = io::to_double(l, "lengths");
      for (long b = 0; b < in.B; ++b) {
        require(vals[b] >= 0 && vals[b] <= static_cast<double>(in.T), "lengths[" + std::to_string(b) + "]", vals[b],
                "must be in [0, T = " + std::to_string(in.T) + "]");
        in.lengths[b] = static_cast<long>(vals[b]);
      }
    }
    in.q = to_view<4, MemorySpace>(q, "q");
    in.k = to_view<4, MemorySpace>(k, "k");
    in.v = to_view<4, MemorySpace>(v, "v");
    in.gate = to_view<3, MemorySpace>(g, "gate");
    in.weights = {to_view<1, MemorySpace>(lw, "ln_weight"), to_view<1, MemorySpace>(lb, "ln_bias"),
                  to_view<1, MemorySpace>(ts, "tau_state"), to_view<1, MemorySpace>(tb, "tau_bswa")};
    return in;
  }
};

/// Runs the memory over the inputs in `mode` and writes y and the final state to `output`; prints a summary.
template <class Memory, class Inputs>
void run_memory(Memory& mem, const Inputs& in, const KvmOptions& o) {
  using mem_space = typename Memory::memory_space;
  Kokkos::View<float****, Kokkos::LayoutRight, mem_space> y("y", in.B, in.Hq, in.T, in.Dv);
  const auto start = std::chrono::steady_clock::now();
  if (o.mode == "prefill") {
    mem.prefill(in.q, in.k, in.v, in.gate, y, in.lengths);
  } else {
    std::vector<unsigned char> active(in.B);
    for (long t = 0; t < in.T; ++t) {
      for (long b = 0; b < in.B; ++b) active[b] = t < in.lengths[b];
      const auto at = std::make_pair(t, t + 1);
      auto sub4 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at, Kokkos::ALL); };
      mem.decode(sub4(in.q), sub4(in.k), sub4(in.v), Kokkos::subview(in.gate, Kokkos::ALL, Kokkos::ALL, at), sub4(y),
                 active);
    }
  }
  Kokkos::fence();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Final state, padded to the largest row count M of the batch.
  long M = 0, tokens = 0, min_rows = -1;
  for (long b = 0; b < in.B; ++b) {
    M = std::max(M, mem.cursor(b).rows);
    min_rows = min_rows < 0 ? mem.cursor(b).rows : std::min(min_rows, mem.cursor(b).rows);
    tokens += in.lengths[b];
  }
  const auto& st = mem.rows();
  auto keys = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.keys);
  auto values = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.values);
  auto radius = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.radius);
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  std::vector<float> sk(in.B * in.Hkv * M * in.D, 0.0f), sv(in.B * in.Hkv * M * in.Dv, 0.0f), sr(in.B * in.Hkv * M, 0.0f);
  std::vector<std::int64_t> rows(in.B * in.Hkv);
  for (long b = 0; b < in.B; ++b)
    for (long h = 0; h < in.Hkv; ++h) {
      const long m = mem.cursor(b).rows, base = (b * in.Hkv + h) * M;
      rows[b * in.Hkv + h] = m;
      for (long i = 0; i < m; ++i) {
        for (long c = 0; c < in.D; ++c) sk[(base + i) * in.D + c] = keys(b, h, i, c);
        for (long c = 0; c < in.Dv; ++c) sv[(base + i) * in.Dv + c] = values(b, h, i, c);
        sr[base + i] = radius(b, h, i);
      }
    }
  io::SafetensorsFile out;
  out.put("y", {in.B, in.Hq, in.T, in.Dv}, yh.data());
  out.put("state_keys", {in.B, in.Hkv, M, in.D}, sk.data());
  out.put("state_values", {in.B, in.Hkv, M, in.Dv}, sv.data());
  out.put("state_radius", {in.B, in.Hkv, M}, sr.data());
  out.put("state_rows", {in.B, in.Hkv}, rows.data());
  out.metadata["memory"] = "kvm";
  out.metadata["mode"] = o.mode;
  out.metadata["budget"] = o.budget;
  out.write(o.output);

  const long full = tokens * in.Hkv * (in.D + in.Dv) * static_cast<long>(sizeof(float));
  const long held = mem.held_bytes();
  std::printf("kvmem-run kvm  mode=%s  budget=%s  backend=%s (%d threads)\n", o.mode.c_str(), o.budget.c_str(),
              typename Memory::execution_space().name(), typename Memory::execution_space().concurrency());
  std::printf("  input         %s\n", o.input.c_str());
  std::printf("  shape         B=%ld  Hq=%ld  Hkv=%ld  T=%ld  D=%ld  Dv=%ld  (%ld tokens in all)\n", in.B, in.Hq, in.Hkv,
              in.T, in.D, in.Dv, tokens);
  std::printf("  memory        chunk=%d  window=%d x %d tokens  sinks=%d  rope_dims=%d\n", o.chunk, o.window_chunks,
              o.chunk, o.sinks, o.rope_dims);
  std::printf("  state rows    %ld..%ld per kv-head (largest sequence: %ld tokens)\n", min_rows, M,
              *std::max_element(in.lengths.begin(), in.lengths.end()));
  std::printf("  memory held   %.3f MiB (state rows + window, float32) vs full KV cache %.3f MiB: %.1f%%\n",
              held / 1048576.0, full / 1048576.0, full ? 100.0 * held / full : 0.0);
  std::printf("  wall time     %.3f s  (%.0f tokens/s)\n", seconds, seconds > 0 ? tokens / seconds : 0.0);
  std::printf("  output        %s\n", o.output.c_str());
}

/// Rethrows a kvmem::invalid_argument whose message starts with a config or budget field name
/// ("chunk = 0: ...") with the command-line flag the user typed instead ("--chunk = 0: ...").
[[noreturn]] inline void rethrow_with_flag(const invalid_argument& e) {
  static const char* fields[] = {"chunk", "window_chunks", "rope_dims", "sinks", "max_chunks", "min_rows",
                                 "growth_factor", "growth_exponent", "round_down", "saturation_n"};
  std::string msg = e.what();
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

/// `kvmem-run kvm`: builds the KVM memory the options describe and runs it. Throws kvmem::invalid_argument
/// for bad options or inputs.
inline void run_kvm(const KvmOptions& o) {
  using exec = Kokkos::DefaultExecutionSpace;
  using mem_space = exec::memory_space;
  const auto file = io::SafetensorsFile::read(o.input);
  const auto in = KvmInputs<mem_space>::load(file);
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
  require(o.round_down >= 1, "--round-down", o.round_down, "must be an integer >= 1");
  auto launch = [&](const auto& budget) {
    using budget_t = std::remove_cvref_t<decltype(budget)>;
    try {
      cfg.validate();
      cfg.check_sinks(*std::max_element(in.lengths.begin(), in.lengths.end()));
      budget.validate();
    } catch (const invalid_argument& e) {
      rethrow_with_flag(e);
    }
    KvmMemory<exec, budget_t> mem(cfg, budget, in.weights, static_cast<int>(in.B));
    run_memory(mem, in, o);
  };
  if (o.budget == "fixed") launch(budget::Fixed{o.min_rows});
  else if (o.budget == "power-law") launch(budget::PowerLaw{o.min_rows, o.growth_factor, o.growth_exponent, o.round_down});
  else if (o.budget == "saturating") launch(budget::Saturating{o.min_rows, o.saturation_n, o.round_down});
  else throw invalid_argument("--budget = " + o.budget + ": unknown budget kind (fixed, power-law, saturating)");
}

}  // namespace kvmem::tools
