#pragma once
// The error bound of an attention output computed from tokens held in a storage type, against float64
// (docs/numerics.md, "The bound"): shared by the storage-type tests of exact attention, KVM and OVQ.
#include <cmath>

namespace kvmem_test {

/// gamma(n) = n u / (1 - n u) with float32's unit roundoff u = 2^-24: the relative error of a float32 sum
/// or dot product of n terms (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1).
inline double gamma32(double n) {
  const double u = 0x1p-24;
  return n * u / (1.0 - n * u);
}

/// What the bound needs to know of one attention read.
struct StorageBound {
  double u = 0.0;          ///< unit roundoff of the storage type (output and held-value rounding)
  double u_keys = 0.0;     ///< relative error of the keys the memory holds (u where it rounds them, else 0)
  double u_values = 0.0;   ///< relative error of the values the memory holds (u where it rounds them, else 0)
  double head_dim = 1.0;   ///< D: terms of a logit's dot product
  double keys = 1.0;       ///< n: keys a query reads (terms of the softmax sums)
  double logit_abs = 0.0;  ///< max over a query and a key of scale * sum_c |q_c k_c| (bounds |logit|)
  double value_max = 0.0;  ///< V: the largest |value element| a query can read

  /// |y - y_ref| <= (e^{2E} - 1)(1 + u_values) V + u_values V + u V + 2 gamma(n + D + 4) V with
  /// E = (u_keys + gamma(D)) logit_abs: E bounds each logit's error, the softmax weights then move by a
  /// factor in [e^{-2E}, e^{2E}], the held values by u_values, the float32 exponentials and sums by
  /// gamma(n + 4) (D more for the float32 arithmetic that made the held rows), and the stored output by u.
  [[nodiscard]] double value() const {
    const double E = (u_keys + gamma32(head_dim)) * logit_abs;
    return (std::expm1(2.0 * E) * (1.0 + u_values) + u_values + u + 2.0 * gamma32(keys + head_dim + 4.0)) * value_max;
  }
};

}  // namespace kvmem_test
