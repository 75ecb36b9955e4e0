// Merging eviction (EvictionConfig::merge_evicted): every scorer against the reference in every mode, what
// merging changes, the key cosine, the count's saturation and the bytes it holds.
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

// ---------------------------------------------------------------------------------------------------
// Merging eviction (EvictionConfig::merge_evicted)

TEST_CASE("merging eviction: kernels match the reference for every scorer on the edge cases; all modes give the same bits",
          "[eviction][merge][reference][modes]") {
  for (Kind kind : all_kinds) {
    auto cases = edge_cases(kind);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      // KVPOP's 16 normaliser cases (from index 22: xlstm n = 1, 3, plain n = 1, 3, four each): n = 1 of both
      // normalisers, plain and with the soft cap binding (its reference is O(T^3) with merging).
      if (kind == Kind::kvpop && i >= 22 && i != 22 && i != 24 && i != 30 && i != 32) continue;
      auto c = cases[i];
      c.merge = true;
      check_case(c);
    }
  }
}

TEST_CASE("merging eviction: a split prefill, or one continued in decode, gives the bits of one prefill",
          "[eviction][merge][modes]") {
  for (Kind kind : all_kinds) {
    auto c = thread_case(kind);
    c.merge = true;
    INFO(c.describe());
    const auto whole = run_evict(c, Mode::prefill);
    check_reference(c, whole);
    for (long split : {1L, 5L, 6L, 40L, 41L, 89L}) {
      INFO("split " << split);
      require_same_bits(whole, run_evict(c, Mode::two_prefills, split));
      require_same_bits(whole, run_evict(c, Mode::prefill_then_decode, split));
    }
  }
}

TEST_CASE("merging eviction: merging changes what is read, not which tokens are kept (static scorers)",
          "[eviction][merge]") {
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::given}) {
    auto c = thread_case(kind);
    const auto plain = run_evict(c, Mode::prefill);
    c.merge = true;
    const auto merged = run_evict(c, Mode::prefill);
    INFO(c.describe());
    REQUIRE(merged.kept == plain.kept);   // a static score does not see the merge
    REQUIRE(!same_bits(merged.y, plain.y));  // but the rows and their log-count bias do
  }
}

TEST_CASE("merging eviction: cosine similarity of a zero key is 0, of a NaN key NaN", "[eviction][merge][numerics]") {
  const float zero[4] = {0, 0, 0, 0}, a[4] = {1, 2, 3, 4}, b[4] = {-1, 2, 0.5f, 4};
  const float nan[4] = {1, std::numeric_limits<float>::quiet_NaN(), 0, 0};
  REQUIRE(kvmem::kernels::key_cosine(zero, 0.0f, a, 4) == 0.0f);
  REQUIRE(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), zero, 4) == 0.0f);
  REQUIRE(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), a, 4) == Catch::Approx(1.0f).epsilon(1e-6));
  const double want = (-1 + 4 + 1.5 + 16) / std::sqrt(30.0) / std::sqrt(1 + 4 + 0.25 + 16.0);
  REQUIRE(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), b, 4) == Catch::Approx(want).epsilon(1e-6));
  REQUIRE(std::isnan(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), nan, 4)));
}

TEST_CASE("merging eviction: a row's count saturates at 2^24 tokens and stays a weighted mean",
          "[eviction][merge][numerics]") {
  EvictCase c;
  c.kind = Kind::streaming, c.T = 12, c.Hq = 1, c.Hkv = 1, c.D = 4, c.Dv = 3, c.sinks = 1, c.window = 2, c.top_k = 3;
  c.merge = true;
  c.generate();
  kvmem::EvictionMemory<host_exec, kvmem::score::None> mem(c.config(), 1);
  const auto q = to_device<host_mem>(c.q, 1, 1, c.T, c.D, "q"), k = to_device<host_mem>(c.k, 1, 1, c.T, c.D, "k");
  const auto v = to_device<host_mem>(c.v, 1, 1, c.T, c.Dv, "v");
  view4<host_mem> y("y", 1, 1, c.T, c.Dv);
  const std::vector<long> first{c.T - 1};
  mem.prefill(q, k, v, y, first);  // every token but the last: the cache is full
  const auto& cache = mem.cache();
  const long live = cache.live(0, 0);
  REQUIRE(live == c.budget());
  const float big = kvmem::kernels::max_merge_count - 1.0f;
  for (long i = 0; i < live; ++i) cache.counts(0, 0, cache.order(0, 0, i)) = big;
  std::vector<float> before_keys;
  for (long s = 0; s < cache.slots(); ++s)
    for (int d = 0; d < c.D; ++d) before_keys.push_back(cache.keys(0, 0, s, d));
  auto last = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(c.T - 1, c.T), Kokkos::ALL); };
  mem.decode(last(q), last(k), last(v), last(y));  // one token in, one row merged into another
  float most = 0;
  long merged_slot = -1;
  for (long i = 0; i < cache.live(0, 0); ++i) {
    const int s = cache.order(0, 0, i);
    if (cache.counts(0, 0, s) > most) most = cache.counts(0, 0, s), merged_slot = s;
  }
  REQUIRE(most == kvmem::kernels::max_merge_count);  // big + big clamps to 2^24
  long evicted_slot = -1;  // the freed slot still holds the evicted row's key
  for (long s = 0; s < cache.slots(); ++s)
    if (cache.positions(0, 0, s) < 0) evicted_slot = s;
  REQUIRE(evicted_slot >= 0);
  for (int d = 0; d < c.D; ++d)  // two rows of equal weight: the mean of the two keys
    REQUIRE(cache.keys(0, 0, merged_slot, d) == kvmem::kernels::mul_add(0.5f, before_keys[merged_slot * c.D + d],
                                                                        0.5f * before_keys[evicted_slot * c.D + d]));
  for (long d = 0; d < c.Dv; ++d) REQUIRE(std::isfinite(y(0, 0, c.T - 1, d)));
}

TEST_CASE("merging eviction: held_bytes adds one float32 count per row", "[eviction][merge][budget]") {
  EvictCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.sinks = 2, c.window = 4, c.top_k = 6, c.merge = true;
  c.generate();
  kvmem::EvictionMemory<host_exec, kvmem::score::None> mem(c.config(), static_cast<int>(c.B));
  REQUIRE(mem.held_bytes() == c.B * c.Hkv * 13 * ((c.D + c.Dv) * 4 + 4));
  REQUIRE(static_cast<long>(mem.cache().counts.size()) == c.B * c.Hkv * 13);
}
