// Fixed-budget KV eviction against the naive float64 reference: the worked example of spec §1 through a
// user-defined scorer, the reference against the brute-force top-k, every scorer on the spec's edge cases in
// every mode (decode == prefill == two prefills bit for bit), and bfloat16 / float16 caches.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

// ---------------------------------------------------------------------------------------------------
// The worked example of spec §1, through a user-defined scorer

TEST_CASE("eviction: the spec's worked example through a user-defined scorer", "[eviction][example]") {
  // s = 1, w = 2, k = 2, T = 7, static scores [9, 5, 1, 3, 3, 0, 2], log gamma = 0.
  EvictCase c;
  c.kind = Kind::given;
  c.T = 7, c.Hq = 1, c.Hkv = 1, c.D = 4, c.Dv = 3, c.sinks = 1, c.window = 2, c.top_k = 2;
  c.generate();
  c.given = {9, 5, 1, 3, 3, 0, 2};
  const std::vector<std::vector<long>> spec = {{0},          {0, 1},          {0, 1, 2},      {0, 1, 2, 3},
                                               {0, 1, 2, 3, 4}, {0, 1, 3, 4, 5}, {0, 1, 4, 5, 6}};
  // the reference
  const auto ref = kvmem_ref::evict_decode(c.head(0, 0), c.policy(0, 0));
  REQUIRE(ref.attended == spec);
  REQUIRE(ref.kept == std::vector<long>{0, 1, 4, 5, 6});
  // the memory, token by token and in one prefill
  const auto decoded = run_evict(c, Mode::decode, 0, true);
  REQUIRE(decoded.steps[0] == spec);
  REQUIRE(decoded.kept[0] == std::vector<long>{0, 1, 4, 5, 6});
  REQUIRE(decoded.rows[0] == 5);
  const auto whole = run_evict(c, Mode::prefill);
  REQUIRE(whole.kept[0] == std::vector<long>{0, 1, 4, 5, 6});
  require_same_bits(whole, decoded);
  check_reference(c, whole);
  // the Fenwick mask of §5 gives the same rows
  kvmem::training::RunningTopK mask(c.given, 1, 2, 2);
  for (long q = 0; q < 7; ++q) {
    std::vector<long> row;
    for (long t = 0; t < 7; ++t)
      if (mask.kept(q, t)) row.push_back(t);
    REQUIRE(row == spec[q]);
  }
}

// ---------------------------------------------------------------------------------------------------
// The reference against itself: §4's claim decode == brute force for static scores and n = 1

TEST_CASE("eviction: reference decode equals the brute-force top-k for static scores, n = 1", "[eviction][reference]") {
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::kvpop, Kind::given})
    for (int levels : {0, 3}) {
      EvictCase c;
      c.kind = kind, c.T = 120, c.Hq = 2, c.Hkv = 1, c.sinks = 3, c.window = 5, c.top_k = 9;
      c.given_levels = levels, c.duplicate_keys = levels > 0, c.log_gamma = kind == Kind::given && levels ? -0.5 : 0.0;
      c.seed = 7 + static_cast<unsigned>(kind);
      c.generate();
      INFO(c.describe());
      const auto x = c.head(0, 0);
      const auto p = c.policy(0, 0);
      const auto ref = kvmem_ref::evict_decode(x, p);
      const auto kappa = kvmem_ref::static_keys(x, p);
      for (long q = 0; q < c.T; ++q) REQUIRE(ref.attended[q] == kvmem_ref::topk_row(kappa, c.sinks, c.window, c.top_k, q));
    }
  // StreamingLLM keeps the sinks and the last w + k tokens.
  EvictCase c;
  c.kind = Kind::streaming, c.T = 50, c.sinks = 2, c.window = 3, c.top_k = 4;
  c.generate();
  const auto ref = kvmem_ref::evict_decode(c.head(0, 0), c.policy(0, 0));
  REQUIRE(ref.kept == std::vector<long>{0, 1, 43, 44, 45, 46, 47, 48, 49});
}

// ---------------------------------------------------------------------------------------------------
// The kernels against the reference

TEST_CASE("eviction: kernels match the reference for every scorer on the edge cases; all modes give the same bits",
          "[eviction][reference][modes]") {
  for (Kind kind : all_kinds)
    for (const auto& c : edge_cases(kind)) check_case(c);
}

// ---------------------------------------------------------------------------------------------------
// Storage types: the cache holds bfloat16 / float16 keys and values as the input gave them

TEMPLATE_TEST_CASE("eviction over bfloat16 / float16 tokens: the reference's cache, y within the storage bound",
                   "[eviction][dtype]", kvmem::bfloat16, kvmem::float16) {
  // Inputs rounded to the storage type reach the reference as they reach the memory, and the cache holds
  // them unrounded further: scores (float64 from the widened keys) and so every eviction are the
  // reference's, and y differs only by float32 arithmetic and its own rounding, u relative (the bound of
  // docs/numerics.md with exact keys and values, |v| <= 1 <= the error's scale).
  using S = TestType;
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::h2o, Kind::tova, Kind::tova_layer, Kind::kvpop}) {
    for (int variant = 0; variant < 2; ++variant) {
      EvictCase c;
      c.kind = kind;
      c.seed = static_cast<unsigned>(700 + 10 * static_cast<int>(kind) + variant);
      if (variant == 1) c.T = 60, c.Hq = 4, c.Hkv = 2, c.sinks = 1, c.top_k = 4, c.B = 2, c.lengths = {60, 33};
      c.generate();
      for (auto* x : {&c.q, &c.k, &c.v})
        for (auto& e : *x) e = kvmem::to_float(kvmem::from_float<S>(e));
      INFO(c.describe());
      const auto whole = run_evict<host_exec, S>(c, Mode::prefill);
      check_reference(c, whole, tolerance + kvmem::unit_roundoff<S>);
      const auto decoded = run_evict<host_exec, S>(c, Mode::decode);
      require_same_bits(whole, decoded);
    }
  }
}
