#pragma once
/// \file trained_weights.hpp
/// One layer's trained memory parameters from a kvmem weights file (io/memory_weights.hpp), as the views
/// the memories read: KVM's LayerWeights and merge-gate weights, OVQ's logit scale, KVPOP's mLSTM scorer.
/// Tools and engines that load trained weights include this header (it needs nlohmann-json, like io/).
///
/// Per-layer tensors of each memory (float32; `hidden` is the model's hidden size, Hq, Hkv, D its query
/// heads, kv-heads and head_dim; names after the prefix `layers.<L>.`):
///
/// | memory | tensor        | shape          | meaning (source)                                              |
/// |--------|---------------|----------------|---------------------------------------------------------------|
/// | kvm    | `gate_weight` | [hidden, Hkv]  | W_g: merge-gate pre-activation z = x . W_g of the attention input x (spec KVM.md §1, §2: g = 1 + ELU(z)) |
/// | kvm    | `ln_weight`, `ln_bias` | [D]   | affine of the state-key LayerNorm LN_s (spec KVM.md §1, §2)       |
/// | kvm    | `tau_state`, `tau_window` | [Hq] | inverse temperatures of state rows and window keys (spec KVM.md §3) |
/// | ovq    | `beta`        | [Hq]           | logit scale beta sqrt(D) (spec OVQ.md §1, §2)                 |
/// | kvpop  | `w_q` ... `theta` | score::MLstmWeights | the mLSTM scorer per kv-head (kvpop-paper App. B; spec EVICTION.md §3) |
///
/// A file with low-rank adapters (shape.adapter_rank > 0) also holds `q_adapter_down` [r, hidden],
/// `q_adapter_up` [Hq*D, r], `k_adapter_down` [r, hidden], `k_adapter_up` [Hkv*D, r]: they change the
/// model's q and k projections (W x + up (down x), before RoPE), which is the engine's code, not the
/// memory's; the loaders here read the memory's tensors only.

#include <Kokkos_Core.hpp>
#include <string>
#include <vector>

#include "../errors.hpp"
#include "../eviction_config.hpp"
#include "../io/memory_weights.hpp"
#include "layer_weights.hpp"
#include "score/mlstm_weights.hpp"

namespace kvmem {

namespace detail {
/// A float32 view of `MemorySpace` holding `values` (host), labelled `name`.
template <class MemorySpace>
Kokkos::View<const float*, MemorySpace> to_vector_view(const std::vector<float>& values, const std::string& name) {
  Kokkos::View<float*, MemorySpace> v(name, values.size());
  Kokkos::deep_copy(v, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(values.data(), values.size()));
  return v;
}
}  // namespace detail

/// KVM's trained parameters of one layer: the LayerWeights a Memory takes (views of `MemorySpace`) and the
/// merge-gate weights W_g [hidden, Hkv] (host, row-major), which turn the layer's attention input x
/// [tokens, hidden] into the gate pre-activations z = x . W_g [tokens, Hkv] the memory reads per token
/// (merge_gate_preactivation).
template <class MemorySpace>
struct TrainedKvmLayer {
  LayerWeights<MemorySpace> weights;
  std::vector<float> gate_weight;  ///< W_g, [hidden, Hkv] row-major
  long hidden = 0;                 ///< features of the attention input x
  long kv_heads = 0;               ///< Hkv
};

/// Layer `layer` of a KVM weights file (memory "kvm"). Throws kvmem::invalid_argument naming the file and
/// the tensor for a layer the file does not have, a missing tensor or one whose dtype is not F32 or whose
/// shape is not the table's for the file's shape metadata.
template <class MemorySpace>
TrainedKvmLayer<MemorySpace> load_kvm_layer(const io::MemoryWeightsFile& file, long layer) {
  require(file.memory() == "kvm", "weights file '" + file.path() + "' metadata memory", file.memory(),
          "load_kvm_layer reads KVM weights (memory kvm)");
  const auto& s = file.shape();
  const auto vec = [&](const char* name, long n) {
    return detail::to_vector_view<MemorySpace>(file.layer_tensor(layer, name, {n}), name);
  };
  TrainedKvmLayer<MemorySpace> out;
  out.gate_weight = file.layer_tensor(layer, "gate_weight", {s.hidden, s.kv_heads});
  out.hidden = s.hidden;
  out.kv_heads = s.kv_heads;
  out.weights = {vec("ln_weight", s.head_dim), vec("ln_bias", s.head_dim), vec("tau_state", s.query_heads),
                 vec("tau_window", s.query_heads)};
  return out;
}

/// The merge-gate pre-activations z[b, h, t] = sum_c x[b, t, c] W_g[c, h] of the attention input x
/// [B, T, hidden] (host, row-major), as the [B, Hkv, T] array a KVM memory reads (spec KVM.md §1: z_t = x_t . W_g[:, h]), summed
/// in float64 and rounded once to float32. Throws kvmem::invalid_argument naming `x` when its size is not
/// B * T * hidden.
template <class MemorySpace>
std::vector<float> merge_gate_preactivation(const TrainedKvmLayer<MemorySpace>& kvm, const std::vector<float>& x, long B,
                                            long T) {
  const long H = kvm.kv_heads, C = kvm.hidden;
  require(static_cast<long>(x.size()) == B * T * C, "x size", x.size(),
          "must be B * T * hidden = " + std::to_string(B) + " * " + std::to_string(T) + " * " + std::to_string(C));
  std::vector<float> z(static_cast<std::size_t>(B * H * T));
  for (long b = 0; b < B; ++b)
    for (long t = 0; t < T; ++t)
      for (long h = 0; h < H; ++h) {
        double sum = 0;
        for (long c = 0; c < C; ++c)
          sum += static_cast<double>(x[static_cast<std::size_t>((b * T + t) * C + c)]) *
                 kvm.gate_weight[static_cast<std::size_t>(c * H + h)];
        z[static_cast<std::size_t>((b * H + h) * T + t)] = static_cast<float>(sum);
      }
  return z;
}

/// Layer `layer` of an OVQ weights file (memory "ovq") as the LayerWeights an OvqMemory takes: beta [Hq] as
/// both temperatures (tau_state = tau_window = beta; no LayerNorm). Throws kvmem::invalid_argument as
/// load_kvm_layer.
template <class MemorySpace>
LayerWeights<MemorySpace> load_ovq_layer(const io::MemoryWeightsFile& file, long layer) {
  require(file.memory() == "ovq", "weights file '" + file.path() + "' metadata memory", file.memory(),
          "load_ovq_layer reads OVQ weights (memory ovq)");
  const auto beta = detail::to_vector_view<MemorySpace>(file.layer_tensor(layer, "beta", {file.shape().query_heads}), "beta");
  return {{}, {}, beta, beta};
}

/// Layer `layer` of a KVPOP weights file (memory "kvpop") as the mLSTM scorer's weights for an eviction
/// memory configured by `cfg`. Throws kvmem::invalid_argument naming the file, the layer or the tensor as
/// load_kvm_layer and score::load_mlstm_weights.
template <class MemorySpace>
score::MLstmWeights<MemorySpace> load_kvpop_layer(const io::MemoryWeightsFile& file, long layer, const EvictionConfig& cfg) {
  require(file.memory() == "kvpop", "weights file '" + file.path() + "' metadata memory", file.memory(),
          "load_kvpop_layer reads KVPOP weights (memory kvpop)");
  file.expect_layer(layer);
  return score::load_mlstm_weights<MemorySpace>(file.file(), cfg, io::MemoryWeightsFile::layer_prefix(layer));
}

}  // namespace kvmem
