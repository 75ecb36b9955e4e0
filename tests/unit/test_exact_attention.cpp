// Exact causal attention (kernels/readout/exact_attention.hpp) against a float64 softmax, under GQA layouts whose
// query heads share one pass over a kv-head's keys (GroupLanes), and its decode form (first_position):
// a query's output does not depend on which positions are computed with it.
#include <Kokkos_Core.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <cmath>
#include <vector>

#include <kvmem/kernels/readout/exact_attention.hpp>

#include "float_bits.hpp"
#include "kernel_launches.hpp"
#include "worst_error.hpp"

using Catch::Matchers::ContainsSubstring;
using exec = Kokkos::DefaultHostExecutionSpace;
using cview4 = Kokkos::View<const float****, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, Kokkos::HostSpace>;

namespace {
struct Case {
  long B, Hq, Hkv, T, D, Dv;
  std::vector<float> q, k, v, tau;
  Case(long b, long hq, long hkv, long t, long d, long dv)
      : B(b), Hq(hq), Hkv(hkv), T(t), D(d), Dv(dv),
        q(kvmem_test::uniform(b * hq * t * d, 11)),
        k(kvmem_test::uniform(b * hkv * t * d, 12)),
        v(kvmem_test::uniform(b * hkv * t * dv, 13)),
        tau(kvmem_test::uniform(hq, 14)) {
    for (auto& x : tau) x = 1.0f + 0.5f * x;  // per-head temperatures in [0.5, 1.5)
  }
  [[nodiscard]] cview4 keys() const { return cview4(k.data(), B, Hkv, T, D); }
  [[nodiscard]] cview4 values() const { return cview4(v.data(), B, Hkv, T, Dv); }
  /// The queries of positions [p0, p0 + n), copied into their own [B, Hq, n, D] buffer.
  [[nodiscard]] std::vector<float> queries(long p0, long n) const {
    std::vector<float> out(B * Hq * n * D);
    for (long bh = 0; bh < B * Hq; ++bh)
      for (long i = 0; i < n * D; ++i) out[(bh * n) * D + i] = q[(bh * T + p0) * D + i];
    return out;
  }
  /// softmax_{p <= u}(q_u · k_p tau[hq] / sqrt(D)) · v_p in float64, for (b, hq, u).
  [[nodiscard]] std::vector<double> reference(long b, long hq, long u) const {
    const long h = hq / (Hq / Hkv);
    std::vector<double> logit(u + 1), y(Dv, 0.0);
    double top = -INFINITY, sum = 0.0;
    for (long p = 0; p <= u; ++p) {
      double s = 0.0;
      for (long c = 0; c < D; ++c) s += double(q[((b * Hq + hq) * T + u) * D + c]) * k[((b * Hkv + h) * T + p) * D + c];
      logit[p] = s * tau[hq] / std::sqrt(double(D));
      top = std::max(top, logit[p]);
    }
    for (long p = 0; p <= u; ++p) {
      const double e = std::exp(logit[p] - top);
      sum += e;
      for (long c = 0; c < Dv; ++c) y[c] += e * v[((b * Hkv + h) * T + p) * Dv + c];
    }
    for (auto& x : y) x /= sum;
    return y;
  }
};

/// y [B, Hq, n, Dv] of the queries of positions [p0, p0 + n) against the case's whole KV cache, on `Exec`
/// (a decode step, n = 1, scheduled as `splits` says).
template <class Exec = exec>
view4 attend(const Case& c, long p0, long n, kvmem::kernels::DecodeSplits splits = kvmem::kernels::DecodeSplits::automatic) {
  const auto qs = c.queries(p0, n);
  view4 y("y", c.B, c.Hq, n, c.Dv);
  kvmem::kernels::exact_causal_attention(Exec(), cview4(qs.data(), c.B, c.Hq, n, c.D), c.keys(), c.values(), y,
                                         c.tau.data(), p0, splits);
  return y;
}

/// Elements of y [B, Hq, n, Dv] whose bits differ from rows [p0, p0 + n) of `prompt`.
long differing(const view4& y, const view4& prompt, long p0) {
  long differ = 0;
  for (long b = 0; b < long(y.extent(0)); ++b)
    for (long hq = 0; hq < long(y.extent(1)); ++hq)
      for (long u = 0; u < long(y.extent(2)); ++u)
        for (long x = 0; x < long(y.extent(3)); ++x)
          differ += !kvmem_test::same_bits(y(b, hq, u, x), prompt(b, hq, p0 + u, x));
  return differ;
}
}  // namespace

TEST_CASE("exact attention equals a float64 softmax for every GQA layout", "[exact][gqa]") {
  // G = 1 (32 positions a block), 3 (10 positions x 3 heads, 2 lanes idle), 4 with 2 kv-heads, and 40
  // (more heads than lanes: a block of 32 heads and one of 8). T = 70 crosses blocks and key tiles.
  for (auto [Hq, Hkv] : {std::pair{1L, 1L}, {3L, 1L}, {8L, 2L}, {40L, 1L}}) {
    INFO("Hq=" << Hq << " Hkv=" << Hkv);
    const Case c(2, Hq, Hkv, 70, 20, 12);
    const view4 y = attend(c, 0, c.T);
    kvmem_test::WorstError worst;
    for (long b = 0; b < c.B; ++b)
      for (long hq = 0; hq < c.Hq; ++hq)
        for (long u = 0; u < c.T; ++u) {
          const auto ref = c.reference(b, hq, u);
          for (long x = 0; x < c.Dv; ++x) worst.add(y(b, hq, u, x), ref[x]);
        }
    // Logits carry D rounding errors of at most |q||k| u each (u = 2^-24), softmax and the value sum a
    // few u more per term: 1e-5 is a loose float32 bound for |q_c|, |k_c|, |v_c| < 1 and D = 20, and far
    // below what a wrong head, position or mask gives (0.01 and more).
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("a decode step and a chunk at first_position give the prompt's rows bit for bit", "[exact][gqa][modes]") {
  for (auto [Hq, Hkv] : {std::pair{1L, 1L}, {4L, 1L}, {6L, 2L}, {40L, 1L}}) {
    const Case c(2, Hq, Hkv, 75, 20, 24);  // D = 20: whole register vectors and a tail (simd::row_dots)
    const view4 prompt = attend(c, 0, c.T);
    for (auto [p0, n] : {std::pair{0L, 1L}, {31L, 1L}, {32L, 1L}, {74L, 1L}, {33L, 20L}, {5L, 70L}}) {
      INFO("Hq=" << Hq << " Hkv=" << Hkv << " first_position=" << p0 << " queries=" << n);
      CHECK(differing(attend(c, p0, n), prompt, p0) == 0);
    }
  }
}

TEST_CASE("split-KV decode gives the prompt's rows at every split boundary, in either schedule and on every host backend",
          "[exact][gqa][splits]") {
  // A query reads its keys in splits of S = readout_split_keys, merged by log-sum-exp in order; a decode step
  // may run the splits in parallel teams (DecodeSplits::always) or in one team (never). Positions: one key,
  // the last position of one split, one key past it (a split of one key), two whole splits and one past,
  // and the prompt's last position; T = 2S + 34 ends inside a key tile.
  namespace kk = kvmem::kernels;
  constexpr long S = kk::readout_split_keys;
  for (auto [Hq, Hkv] : {std::pair{1L, 1L}, {4L, 2L}}) {
    const Case c(1, Hq, Hkv, 2 * S + 34, 20, 24);
    const view4 prompt = attend(c, 0, c.T);
    kvmem_test::WorstError worst;
    for (long p0 : {0L, S - 1, S, S + 1, 2 * S - 1, 2 * S, 2 * S + 1, c.T - 1}) {
      INFO("Hq=" << Hq << " Hkv=" << Hkv << " position=" << p0);
      for (auto mode : {kk::DecodeSplits::always, kk::DecodeSplits::never, kk::DecodeSplits::automatic}) {
        const kvmem_test::KernelLaunches launches("kvmem::exact_decode_split");
        CHECK(differing(attend(c, p0, 1, mode), prompt, p0) == 0);
        // `always` runs the split kernel wherever the keys span two splits or more (p0 >= S), `never`
        // nowhere: a silent fallback to one split would give the same bits.
        if (mode != kk::DecodeSplits::automatic)
          CHECK(launches.count() == (mode == kk::DecodeSplits::always && p0 >= S ? 1 : 0));
      }
#if defined(KOKKOS_ENABLE_SERIAL)
      {
        const kvmem_test::KernelLaunches launches("kvmem::exact_decode_split");
        CHECK(differing(attend<Kokkos::Serial>(c, p0, 1, kk::DecodeSplits::always), prompt, p0) == 0);
        CHECK(launches.count() == (p0 >= S ? 1 : 0));
      }
#endif
      for (long b = 0; b < c.B; ++b)
        for (long hq = 0; hq < c.Hq; ++hq) {
          const auto ref = c.reference(b, hq, p0);
          for (long x = 0; x < c.Dv; ++x) worst.add(prompt(b, hq, p0, x), ref[x]);
        }
    }
    // The merge of the splits is a softmax over all keys: the float64 softmax within float32 rounding
    // (above; more keys, each a few u).
    CHECK(worst < 1e-5);
  }
  // A chunk whose queries straddle a split boundary (some lanes close a split, some do not).
  const Case c(1, 4, 2, S + 70, 20, 24);
  const view4 prompt = attend(c, 0, c.T);
  CHECK(differing(attend(c, S - 40, 100), prompt, S - 40) == 0);
  // Serial and the default host space compute the prompt in the same splits.
#if defined(KOKKOS_ENABLE_SERIAL)
  CHECK(differing(attend<Kokkos::Serial>(c, 0, c.T), prompt, 0) == 0);
#endif
}

TEST_CASE("exact attention names a bad first_position or a cache too short for it", "[exact][errors]") {
  const Case c(1, 2, 1, 10, 8, 8);
  const auto qs = c.queries(0, 4);
  const cview4 q(qs.data(), 1, 2, 4, 8);
  view4 y("y", 1, 2, 4, 8);
  REQUIRE_THROWS_WITH(kvmem::kernels::exact_causal_attention(exec(), q, c.keys(), c.values(), y, nullptr, -1),
                      ContainsSubstring("first_position = -1"));
  REQUIRE_THROWS_WITH(kvmem::kernels::exact_causal_attention(exec(), q, c.keys(), c.values(), y, nullptr, 7),
                      ContainsSubstring("k.extent(2) = 10") && ContainsSubstring("11 positions"));
  const cview4 short_keys(c.k.data(), 1, 1, 3, 8), short_values(c.v.data(), 1, 1, 3, 8);
  REQUIRE_THROWS_WITH(kvmem::kernels::exact_causal_attention(exec(), q, short_keys, short_values, y),
                      ContainsSubstring("k.extent(2) = 3") && ContainsSubstring("q.extent(2) = 4 positions"));
  const cview4 short_values_only(c.v.data(), 1, 1, 9, 8);
  REQUIRE_THROWS_WITH(kvmem::kernels::exact_causal_attention(exec(), q, c.keys(), short_values_only, y),
                      ContainsSubstring("v/y.extent(2) = 9"));
}
