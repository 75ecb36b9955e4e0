#pragma once
/// \file trained_inputs.hpp
/// Trained memory weights (a kvmem weights file, io/memory_weights.hpp) applied to a captured layer:
/// `--weights FILE [--layer L]` of `kvmem-run kvm`, `kvmem-run ovq` and kvmem-eval. The weights replace the
/// input's stand-ins for the memory's learned parameters before the memory reads them:
///  - kvm: gate [B, Hkv, T] = x . W_g from the input's attention input x [B, T, hidden] (a capture with
///    tools/capture/causal_lm.py --attention-input), ln_weight, ln_bias [D], tau_state, tau_bswa [Hq]
///    (tau_bswa = the file's tau_window);
///  - ovq: beta [Hq], also written as tau_state and tau_bswa (what kvmem-eval's OVQ rows read as beta).
/// Everything else in the input (q, k, v, lengths, metadata) stays as it was. The weights were trained
/// for one configuration (the file's metadata `setup`, `memory_id` and `fraction`): run them with it.

#include <CLI/CLI.hpp>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/errors.hpp>
#include <kvmem/io/memory_weights.hpp>
#include <kvmem/io/safetensors.hpp>
#include <kvmem/policy/trained_weights.hpp>

#include "tensors.hpp"

namespace kvmem::tools {

/// `--weights FILE` and `--layer L` of a command.
struct TrainedWeightsOptions {
  std::string path;  ///< a kvmem weights file; empty: the input's own parameters
  long layer = -1;   ///< the model layer whose weights apply; -1: the input's metadata `layer`
};

/// Registers --weights and --layer on `cmd`; `memories` says which memories' weights the command takes.
inline void add_trained_weights_options(CLI::App* cmd, TrainedWeightsOptions& o, const std::string& memories) {
  cmd->add_option("--weights", o.path,
                  "trained weights of " + memories +
                      " (a kvmem weights file from tools/distill/distill.py): replace the input's parameters; kvm's "
                      "merge gate needs the input's attention input x [B, T, hidden]");
  cmd->add_option("--layer", o.layer, "the layer of --weights to apply (default: the input's metadata 'layer')")
      ->check(CLI::NonNegativeNumber);
}

/// The layer the weights apply to: `layer` when given (>= 0), else the input's metadata `layer` (which
/// tools/capture/causal_lm.py writes). Throws kvmem::invalid_argument naming --layer when neither is there
/// or the metadata is not a non-negative integer.
inline long weights_layer(const io::SafetensorsFile& input, long layer) {
  if (layer >= 0) return layer;
  require(layer == -1, "--layer", layer, "must be >= 0");
  const auto it = input.metadata.find("layer");
  require(it != input.metadata.end(), "--layer", "(none)",
          "give the layer: the input's metadata has no 'layer' to take it from");
  long parsed = -1;
  try {
    std::size_t used = 0;
    parsed = std::stol(it->second, &used);
    if (used != it->second.size()) parsed = -1;
  } catch (const std::exception&) {
    parsed = -1;
  }
  require(parsed >= 0, "input metadata 'layer'", it->second, "must be a non-negative integer (or give --layer)");
  return parsed;
}

/// Low-rank adapters (`w`'s shape.adapter_rank > 0) act on the model's q and k projections, before the memory:
/// they apply to a layer captured with them on (tools/capture/causal_lm.py --adapters FILE writes the file's
/// metadata `tensors_sha256` as the input's `adapters_sha256`), and the memory then reads the file's own
/// tensors as from a file without adapters. Throws kvmem::invalid_argument naming --weights and the input's
/// adapters_sha256 for a file with adapters and an input not captured with them (none, or other adapters).
inline void require_adapters_captured(const io::SafetensorsFile& input, const io::MemoryWeightsFile& w) {
  if (w.shape().adapter_rank == 0) return;
  const auto have = input.metadata.find("adapters_sha256");
  const auto want = w.metadata().find("tensors_sha256");
  require(have != input.metadata.end() && want != w.metadata().end() && have->second == want->second,
          "--weights " + w.path() + " (adapter_rank " + std::to_string(w.shape().adapter_rank) +
              "): input metadata adapters_sha256",
          have == input.metadata.end() ? std::string("(none)") : have->second,
          "low-rank adapters change the model's q and k projections: capture the layer with them on "
          "(tools/capture/causal_lm.py --adapters " + w.path() + "), whose adapters_sha256 is the file's tensors_sha256 " +
              (want == w.metadata().end() ? std::string("(the file has none)") : want->second));
}

/// The tensors that replace `input`'s own parameters with the trained parameters of layer `layer` of the
/// weights `w` (memory kvm or ovq; the list at the top of this file), as a safetensors file of those
/// tensors only (gate in q's dtype: a 16-bit run rounds z once, as it rounds q, k and v). Throws
/// kvmem::invalid_argument naming the weights file, the input tensor or the option: weights trained for
/// another model than the input's metadata `source_model` (checked when the input names one), other query
/// heads or head_dim than q (kvm: also other kv-heads than k; OVQ's beta is per query head), a layer the
/// file lacks, a missing or misshapen tensor, low-rank adapters for an input not captured with them
/// (require_adapters_captured), a KVM file for an input without x [B, T, hidden], or weights of another memory.
inline io::SafetensorsFile trained_parameters(const io::SafetensorsFile& input, const io::MemoryWeightsFile& w, long layer) {
  const auto model = input.metadata.find("source_model");
  if (model != input.metadata.end()) w.expect_model(model->second);
  const auto& q = float_tensor(input, "q", 4, "[B, Hq, T, D]");
  const auto& k = float_tensor(input, "k", 4, "[B, Hkv, T, D]");
  w.expect_sizes(q.shape[1], w.memory() == "ovq" ? w.shape().kv_heads : k.shape[1], q.shape[3]);
  w.expect_layer(layer);
  require_adapters_captured(input, w);
  const long B = q.shape[0], T = q.shape[2];
  const std::vector<std::int64_t> hq{q.shape[1]}, d{q.shape[3]};
  io::SafetensorsFile out;
  if (w.memory() == "ovq") {
    const auto beta = load_ovq_layer<Kokkos::HostSpace>(w, layer).tau_state;
    for (const char* name : {"beta", "tau_state", "tau_bswa"}) out.put(name, hq, beta.data());
    return out;
  }
  require(w.memory() == "kvm", "--weights " + w.path() + " metadata memory", w.memory(),
          "this command applies kvm or ovq weights");
  const auto kvm = load_kvm_layer<Kokkos::HostSpace>(w, layer);
  require(input.has("x"), "tensor 'x'", "(missing)",
          "KVM's trained merge gate is z = x . W_g of the layer's attention input x [B, T, hidden = " +
              std::to_string(kvm.hidden) + "]: capture it (tools/capture/causal_lm.py --attention-input)");
  const auto& xt = float_tensor(input, "x", 3, "[B, T, hidden]");
  expect_dim(xt, "x", 0, B, "B (from q)");
  expect_dim(xt, "x", 1, T, "T (from q)");
  expect_dim(xt, "x", 2, kvm.hidden, "hidden (from the weights file)");
  const auto z = merge_gate_preactivation(kvm, stored_values<float>(xt, "x"), B, T);
  const std::vector<std::int64_t> gate_shape{B, kvm.kv_heads, T};
  const auto run = TokenDtype::run_dtype(q.dtype);
  const auto put_gate = [&](auto tag) {
    using T16 = decltype(tag);
    std::vector<T16> g(z.size());
    for (std::size_t i = 0; i < z.size(); ++i) g[i] = from_float<T16>(z[i]);
    out.put("gate", gate_shape, g.data());
  };
  if (run == dtype_name<bfloat16>) put_gate(bfloat16{});
  else if (run == dtype_name<float16>) put_gate(float16{});
  else out.put("gate", gate_shape, z.data());
  out.put("ln_weight", d, kvm.weights.ln_weight.data());
  out.put("ln_bias", d, kvm.weights.ln_bias.data());
  out.put("tau_state", hq, kvm.weights.tau_state.data());
  out.put("tau_bswa", hq, kvm.weights.tau_window.data());
  return out;
}

/// Throws kvmem::invalid_argument naming --layer when it is given without --weights.
inline void require_weights_for_layer(const TrainedWeightsOptions& o) {
  require(!o.path.empty() || o.layer == -1, "--layer", o.layer, "selects the layer of --weights, which is not given");
}

/// A copy of `input` with the weights of `o` (a file of `memory`'s weights, o.path not empty) in place of
/// its own parameters (trained_parameters). Throws kvmem::invalid_argument as trained_parameters and
/// io::MemoryWeightsFile::read.
inline io::SafetensorsFile with_trained_weights(const io::SafetensorsFile& input, const TrainedWeightsOptions& o,
                                                const std::string& memory) {
  const auto w = io::MemoryWeightsFile::read(o.path, memory);
  const auto params = trained_parameters(input, w, weights_layer(input, o.layer));
  io::SafetensorsFile out = input;
  for (const auto& [name, t] : params.tensors) out.tensors[name] = t;
  return out;
}

}  // namespace kvmem::tools
