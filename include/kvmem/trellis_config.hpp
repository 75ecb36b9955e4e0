#pragma once
/// \file trellis_config.hpp
/// Runtime parameters of a Trellis memory (spec TRELLIS.md §1, §6) and its optional learned weights.

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>

#include "errors.hpp"
#include "policy/merge/gradient_descent.hpp"

namespace kvmem {

/// Shape and numerics of one layer's Trellis memory (trellis-paper Sec. 3; spec TRELLIS.md §1, §6, §7).
///
/// Units: `slots` is memory slots per head (m), `head_dim`/`value_dim` are channels (dk = D, dv = Dv),
/// `chunk` is tokens (C). The state of every (sequence, head) is M1 [m, D] and M2 [m, Dv] float32.
struct TrellisConfig {
  int slots = 0;       ///< m: memory slots per head (paper: 64 at 125M; §7 A10).
  int head_dim = 0;    ///< D = dk: channels of a query and a key.
  int value_dim = 0;   ///< Dv = dv: channels of a value and of the output y.
  int heads = 0;       ///< H: heads, each with its own M1 and M2.
  int chunk = 16;      ///< C: tokens per chunk of the stale-gradient prefill (§3.2/3.3, §7 A8); decode is C = 1.
  merge::Phi phi = merge::Phi::silu;                         ///< inner-loss nonlinearity (§2.3, §7 A1).
  merge::Activation f = merge::Activation::ln_silu;          ///< intermediate activation p = f(yhat) (§4.1).
  bool readout2_phi = true;  ///< pass-2 readout phi(M2^T p) (true, literal eq. 14) or M2^T p (§2.4, §7 A6).
  float grad_scale = 2.0f;   ///< u = grad_scale * J^T e; 2 = the true gradient (§2.2, §7 A2).
  float ln_eps = 1e-5f;      ///< epsilon inside the sqrt of the LN-SiLU LayerNorm (§4.1).
  float l2_eps = 1e-12f;     ///< epsilon of the L2-SiLU norm guard max(||a||, eps) (§4.1).
  /// Check every forget gate beta in [0, 1] and step size gamma in [0, inf) before running (a device
  /// reduction and one device-to-host read per call). Engines that trust their gates turn it off.
  bool check_gates = true;

  /// Throws kvmem::invalid_argument("field = value: reason") naming the first bad field.
  void validate() const {
    require(slots >= 1, "slots", slots, "must be >= 1 (m, memory slots per head)");
    require(head_dim >= 1, "head_dim", head_dim, "must be >= 1");
    require(value_dim >= 1, "value_dim", value_dim, "must be >= 1");
    require(heads >= 1, "heads", heads, "must be >= 1");
    require(chunk >= 1, "chunk", chunk, "must be >= 1 (C, tokens per prefill chunk)");
    require(merge::is_valid(phi), "phi", static_cast<int>(phi),
            "unknown phi; expected identity, silu, softmax, tanh or sigmoid");
    require(merge::is_valid(f), "f", static_cast<int>(f), "unknown activation f; expected ln-silu, l2-silu, softmax or identity");
    require(std::isfinite(grad_scale) && grad_scale > 0.0f, "grad_scale", grad_scale, "must be finite and > 0");
    require(std::isfinite(ln_eps) && ln_eps > 0.0f, "ln_eps", ln_eps, "must be finite and > 0");
    require(std::isfinite(l2_eps) && l2_eps > 0.0f, "l2_eps", l2_eps, "must be finite and > 0");
  }
};

/// Optional learned per-slot affine of the LN-SiLU LayerNorm (spec TRELLIS.md §4.1, §7 A7):
/// p = LN(SiLU(yhat)) * ln_weight + ln_bias, both [m], shared by the heads. Leave both empty for none
/// (what kvmem-run and the float64 reference use).
template <class MemorySpace>
struct TrellisWeights {
  Kokkos::View<const float*, MemorySpace> ln_weight;  ///< [m] or empty
  Kokkos::View<const float*, MemorySpace> ln_bias;    ///< [m] or empty

  /// True when an affine is given.
  [[nodiscard]] bool has_affine() const { return ln_weight.data() != nullptr || ln_bias.data() != nullptr; }

  /// Throws kvmem::invalid_argument unless both views are empty, or both are [m] with f = ln-silu.
  void validate(const TrellisConfig& cfg) const {
    if (!has_affine()) return;
    require(ln_weight.data() != nullptr && ln_bias.data() != nullptr, "ln_weight/ln_bias",
            ln_weight.data() != nullptr ? "ln_bias empty" : "ln_weight empty", "give both or neither");
    require(static_cast<long>(ln_weight.extent(0)) == cfg.slots, "ln_weight.extent(0)", ln_weight.extent(0),
            "must equal the slot count m = " + std::to_string(cfg.slots));
    require(static_cast<long>(ln_bias.extent(0)) == cfg.slots, "ln_bias.extent(0)", ln_bias.extent(0),
            "must equal the slot count m = " + std::to_string(cfg.slots));
    require(cfg.f == merge::Activation::ln_silu, "f", merge::name_of(cfg.f),
            "ln_weight/ln_bias are the LN-SiLU affine; use f = ln-silu or give no weights");
  }
};

}  // namespace kvmem
