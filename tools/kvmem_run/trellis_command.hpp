#pragma once
/// \file trellis_command.hpp
/// `kvmem-run trellis`: a Trellis memory over q/k/v/alpha and gates of one layer (spec TRELLIS.md §1
/// "kvmem-run trellis mapping", §3.3 "Prefill vs decode in kvmem-run trellis").

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <kvmem/io/safetensors.hpp>
#include <kvmem/trellis_memory.hpp>

#include "run_tokens.hpp"
#include "tensors.hpp"

namespace kvmem::tools {

/// Command-line options of `kvmem-run trellis`; defaults are the spec's recommendations (TRELLIS.md §7:
/// phi = silu (A1), f = ln-silu (A7), chunk 16 (A8)).
struct TrellisOptions {
  std::string input, output, mode = "prefill", phi = "silu", f = "ln-silu", dtype;
  int slots = 0, chunk = 16;
};

/// Registers the `trellis` subcommand and its flags on `app`.
inline CLI::App* add_trellis_command(CLI::App& app, TrellisOptions& o) {
  auto* cmd = app.add_subcommand("trellis", "Trellis memory (online gradient descent into m slots) over one layer");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a repeated flag: the last wins
  cmd->add_option("--input", o.input, "input safetensors: q, k, v, alpha, beta1, gamma1, beta2, gamma2 [, lengths]")
      ->required();
  cmd->add_option("--output", o.output, "output safetensors: y, m1, m2")->required();
  cmd->add_option("--mode", o.mode, "prefill (chunkwise stale gradients, chunk C) or decode (exact recurrence, C = 1)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  cmd->add_option("--slots", o.slots, "m: memory slots per head (the last dimension of alpha)")->required();
  add_dtype_option(cmd, o.dtype);
  cmd->add_option("--chunk", o.chunk, "C: tokens per prefill chunk (decode ignores it)")->capture_default_str();
  cmd->add_option("--phi", o.phi, "inner-loss nonlinearity: identity, silu, softmax, tanh, sigmoid")->capture_default_str();
  cmd->add_option("--f", o.f, "intermediate activation: ln-silu, l2-silu (also softmax, identity)")->capture_default_str();
  return cmd;
}

/// The inputs of `kvmem-run trellis` checked against each other, as device views of the run's storage type
/// Storage: q [B, H, T, D], k [B, H, T, D], v [B, H, T, Dv], alpha [B, H, T, m], the gates beta1, gamma1,
/// beta2, gamma2 [B, H, T].
template <class MemorySpace, StorageType Storage>
struct TrellisInputFiles {
  Kokkos::View<Storage****, Kokkos::LayoutRight, MemorySpace> q, k, v, alpha;
  Kokkos::View<Storage***, Kokkos::LayoutRight, MemorySpace> beta1, gamma1, beta2, gamma2;
  std::vector<long> lengths;
  long B = 0, H = 0, T = 0, D = 0, Dv = 0, m = 0;

  /// Reads and checks every tensor, each as `dtype` (token_tensor); throws kvmem::invalid_argument naming the
  /// first bad one.
  static TrellisInputFiles load(const io::SafetensorsFile& f, long slots, const TokenDtype& dtype) {
    TrellisInputFiles in;
    const auto& q = token_tensor(f, "q", 4, "[B, H, T, D]", dtype);
    const auto& k = token_tensor(f, "k", 4, "[B, H, T, D]", dtype);
    const auto& v = token_tensor(f, "v", 4, "[B, H, T, Dv]", dtype);
    const auto& a = token_tensor(f, "alpha", 4, "[B, H, T, m]", dtype);
    in.B = q.shape[0], in.H = q.shape[1], in.T = q.shape[2], in.D = q.shape[3], in.Dv = v.shape[3], in.m = slots;
    for (const auto* name : {"k", "v", "alpha"}) {
      const auto& t = f.at(name);
      expect_dim(t, name, 0, in.B, "B (from q)");
      expect_dim(t, name, 1, in.H, "H (from q)");
      expect_dim(t, name, 2, in.T, "T (from q)");
    }
    expect_dim(k, "k", 3, in.D, "D (from q)");
    expect_dim(a, "alpha", 3, slots, "--slots");
    const char* gate_names[] = {"beta1", "gamma1", "beta2", "gamma2"};
    for (const auto* name : gate_names) {
      const auto& g = token_tensor(f, name, 3, "[B, H, T]", dtype);
      expect_dim(g, name, 0, in.B, "B (from q)");
      expect_dim(g, name, 1, in.H, "H (from q)");
      expect_dim(g, name, 2, in.T, "T (from q)");
    }
    require(in.B >= 1, "tensor 'q' shape", shape_string(q.shape), "needs at least one sequence (B >= 1)");
    require(in.H >= 1, "tensor 'q' shape", shape_string(q.shape), "needs at least one head (H >= 1)");
    require(in.D >= 1, "tensor 'q' shape", shape_string(q.shape), "needs at least one channel (D >= 1)");
    require(in.Dv >= 1, "tensor 'v' shape", shape_string(v.shape), "needs at least one channel (Dv >= 1)");
    in.lengths = load_lengths(f, in.B, in.T);
    in.q = to_view<4, MemorySpace, Storage>(q, "q");
    in.k = to_view<4, MemorySpace, Storage>(k, "k");
    in.v = to_view<4, MemorySpace, Storage>(v, "v");
    in.alpha = to_view<4, MemorySpace, Storage>(a, "alpha");
    in.beta1 = to_view<3, MemorySpace, Storage>(f.at("beta1"), "beta1");
    in.gamma1 = to_view<3, MemorySpace, Storage>(f.at("gamma1"), "gamma1");
    in.beta2 = to_view<3, MemorySpace, Storage>(f.at("beta2"), "beta2");
    in.gamma2 = to_view<3, MemorySpace, Storage>(f.at("gamma2"), "gamma2");
    return in;
  }
};

/// Rethrows a kvmem::invalid_argument whose message starts with a TrellisConfig field name that is a flag
/// ("slots = 0: ...") with the flag the user typed ("--slots = 0: ...").
[[noreturn]] inline void rethrow_trellis_flag(const invalid_argument& e) {
  static const std::pair<const char*, const char*> fields[] = {
      {"slots", "--slots"}, {"chunk", "--chunk"}, {"phi", "--phi"}, {"f", "--f"}};
  const std::string msg = e.what();
  for (const auto& [field, flag] : fields) {
    const std::string prefix = std::string(field) + " = ";
    if (msg.rfind(prefix, 0) == 0) throw invalid_argument(flag + msg.substr(std::string(field).size()));
  }
  throw e;
}

/// `kvmem-run trellis`: runs the Trellis memory the options describe, of storage type Storage (the run's
/// dtype `dtype`), over `file` (read from o.input), writes y (Storage), m1, m2 (float32) and prints a
/// summary. Throws kvmem::invalid_argument for bad options or inputs. One instantiation per storage type,
/// each in its own translation unit (commands.hpp).
template <StorageType Storage>
void run_trellis(const TrellisOptions& o, const io::SafetensorsFile& file, const TokenDtype& dtype) {
  using exec = Kokkos::DefaultExecutionSpace;
  using mem_space = exec::memory_space;
  TrellisConfig cfg;
  try {
    cfg.phi = merge::parse_phi(o.phi, "--phi");
    cfg.f = merge::parse_activation(o.f, "--f");
    require(o.slots >= 1, "--slots", o.slots, "must be >= 1 (m, memory slots per head)");
    require(o.chunk >= 1, "--chunk", o.chunk, "must be >= 1 (C, tokens per prefill chunk)");
  } catch (const invalid_argument& e) {
    rethrow_trellis_flag(e);
  }
  const auto in = TrellisInputFiles<mem_space, Storage>::load(file, o.slots, dtype);
  cfg.slots = o.slots;
  cfg.head_dim = static_cast<int>(in.D);
  cfg.value_dim = static_cast<int>(in.Dv);
  cfg.heads = static_cast<int>(in.H);
  cfg.chunk = o.chunk;
  cfg.readout2_phi = true;  // spec §1: fixed in the tool
  try {
    cfg.validate();
  } catch (const invalid_argument& e) {
    rethrow_trellis_flag(e);
  }
  using memory_t = TrellisMemory<exec, Storage>;
  memory_t mem(cfg, static_cast<int>(in.B));
  Kokkos::View<Storage****, Kokkos::LayoutRight, mem_space> y("y", in.B, in.H, in.T, in.Dv);
  const typename memory_t::inputs inputs{in.q, in.k, in.v, in.alpha, in.beta1, in.gamma1, in.beta2, in.gamma2};
  const double seconds = run_tokens(mem, inputs, y, o.mode, in.lengths);

  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  auto m1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), mem.m1());
  auto m2 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), mem.m2());
  io::SafetensorsFile out;
  out.put("y", {in.B, in.H, in.T, in.Dv}, yh.data());
  out.put("m1", {in.B, in.H, in.m, in.D}, m1.data());
  out.put("m2", {in.B, in.H, in.m, in.Dv}, m2.data());
  out.metadata["memory"] = "trellis";
  out.metadata["mode"] = o.mode;
  out.metadata["phi"] = o.phi;
  out.metadata["f"] = o.f;
  out.metadata["slots"] = std::to_string(o.slots);
  out.metadata["chunk"] = o.mode == "prefill" ? std::to_string(o.chunk) : "1";
  out.write(o.output);

  long tokens = 0;
  for (long n : in.lengths) tokens += n;
  std::printf("kvmem-run trellis  mode=%s  dtype=%s  phi=%s  f=%s  backend=%s (%d threads)\n", o.mode.c_str(),
              dtype.flag().c_str(), o.phi.c_str(), o.f.c_str(), exec().name(), exec().concurrency());
  std::printf("  input         %s%s\n", o.input.c_str(), dtype.conversion().c_str());
  std::printf("  shape         B=%ld  H=%ld  T=%ld  D=%ld  Dv=%ld  (%ld tokens in all)\n", in.B, in.H, in.T, in.D, in.Dv,
              tokens);
  if (o.mode == "prefill")
    std::printf("  memory        slots=%d  chunk=%d (stale gradients per chunk)  readout2_phi=on\n", o.slots, o.chunk);
  else
    std::printf("  memory        slots=%d  chunk=1 (exact recurrence; --chunk ignored)  readout2_phi=on\n", o.slots);
  print_memory_held<Storage>(mem.held_bytes(), "M1 + M2 float32", tokens, in.H, in.D + in.Dv);
  std::printf("  wall time     %.3f s  (%.0f tokens/s)\n", seconds, seconds > 0 ? tokens / seconds : 0.0);
  std::printf("  output        %s\n", o.output.c_str());
}

}  // namespace kvmem::tools
