#pragma once
/// \file gradient_descent.hpp
/// merge::GradientDescent — Trellis's merge: every token updates all m memory slots by one step of
/// online gradient descent on ||phi(M k) - alpha||^2 with a forget gate (trellis-paper Sec. 3, eqs. 4-14;
/// spec TRELLIS.md §2-§4). This header holds the per-vector math: the inner-loss nonlinearity phi, its
/// closed-form vector-Jacobian products (no autodiff) and the intermediate activation f between the two
/// passes. The memory that runs it is kvmem::TrellisMemory (trellis_memory.hpp).
///
/// GradientDescent is not a merge::MergePolicy of the row-based Memory facade: Trellis has a fixed number
/// of slots that every token rewrites, no growing rows, no budget schedule and no eviction scorer.

#include <Kokkos_Core.hpp>
#include <string>
#include <string_view>

#include "../../dtype.hpp"
#include "../../errors.hpp"

namespace kvmem::merge {

/// The nonlinearity phi of the inner loss L_t(M) = ||phi(M k_t) - alpha_t||^2 and of the pass-2 readout
/// phi(M2_t^T p_t) (spec TRELLIS.md §2.3; the paper never names it, §7 A1). Applied element-wise, except
/// softmax, which normalizes over the whole vector (the m slots in the loss, the Dv channels in the readout).
enum class Phi : int {
  identity = 0,  ///< phi(z) = z: the gated delta rule (paper ablation "Linear").
  silu = 1,      ///< phi(z) = z * sigmoid(z) (spec default, §7 A1).
  softmax = 2,   ///< phi(z) = exp(z) / sum exp(z).
  tanh = 3,      ///< phi(z) = tanh(z).
  sigmoid = 4,   ///< phi(z) = 1 / (1 + exp(-z)).
};

/// The intermediate activation f between the passes, p_t = f(yhat_t) over the m slots (spec TRELLIS.md §4.1).
enum class Activation : int {
  ln_silu = 0,   ///< LayerNorm(SiLU(y)): biased variance, eps inside the sqrt, optional per-slot affine (default).
  l2_silu = 1,   ///< SiLU(y) / max(||SiLU(y)||_2, eps) (F.normalize semantics).
  softmax = 2,   ///< softmax(y) (ABC/GSA style).
  identity = 3,  ///< p = y (tests).
};

/// Names accepted by parse_phi, in enum order.
inline constexpr std::string_view phi_names[] = {"identity", "silu", "softmax", "tanh", "sigmoid"};
/// Names accepted by parse_activation, in enum order ("ln_silu" and "l2_silu" are accepted as well).
inline constexpr std::string_view activation_names[] = {"ln-silu", "l2-silu", "softmax", "identity"};

/// True when `phi` is one of the enumerators (a value cast from an int may not be).
[[nodiscard]] constexpr bool is_valid(Phi phi) {
  return static_cast<int>(phi) >= 0 && static_cast<int>(phi) <= static_cast<int>(Phi::sigmoid);
}
/// True when `f` is one of the enumerators.
[[nodiscard]] constexpr bool is_valid(Activation f) {
  return static_cast<int>(f) >= 0 && static_cast<int>(f) <= static_cast<int>(Activation::identity);
}
/// "silu", ... (spec TRELLIS.md §2.3 names); "?" for an invalid value.
[[nodiscard]] constexpr std::string_view name_of(Phi phi) { return is_valid(phi) ? phi_names[static_cast<int>(phi)] : "?"; }
/// "ln-silu", ... (the `kvmem-run trellis --f` names); "?" for an invalid value.
[[nodiscard]] constexpr std::string_view name_of(Activation f) {
  return is_valid(f) ? activation_names[static_cast<int>(f)] : "?";
}

/// Phi from its name (identity, silu, softmax, tanh, sigmoid). Throws kvmem::invalid_argument
/// "`parameter` = name: unknown ..." for any other name.
[[nodiscard]] inline Phi parse_phi(std::string_view name, const std::string& parameter = "phi") {
  for (int i = 0; i < 5; ++i)
    if (name == phi_names[i]) return static_cast<Phi>(i);
  throw invalid_argument(detail::describe(parameter, name, "unknown phi; expected identity, silu, softmax, tanh or sigmoid"));
}
/// Activation from its name (ln-silu, l2-silu, softmax, identity; ln_silu and l2_silu too). Throws
/// kvmem::invalid_argument "`parameter` = name: unknown ..." for any other name.
[[nodiscard]] inline Activation parse_activation(std::string_view name, const std::string& parameter = "f") {
  if (name == "ln_silu") return Activation::ln_silu;
  if (name == "l2_silu") return Activation::l2_silu;
  for (int i = 0; i < 4; ++i)
    if (name == activation_names[i]) return static_cast<Activation>(i);
  throw invalid_argument(
      detail::describe(parameter, name, "unknown activation f; expected ln-silu, l2-silu, softmax or identity"));
}

/// Trellis's merge: the math of one gradient step and of the readouts, as static functions usable on the
/// host and on any Kokkos device. Each works on one contiguous float32 vector in a fixed order, so a
/// result has the same bits on every run of a backend.
struct GradientDescent {
  static constexpr std::string_view name = "trellis";

  /// sigmoid(z) = 1 / (1 + exp(-z)), branched on the sign so exp never overflows (spec §2.3).
  KOKKOS_INLINE_FUNCTION static float sigmoid(float z) {
    if (z >= 0.0f) return 1.0f / (1.0f + Kokkos::exp(-z));
    const float e = Kokkos::exp(z);
    return e / (1.0f + e);
  }
  /// SiLU(z) = z * sigmoid(z).
  KOKKOS_INLINE_FUNCTION static float silu(float z) { return z * sigmoid(z); }

  /// x <- softmax(x) over n entries (max-subtracted; sums in increasing index order). n >= 1.
  KOKKOS_INLINE_FUNCTION static void softmax(float* x, int n) {
    float top = x[0];
    for (int i = 1; i < n; ++i) top = x[i] > top ? x[i] : top;
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      x[i] = Kokkos::exp(x[i] - top);
      sum += x[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; ++i) x[i] *= inv;
  }

  /// x <- phi(x) over n entries, in place (spec TRELLIS.md §2.3 table, column phi(z)).
  KOKKOS_INLINE_FUNCTION static void apply_phi(Phi phi, float* x, int n) {
    switch (phi) {
      case Phi::identity: break;
      case Phi::silu:
        for (int i = 0; i < n; ++i) x[i] = silu(x[i]);
        break;
      case Phi::softmax: softmax(x, n); break;
      case Phi::tanh:
        for (int i = 0; i < n; ++i) x[i] = Kokkos::tanh(x[i]);
        break;
      case Phi::sigmoid:
        for (int i = 0; i < n; ++i) x[i] = sigmoid(x[i]);
        break;
    }
  }

  /// out = J_phi(z)^T e over n entries: the vector-Jacobian product of phi at z with the cotangent e
  /// (spec TRELLIS.md §2.3 table, column J^T e; closed forms, no autodiff):
  ///   identity e;  silu e*s*(1 + z*(1 - s)) with s = sigmoid(z);  tanh e*(1 - tanh(z)^2);
  ///   sigmoid e*s*(1 - s);  softmax p*(e - <p, e>) with p = softmax(z).
  /// `out` may alias `e` but not `z`.
  KOKKOS_INLINE_FUNCTION static void vjp(Phi phi, const float* z, const float* e, float* out, int n) {
    switch (phi) {
      case Phi::identity:
        for (int i = 0; i < n; ++i) out[i] = e[i];
        break;
      case Phi::silu:
        for (int i = 0; i < n; ++i) {
          const float s = sigmoid(z[i]);
          out[i] = e[i] * s * (1.0f + z[i] * (1.0f - s));
        }
        break;
      case Phi::tanh:
        for (int i = 0; i < n; ++i) {
          const float t = Kokkos::tanh(z[i]);
          out[i] = e[i] * (1.0f - t * t);
        }
        break;
      case Phi::sigmoid:
        for (int i = 0; i < n; ++i) {
          const float s = sigmoid(z[i]);
          out[i] = e[i] * s * (1.0f - s);
        }
        break;
      case Phi::softmax: {
        float top = z[0];
        for (int i = 1; i < n; ++i) top = z[i] > top ? z[i] : top;
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) sum += Kokkos::exp(z[i] - top);
        const float inv = 1.0f / sum;
        float pe = 0.0f;
        for (int i = 0; i < n; ++i) pe += Kokkos::exp(z[i] - top) * inv * e[i];
        for (int i = 0; i < n; ++i) out[i] = Kokkos::exp(z[i] - top) * inv * (e[i] - pe);
        break;
      }
    }
  }

  /// The inner-loss gradient with respect to z = M k (spec TRELLIS.md §2.2, trellis-paper eq. 6):
  ///   u = grad_scale * J_phi(z)^T (phi(z) - alpha),
  /// in place over the m slots: `zu` holds z on entry and u on return. grad_scale is 2 for the true
  /// gradient of ||phi(z) - alpha||^2 (§7 A2). With phi = softmax and m = 1, u = 0 exactly. `alpha` [m] of
  /// any storage type (read through to_float).
  template <class A>
  KOKKOS_INLINE_FUNCTION static void loss_gradient(Phi phi, float* zu, const A* alpha_in, int m, float grad_scale) {
    auto alpha = [&](int i) { return to_float(alpha_in[i]); };
    switch (phi) {
      case Phi::identity:
        for (int i = 0; i < m; ++i) zu[i] = grad_scale * (zu[i] - alpha(i));
        break;
      case Phi::silu:
        for (int i = 0; i < m; ++i) {
          const float z = zu[i], s = sigmoid(z);
          zu[i] = grad_scale * ((z * s - alpha(i)) * s * (1.0f + z * (1.0f - s)));
        }
        break;
      case Phi::tanh:
        for (int i = 0; i < m; ++i) {
          const float t = Kokkos::tanh(zu[i]);
          zu[i] = grad_scale * ((t - alpha(i)) * (1.0f - t * t));
        }
        break;
      case Phi::sigmoid:
        for (int i = 0; i < m; ++i) {
          const float s = sigmoid(zu[i]);
          zu[i] = grad_scale * ((s - alpha(i)) * s * (1.0f - s));
        }
        break;
      case Phi::softmax: {
        softmax(zu, m);  // zu = p
        float pe = 0.0f;
        for (int i = 0; i < m; ++i) pe += zu[i] * (zu[i] - alpha(i));
        for (int i = 0; i < m; ++i) zu[i] = grad_scale * (zu[i] * ((zu[i] - alpha(i)) - pe));
        break;
      }
    }
  }

  /// p <- f(y) over the m slots, in place (spec TRELLIS.md §4.1):
  /// - ln_silu: a = SiLU(y); p = (a - mean(a)) / sqrt(var(a) + ln_eps) [* weight + bias], biased variance,
  ///   two-pass statistics; `weight`/`bias` are [m] or nullptr for no affine. With m = 1, p = bias (0).
  /// - l2_silu: a = SiLU(y); p = a / max(||a||_2, l2_eps).
  /// - softmax: p = softmax(y).  identity: p = y.
  KOKKOS_INLINE_FUNCTION static void activate(Activation f, float* y, int m, float ln_eps, float l2_eps,
                                              const float* weight, const float* bias) {
    switch (f) {
      case Activation::ln_silu: {
        float mean = 0.0f;
        for (int i = 0; i < m; ++i) {
          y[i] = silu(y[i]);
          mean += y[i];
        }
        mean /= static_cast<float>(m);
        float var = 0.0f;
        for (int i = 0; i < m; ++i) var += (y[i] - mean) * (y[i] - mean);
        var /= static_cast<float>(m);
        const float inv = 1.0f / Kokkos::sqrt(var + ln_eps);
        for (int i = 0; i < m; ++i) {
          const float x = (y[i] - mean) * inv;
          y[i] = weight != nullptr ? x * weight[i] + bias[i] : x;
        }
        break;
      }
      case Activation::l2_silu: {
        float sq = 0.0f;
        for (int i = 0; i < m; ++i) {
          y[i] = silu(y[i]);
          sq += y[i] * y[i];
        }
        const float norm = Kokkos::sqrt(sq);
        const float inv = 1.0f / (norm > l2_eps ? norm : l2_eps);
        for (int i = 0; i < m; ++i) y[i] *= inv;
        break;
      }
      case Activation::softmax: softmax(y, m); break;
      case Activation::identity: break;
    }
  }
};

}  // namespace kvmem::merge
