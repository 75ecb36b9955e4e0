#pragma once
// Helpers of the bit-exactness tests: seeded uniform inputs and a bitwise float/double comparison.
#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

namespace kvmem_test {
/// n floats uniform in [-1, 1) from a fixed seed.
inline std::vector<float> uniform(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = u(rng);
  return x;
}
/// a and b have the same bits (so -0 differs from +0, and a NaN equals itself).
inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }
/// The same for float64.
inline bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }
}  // namespace kvmem_test
