#pragma once
// Small float64 helpers shared by the naive C++ references: sigmoid, log-sigmoid, softmax and log-sum-exp, written for
// clarity and without overflow.

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvmem_ref::math {

using Vec = std::vector<double>;

inline double sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z)); }
inline double log_sigmoid(double z) { return z >= 0 ? -std::log1p(std::exp(-z)) : z - std::log1p(std::exp(z)); }

/// softmax(z) [n], max subtracted first.
inline Vec softmax(const Vec& z) {
  const double top = *std::max_element(z.begin(), z.end());
  Vec p(z.size());
  double s = 0;
  for (std::size_t i = 0; i < z.size(); ++i) s += (p[i] = std::exp(z[i] - top));
  for (auto& x : p) x /= s;
  return p;
}

/// log sum_i exp(z_i) (n >= 1), max subtracted first.
inline double log_sum_exp(const Vec& z) {
  const double top = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (double x : z) s += std::exp(x - top);
  return top + std::log(s);
}

}  // namespace kvmem_ref::math
