#pragma once
/// \file winner_take_all.hpp
/// merge::WinnerTakeAll — KVM's gated winner-take-all merge (kvm-paper Sec. 4 eqs. for K_i, V_i and
/// the merge gate; spec KVM.md §2, §3, §5.5).

#include "../../math/vector_ops.hpp"
#include "defaults.hpp"

namespace kvmem::merge {

/// Key-Value Means: every overflow token is added, weighted by its merge gate g = 1 + ELU(z), to the
/// running sums (K_i, V_i) of the state row whose normalized key it matches best. Keys are read through a
/// just-in-time LayerNorm LN_s (learned affine shared by the heads, eps MemoryConfig::ln_eps); values are
/// read at the radius rho_i stored when the row was created: rho_i * V_i / max(||V_i||, eps). The first
/// chunk's tokens become rows verbatim, appended rows are valid merge targets, and a block folds in when
/// it leaves the block sliding window.
struct WinnerTakeAll : Defaults {
  static constexpr std::string_view name = "kvm";
  static constexpr bool first_chunk_verbatim = true;
  static constexpr bool route_after_append = true;
  static constexpr bool uses_layer_norm = true;

  /// kbar = LN_s(k with channels [0, rope_dims) set to 0), [D] (spec KVM.md §2 "Memory key").
  template <class In>
  KOKKOS_INLINE_FUNCTION static void memory_key(const MemoryConfig& cfg, const LayerWeightsRef& w, const In* k,
                                                float* out) {
    kernels::layer_norm(k, cfg.head_dim, cfg.rope_dims, w.ln_weight, w.ln_bias, cfg.ln_eps, out);
  }
  /// Khat = LN_s(K), [D] (spec KVM.md §3).
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void read_key(const MemoryConfig& cfg, const LayerWeightsRef& w, const Row& row,
                                              Out* out) {
    kernels::layer_norm(row.key, cfg.head_dim, 0, w.ln_weight, w.ln_bias, cfg.ln_eps, out);
  }
  /// Vhat = radius * V / max(||V||_2, norm_eps), [Dv] (spec KVM.md §3; a zero row reads as zeros, §9 #9).
  /// Stored in the memory's storage type, a finite value saturating at its range (from_float).
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void read_value(const MemoryConfig& cfg, const Row& row, Out* out) {
    const float norm = kernels::norm2(row.value, cfg.value_dim);
    const float scale = *row.radius / (norm > cfg.norm_eps ? norm : cfg.norm_eps);
    for (int c = 0; c < cfg.value_dim; ++c) out[c] = from_float<Out>(row.value[c] * scale);
  }
  /// g = 1 + ELU(z): 1 + z for z > 0, else 1 + expm1(z) = exp(z) (spec KVM.md §2).
  KOKKOS_INLINE_FUNCTION static float gate(float z) { return z > 0.0f ? 1.0f + z : 1.0f + Kokkos::expm1(z); }
};
static_assert(MergePolicy<WinnerTakeAll>);

}  // namespace kvmem::merge
