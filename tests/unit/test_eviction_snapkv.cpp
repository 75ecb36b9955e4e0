// SnapKV's selection (kernels::snapkv_keep, spec §6) against the reference.
#include <catch2/catch_test_macros.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

// ---------------------------------------------------------------------------------------------------
// SnapKV (§6)

namespace {
void check_snapkv(const EvictCase& c, int W, int top_k, bool same_keys = false) {
  INFO(c.describe() << " W_obs=" << W << " C_max=" << W + top_k);
  const auto q = to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q");
  auto keys = c.k;
  if (same_keys)  // every key equal: exact ties of the pooled scores
    for (long i = 0; i < static_cast<long>(keys.size()); ++i) keys[i] = c.k[i % c.D];
  const auto k = to_device<host_mem>(keys, c.B, c.Hkv, c.T, c.D, "k");
  Kokkos::View<long*, host_mem> len("len", c.B);
  for (long b = 0; b < c.B; ++b) len(b) = c.length(b);
  kvmem::kernels::SnapKvScratch<host_mem> scratch;
  scratch.allocate(c.B, c.Hq, c.Hkv, c.T, W);
  const long K = std::min<long>(c.T, W + top_k) + 2;
  Kokkos::View<long***, host_mem> positions("positions", c.B, c.Hkv, K);
  Kokkos::View<long**, host_mem> rows("rows", c.B, c.Hkv);
  kvmem::kernels::snapkv_keep(host_exec(), q, k, len, W, top_k, scratch, positions, rows);
  host_exec().fence();
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      INFO("sequence " << b << " (length " << c.length(b) << "), kv-head " << h);
      auto x = c.head(b, h);
      for (long i = 0; i < static_cast<long>(x.k.size()); ++i) x.k[i] = keys[((b * c.Hkv + h) * c.T) * c.D + i];
      const auto want = kvmem_ref::snapkv_keep(x.q, x.k, x.G, x.T, x.D, W, W + top_k);
      std::vector<long> got;
      for (long i = 0; i < K; ++i) {
        if (i < rows(b, h)) got.push_back(positions(b, h, i));
        else REQUIRE(positions(b, h, i) == -1);
      }
      REQUIRE(got == want);
      REQUIRE(rows(b, h) == std::min<long>(c.length(b), W + top_k));
      if (same_keys && c.length(b) > W + top_k) {  // the newest top_k interior prefix tokens win the tie
        const long prefix = c.length(b) - W;
        std::vector<long> expect;
        for (long t = prefix - 2 - top_k; t < prefix - 2; ++t) expect.push_back(t);
        for (long t = prefix; t < c.length(b); ++t) expect.push_back(t);
        REQUIRE(got == expect);
      }
    }
}
}  // namespace

TEST_CASE("eviction: snapkv_keep matches the reference", "[eviction][snapkv]") {
  EvictCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 50, c.lengths = {50, 33};
  c.seed = 77;
  c.generate();
  check_snapkv(c, 8, 12);  // T > C_max = 20
  check_snapkv(c, 8, 0);   // keep the window only
  check_snapkv(c, 1, 30);  // W = 1
  check_snapkv(c, 4, 46);  // T = C_max: everything
  check_snapkv(c, 4, 60);  // T < C_max
  check_snapkv(c, 60, 3);  // L < W
  check_snapkv(c, 8, 12, /*same_keys=*/true);
  check_snapkv(c, 5, 7, /*same_keys=*/true);
  EvictCase g1;
  g1.B = 1, g1.Hq = 3, g1.Hkv = 3, g1.T = 64, g1.D = 6, g1.seed = 78;
  g1.generate();
  check_snapkv(g1, 6, 10);
  EvictCase empty;
  empty.B = 2, empty.T = 20, empty.lengths = {0, 20};
  empty.generate();
  check_snapkv(empty, 4, 4);
}
