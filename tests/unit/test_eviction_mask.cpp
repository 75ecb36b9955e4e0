// Decode == the Fenwick mask of spec §5 == the brute-force mask (§4): the training masks of the static
// scorers and RunningTopK on keys with many ties.
#include <catch2/catch_test_macros.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

// ---------------------------------------------------------------------------------------------------
// Decode == Fenwick mask == brute force (§4, §5)

TEST_CASE("eviction: decode's cache at every step is the row of the Fenwick mask (static scorers, n = 1)",
          "[eviction][mask]") {
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::kvpop, Kind::given})
    for (int variant = 0; variant < 3; ++variant) {
      // kvpop: xlstm, plain, and xlstm with f ~ 1 and a small input gate: m_t = F_t (the m_{-1} = 0 term of
      // §3) for many steps, which reaches the scores through eps exp(m) of the xlstm normaliser (~1e-7)
      if (kind != Kind::kvpop && variant > 0) continue;
      const auto norm = variant == 1 ? kvmem_ref::MLstmNorm::plain : kvmem_ref::MLstmNorm::xlstm;
      EvictCase c;
      if (variant == 2) c.i_bias = -2.0f, c.f_bias = 6.0f;
      c.kind = kind, c.norm = norm, c.B = 2, c.lengths = {150, 97}, c.T = 150, c.Hq = 4, c.Hkv = 2;
      c.sinks = 3, c.window = 5, c.top_k = 9, c.duplicate_keys = true, c.given_levels = 3;
      c.log_gamma = kind == Kind::given ? -0.25 : 0.0;
      c.seed = 50 + static_cast<unsigned>(kind);
      c.generate();
      INFO(c.describe());
      const auto decoded = run_evict(c, Mode::decode, 0, true);
      check_reference(c, decoded);
      const auto k = to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k");
      const auto v = to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v");
      with_scorer<host_mem>(c, [&](const auto& scorer) {
        using S = std::remove_cvref_t<decltype(scorer)>;
        if constexpr (!S::needs_probabilities) {
          const auto masks = kvmem::training::eviction_masks(host_exec(), c.config(), scorer, k, v, c.lengths);
          REQUIRE(static_cast<long>(masks.size()) == c.B * c.Hkv);
          // the static keys kappa of the library (recurrence) against the reference (closed form)
          S bound = scorer;
          bound.bind(c.B, c.config());
          bound.reset();
          Kokkos::View<long*, host_mem> len("len", c.B);
          for (long b = 0; b < c.B; ++b) len(b) = c.length(b);
          Kokkos::View<double***, Kokkos::LayoutRight, host_mem> kappa("kappa", c.B, c.Hkv, c.T);
          kvmem::kernels::static_scores(host_exec(), kvmem::kernels::EvictionParams::of(c.config()), bound, k, v, len, kappa);
          host_exec().fence();
          for (long b = 0; b < c.B; ++b)
            for (long h = 0; h < c.Hkv; ++h) {
              INFO("sequence " << b << ", kv-head " << h);
              const auto& mask = masks[b * c.Hkv + h];
              const long n = c.length(b);
              REQUIRE(mask.tokens() == n);
              const auto ref_kappa = kvmem_ref::static_keys(c.head(b, h), c.policy(b, h));
              // KVPOP's mLSTM and KNorm's sum run in float32 against the float64 reference (docs/numerics.md,
              // "Eviction statistics"; the mLSTM here within 3.7e-7 (1 + |kappa|)).
              const double kappa_tolerance = kind == Kind::kvpop || kind == Kind::knorm ? 1e-5 : 1e-9;
              for (long t = 0; t < n; ++t) {
                if (std::isnan(ref_kappa[t])) {
                  REQUIRE(kappa(b, h, t) == -std::numeric_limits<double>::infinity());  // never scored (§2)
                  continue;
                }
                INFO("token " << t);
                REQUIRE(std::abs(kappa(b, h, t) - ref_kappa[t]) <= kappa_tolerance * (1.0 + std::abs(ref_kappa[t])));
              }
              for (long q = 0; q < n; ++q) {
                INFO("query " << q);
                std::vector<long> row;
                for (long t = 0; t < n; ++t)
                  if (mask.kept(q, t)) row.push_back(t);
                REQUIRE(row == decoded.steps[b * c.Hkv + h][q]);
                REQUIRE(row == kvmem_ref::topk_row(ref_kappa, c.sinks, c.window, c.top_k, q));
              }
            }
        }
      });
    }
}

TEST_CASE("eviction: RunningTopK equals the brute-force mask on keys with many ties", "[eviction][mask]") {
  struct Shape {
    long T;
    int s, w, k;
  };
  const Shape shapes[] = {{4096, 4, 64, 100}, {4096, 0, 1, 7}, {1000, 0, 1, 0},  {1000, 3, 5, 0},   {300, 400, 2, 5},
                          {300, 300, 2, 5},  {300, 3, 400, 5}, {300, 0, 300, 5}, {777, 10, 20, 1},  {2000, 5, 10, 1500},
                          {0, 1, 1, 1},      {1, 0, 1, 1},     {2, 0, 1, 1},     {64, 1, 1, 64},    {65, 0, 2, 63}};
  std::mt19937 rng(2024);
  for (const auto& sh : shapes)
    for (int keys = 0; keys < 4; ++keys) {
      if (sh.T == 4096 && keys != (sh.k == 7 ? 1 : 0)) continue;  // the long shapes: one tie-heavy key set each
      // 0: integers in [0, 4); 1: all equal; 2: random doubles; 3: integers with -inf (never scored) at the end
      std::vector<double> kappa(sh.T);
      std::uniform_int_distribution<int> level(0, 3);
      std::normal_distribution<double> normal;
      for (long t = 0; t < sh.T; ++t)
        kappa[t] = keys == 0 || keys == 3 ? level(rng) : keys == 1 ? 1.5 : normal(rng);
      if (keys == 3)
        for (long t = std::max(0L, sh.T - 5); t < sh.T; ++t) kappa[t] = -std::numeric_limits<double>::infinity();
      INFO("T=" << sh.T << " s=" << sh.s << " w=" << sh.w << " k=" << sh.k << " keys=" << keys);
      const kvmem::training::RunningTopK mask(kappa, sh.s, sh.w, sh.k);
      REQUIRE(mask.tokens() == sh.T);
      std::vector<long> row;
      for (long q = 0; q < sh.T; ++q) {
        row.clear();
        for (long t = 0; t <= q + 3 && t < sh.T; ++t)
          if (mask.kept(q, t)) row.push_back(t);
        const auto want = kvmem_ref::topk_row(kappa, sh.s, sh.w, sh.k, q);
        if (row != want) {
          INFO("query " << q);
          REQUIRE(row == want);
        }
        REQUIRE(static_cast<long>(row.size()) <= static_cast<long>(sh.s) + sh.w + sh.k);
      }
    }
}
