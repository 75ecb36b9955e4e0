// SnapKV's ranking (kernels/eviction/snapkv.hpp): every (sequence, kv-head)'s prefix tokens ordered by pooled score,
// highest first, ties to the newer token, NaN as -inf (spec EVICTION.md §6 "SnapKV"). Both paths -- the
// portable team sort and the dispatching snapkv_rank, which is CUB's segmented radix sort on Kokkos::Cuda
// (backend/cuda/snapkv_rank.hpp) -- must give std::sort's order under the same comparison, on scores with
// many exact ties, NaN, -0.0 and +0.0, and ragged lengths, so the CUB fast path selects what the portable
// path selects wherever a GPU runs this test.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <kvmem/eviction.hpp>

namespace {

using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;

/// The ranking's definition, on the host: prefix tokens [0, prefix) by (score desc, token desc), NaN as -inf.
std::vector<long> expected_order(const std::vector<double>& scores, long prefix) {
  auto key = [](double x) { return std::isnan(x) ? -std::numeric_limits<double>::infinity() : x; };
  std::vector<long> order(prefix);
  std::iota(order.begin(), order.end(), 0L);
  std::sort(order.begin(), order.end(), [&](long a, long b) {
    return key(scores[a]) > key(scores[b]) || (key(scores[a]) == key(scores[b]) && a > b);
  });
  return order;
}

struct RankCase {
  long B = 3, H = 2, T = 300, window = 7, top_k = 20;
  std::vector<long> lengths{300, 31, 150};
  std::vector<double> scores;  // [B, H, T]

  void generate(unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> level(0, 7), special(0, 40);
    scores.resize(B * H * T);
    for (auto& s : scores) {
      const int kind = special(rng);
      if (kind == 0) s = std::numeric_limits<double>::quiet_NaN();
      else if (kind == 1) s = -0.0;
      else if (kind == 2) s = 0.0;
      else if (kind == 3) s = -std::numeric_limits<double>::infinity();
      else s = 0.125 * level(rng);  // eight levels: many exact ties
    }
  }
};

/// Runs `rank` (a callable taking pooled, lengths, order) and checks every head that drops tokens.
template <class Rank>
void check_rank(const RankCase& c, Rank&& rank) {
  Kokkos::View<double***, Kokkos::LayoutRight, mem> pooled("pooled", c.B, c.H, c.T);
  Kokkos::View<long***, Kokkos::LayoutRight, mem> order("order", c.B, c.H, c.T);
  Kokkos::View<long*, mem> lengths("lengths", c.B);
  auto ph = Kokkos::create_mirror_view(pooled);
  auto lh = Kokkos::create_mirror_view(lengths);
  std::copy(c.scores.begin(), c.scores.end(), ph.data());
  for (long b = 0; b < c.B; ++b) lh(b) = c.lengths[b];
  Kokkos::deep_copy(pooled, ph);
  Kokkos::deep_copy(lengths, lh);
  Kokkos::deep_copy(order, -7L);
  rank(pooled, lengths, order);
  exec().fence();
  const auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), order);
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.H; ++h) {
      INFO("sequence " << b << " (length " << c.lengths[b] << "), kv-head " << h);
      const long L = c.lengths[b], prefix = L - c.window;
      if (L <= c.window + c.top_k) {  // nothing dropped: the ranking leaves the head untouched
        for (long t = 0; t < c.T; ++t) REQUIRE(oh(b, h, t) == -7);
        continue;
      }
      const std::vector<double> s(c.scores.begin() + (b * c.H + h) * c.T, c.scores.begin() + (b * c.H + h + 1) * c.T);
      const auto want = expected_order(s, prefix);
      for (long i = 0; i < prefix; ++i) REQUIRE(oh(b, h, i) == want[i]);
    }
}

}  // namespace

TEST_CASE("snapkv ranking: the portable team sort gives the definition's order", "[snapkv][rank]") {
  for (unsigned seed : {1u, 2u, 3u}) {
    RankCase c;
    c.generate(seed);
    check_rank(c, [&](const auto& pooled, const auto& lengths, const auto& order) {
      kvmem::kernels::snapkv_rank_portable(exec(), pooled, lengths, c.window, c.top_k, order);
    });
  }
}

TEST_CASE("snapkv ranking: the backend's path (CUB on Cuda) gives the definition's order", "[snapkv][rank]") {
  for (unsigned seed : {4u, 5u}) {
    RankCase c;
    c.generate(seed);
    kvmem::kernels::SnapKvScratch<mem> scratch;
    scratch.allocate(c.B, c.H, c.H, c.T, c.window);
    check_rank(c, [&](const auto& pooled, const auto& lengths, const auto& order) {
      kvmem::kernels::snapkv_rank(exec(), pooled, lengths, c.window, c.top_k, order, scratch);
    });
  }
}
