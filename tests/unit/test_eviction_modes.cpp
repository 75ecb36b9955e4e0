// Determinism of the eviction memory: a prompt split anywhere or continued in decode, reruns and reset(),
// one thread and many, every team size, Serial and the default host space, all bit for bit.
#include <catch2/catch_test_macros.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

// ---------------------------------------------------------------------------------------------------
// Determinism: threads and backends

TEST_CASE("eviction: a prefill split anywhere, or continued in decode, gives the bits of one prefill", "[eviction][modes]") {
  // splits inside the window, at the window's first exit, past a short sequence (ragged lengths 90, 41, 77)
  for (Kind kind : all_kinds) {
    const auto c = thread_case(kind);
    INFO(c.describe());
    const auto whole = run_evict(c, Mode::prefill);
    for (long split : {1L, 3L, 6L, 7L, 40L, 41L, 60L, 89L}) {
      INFO("split at " << split);
      require_same_bits(whole, run_evict(c, Mode::two_prefills, split));
    }
    require_same_bits(whole, run_evict(c, Mode::prefill_then_decode, 70));
  }
}

TEST_CASE("eviction: reruns and reset() give the same bits", "[eviction][determinism]") {
  for (Kind kind : all_kinds) {
    const auto c = thread_case(kind);
    INFO(c.describe());
    const auto first = run_evict(c, Mode::prefill);
    require_same_bits(first, run_evict(c, Mode::prefill));
    // a memory that ran another batch, then reset(), gives the bits of a fresh one
    with_scorer<host_mem>(c, [&](const auto& scorer) {
      using S = std::remove_cvref_t<decltype(scorer)>;
      kvmem::EvictionMemory<host_exec, S> mem(c.config(), static_cast<int>(c.B), scorer);
      auto other = c;
      other.seed += 1000;
      other.generate();
      view4<host_mem> y("y", c.B, c.Hq, c.T, c.Dv);
      std::vector<long> len(c.lengths);
      mem.prefill(to_device<host_mem>(other.q, c.B, c.Hq, c.T, c.D, "q"), to_device<host_mem>(other.k, c.B, c.Hkv, c.T, c.D, "k"),
                  to_device<host_mem>(other.v, c.B, c.Hkv, c.T, c.Dv, "v"), y);
      mem.reset();
      for (long b = 0; b < c.B; ++b) REQUIRE(mem.tokens(b) == 0);
      Kokkos::View<float***, Kokkos::LayoutRight, host_mem> lse("lse", c.B, c.Hq, c.T);
      mem.prefill(typename kvmem::EvictionMemory<host_exec, S>::inputs{to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q"), to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k"),
                   to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v")},
                  y, len, lse);
      EvictOutput again;
      read_kept(mem, c.B, c.Hkv, std::min(c.budget(), c.T) + 1, again.rows, again.kept);
      again.y.assign(y.data(), y.data() + y.size());
      again.lse.assign(lse.data(), lse.data() + lse.size());
      require_same_bits(first, again);
    });
  }
}

#ifdef KOKKOS_ENABLE_OPENMP
TEST_CASE("eviction: OpenMP on one thread and on every thread give the same bits", "[eviction][backends][determinism]") {
  const int all = Kokkos::OpenMP().concurrency();
  if (all < 2) WARN("the OpenMP pool has " << all << " thread(s): nothing to compare against one thread");
  for (Kind kind : all_kinds)
    for (bool merge : {false, true}) {
    auto c = thread_case(kind);
    c.merge = merge;
    INFO(c.describe());
    for (Mode mode : {Mode::prefill, Mode::decode}) {
      INFO("mode=" << static_cast<int>(mode));
      const auto one = run_evict(c, mode, 0, false, Kokkos::OpenMP(1));
      require_same_bits(one, run_evict(c, mode, 0, false, Kokkos::OpenMP()));
      if (all > 2) require_same_bits(one, run_evict(c, mode, 0, false, Kokkos::OpenMP(2)));
    }
    }
}
#endif

/// y, and per (b, h) the cached positions and statistics in position order, of kernels::eviction_tokens run
/// directly on the default host space over every token of case c with `team_size` threads per team.
struct TeamRun {
  std::vector<float> y;
  std::vector<std::vector<long>> kept;
  std::vector<std::vector<double>> stats;
};
template <class Scorer>
TeamRun run_team(const EvictCase& c, Scorer scorer, int team_size) {
  const auto q = to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q");
  const auto k = to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k");
  const auto v = to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v");
  view4<host_mem, float> y("y", c.B, c.Hq, c.T, c.Dv);
  scorer.bind(c.B, c.config());
  kvmem::state::EvictionCache<host_mem> cache;
  cache.allocate(c.B, static_cast<int>(c.Hkv), c.budget() + 1, static_cast<int>(c.D), static_cast<int>(c.Dv),
                 Scorer::needs_probabilities, c.merge);
  Kokkos::View<long*, host_mem> first("first", c.B), len("len", c.B);
  for (long b = 0; b < c.B; ++b) len(b) = c.length(b);
  kvmem::kernels::eviction_tokens(host_exec(), kvmem::kernels::EvictionParams::of(c.config()), cache, scorer, q, k, v,
                                  y, first, len, team_size);
  host_exec().fence();
  TeamRun r;
  r.y.assign(y.data(), y.data() + y.size());
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      r.kept.emplace_back();
      r.stats.emplace_back();
      for (long i = 0; i < cache.live(b, h); ++i) {
        const int s = cache.order(b, h, i);
        r.kept.back().push_back(cache.positions(b, h, s));
        r.stats.back().push_back(cache.stats(b, h, s));
      }
    }
  return r;
}

TEST_CASE("eviction: every team size gives the bits of a team of one thread (order shift, mLSTM, attend)",
          "[eviction][backends][determinism]") {
  const int threads = host_exec().concurrency();
  if (threads < 2) WARN("the host space has " << threads << " thread(s): only teams of one thread run");
  for (Kind kind : all_kinds)
    for (bool merge : {false, true}) {
    auto c = thread_case(kind);  // ragged lengths, duplicate keys, evictions from the 7th step on
    c.merge = merge;
    INFO(c.describe());
    with_scorer<host_mem>(c, [&](const auto& scorer) {
      const auto one = run_team(c, scorer, 1);
      REQUIRE(one.kept == run_evict(c, Mode::prefill).kept);  // the memory's own cache
      for (int team = 2; team <= std::min(threads, 4); ++team) {
        INFO("team size " << team);
        const auto got = run_team(c, scorer, team);
        REQUIRE(got.kept == one.kept);
        REQUIRE(same_bits(got.y, one.y));
        for (std::size_t i = 0; i < one.stats.size(); ++i)
          for (std::size_t j = 0; j < one.stats[i].size(); ++j)
            REQUIRE(kvmem_test::same_bits(got.stats[i][j], one.stats[i][j]));
      }
    });
    }
}

#ifdef KOKKOS_ENABLE_SERIAL
TEST_CASE("eviction: Serial matches the reference and the default host space bit for bit", "[eviction][backends]") {
  for (Kind kind : all_kinds) {
    const auto c = thread_case(kind);
    INFO(c.describe());
    const auto serial = run_evict<Kokkos::Serial>(c, Mode::prefill);
    check_reference(c, serial);
    require_same_bits(serial, run_evict(c, Mode::prefill));
    require_same_bits(serial, run_evict<Kokkos::Serial>(c, Mode::decode));
  }
}
#endif
