// The per-thread building blocks of the update kernels (math/vector_ops.hpp) and the novelty score
// that uses them: several rows scored at once must give the bits of one `dot` per row, because prefill
// and decode, and every backend, must route and rank tokens identically (spec KVM.md §5.3, §5.5).
#include <catch2/catch_test_macros.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "float_bits.hpp"

namespace {
using kvmem_test::same_bits;
using kvmem_test::uniform;
}  // namespace

TEST_CASE("dot_rows gives the bits of one dot per row", "[vector_ops][update]") {
  for (int dim : {1, 7, 64, 128}) {
    const long stride = dim + 3;  // rows with padding: the stride is honoured
    const auto a = uniform(dim, 1 + dim), rows = uniform(8 * stride, 2 + dim);
    for (float g : {1.0f, 0.37f, -2.5f}) {
      std::vector<float> ga(dim);
      for (int c = 0; c < dim; ++c) ga[c] = g * a[c];
      float s8[8], s1 = 0.0f;
      kvmem::kernels::dot_rows<8>(a.data(), g, rows.data(), stride, dim, s8);
      for (int r = 0; r < 8; ++r) {
        const float one = kvmem::kernels::dot(ga.data(), rows.data() + r * stride, dim);
        CHECK(same_bits(s8[r], one));
        kvmem::kernels::dot_rows<1>(a.data(), g, rows.data() + r * stride, 0, dim, &s1);
        CHECK(same_bits(s1, one));
        double ref = 0.0;  // and it is the dot product, to float rounding
        for (int c = 0; c < dim; ++c) ref += double(g) * a[c] * rows[r * stride + c];
        CHECK(std::abs(one - ref) <= 1e-5 * dim);
      }
    }
  }
}

TEST_CASE("the novelty score is the maximum dot over the rows in row order", "[vector_ops][score]") {
  const int dim = 24;
  const auto key = uniform(dim, 11), rows = uniform(40 * dim, 12);
  auto naive = [&](const float* k, const float* r, long n) {
    float best = -std::numeric_limits<float>::infinity();
    for (long i = 0; i < n; ++i) {
      const float s = kvmem::kernels::dot(k, r + i * dim, dim);
      best = s > best ? s : best;
    }
    return best;
  };
  for (long n = 0; n <= 40; ++n)  // no rows, fewer than a pass of 8, whole passes and tails
    CHECK(same_bits(kvmem::score::Novelty::score(key.data(), rows.data(), n, dim), naive(key.data(), rows.data(), n)));
  CHECK(kvmem::score::Novelty::score(key.data(), rows.data(), 0, dim) == -std::numeric_limits<float>::infinity());

  // A NaN row (a non-finite key) never wins, in a pass of 8 or in the tail.
  auto with_nan = rows;
  with_nan[3 * dim] = std::numeric_limits<float>::quiet_NaN();
  with_nan[37 * dim] = std::numeric_limits<float>::quiet_NaN();
  for (long n : {5L, 8L, 16L, 40L})
    CHECK(same_bits(kvmem::score::Novelty::score(key.data(), with_nan.data(), n, dim),
                    naive(key.data(), with_nan.data(), n)));
}
