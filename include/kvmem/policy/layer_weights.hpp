#pragma once
/// \file layer_weights.hpp
/// Learned per-layer parameters that policies and the readout read, as views and as raw pointers.

#include <Kokkos_Core.hpp>

#include "../config.hpp"
#include "../errors.hpp"

namespace kvmem {

/// Learned parameters of one layer's memory (kvm-paper Sec. 4; spec KVM.md §1), as device views:
/// - `ln_weight`, `ln_bias` [D]: affine of the state-key LayerNorm LN_s, shared by the heads of a layer
///   (init 1 and 0);
/// - `tau_state`, `tau_window` [Hq]: inverse temperatures that multiply state keys and window keys at
///   readout (init 1; pass ones to disable).
template <class MemorySpace>
struct LayerWeights {
  using vector = Kokkos::View<const float*, MemorySpace>;
  vector ln_weight, ln_bias, tau_state, tau_window;

  /// Throws kvmem::invalid_argument naming the view whose extent does not match `cfg`; ln_weight and
  /// ln_bias are checked only when `uses_layer_norm`.
  void validate(const MemoryConfig& cfg, bool uses_layer_norm = true) const {
    auto check = [](const vector& v, const char* name, long want, const char* what) {
      require(static_cast<long>(v.extent(0)) == want, std::string(name) + ".extent(0)", v.extent(0),
              std::string("must equal ") + what + " = " + std::to_string(want));
    };
    if (uses_layer_norm) {
      check(ln_weight, "ln_weight", cfg.head_dim, "head_dim");
      check(ln_bias, "ln_bias", cfg.head_dim, "head_dim");
    }
    check(tau_state, "tau_state", cfg.query_heads, "query_heads");
    check(tau_window, "tau_bswa", cfg.query_heads, "query_heads");
  }
};

/// The same parameters as raw device pointers, cheap to capture in kernels.
struct LayerWeightsRef {
  const float* ln_weight = nullptr;
  const float* ln_bias = nullptr;
  const float* tau_state = nullptr;
  const float* tau_window = nullptr;

  template <class MemorySpace>
  static LayerWeightsRef of(const LayerWeights<MemorySpace>& w) {
    return {w.ln_weight.data(), w.ln_bias.data(), w.tau_state.data(), w.tau_window.data()};
  }
};

}  // namespace kvmem
