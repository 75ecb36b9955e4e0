// The eviction memory is bounded (held_bytes fixed by the budget, the bytes of a bfloat16 cache) and names
// bad input (EvictionConfig fields, shapes, lengths and strides) without changing anything.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;
using Catch::Matchers::ContainsSubstring;

// ---------------------------------------------------------------------------------------------------
// The memory is bounded

TEST_CASE("eviction: held_bytes is fixed by the budget and the cache never holds more rows", "[eviction][budget]") {
  EvictCase c;
  c.kind = Kind::h2o, c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 300, c.lengths = {300, 211};
  c.sinks = 2, c.window = 4, c.top_k = 6;
  c.generate();
  const long budget = 12, expect = c.B * c.Hkv * (budget + 1) * (c.D + c.Dv) * 4;
  with_scorer<host_mem>(c, [&](const auto& scorer) {
    using S = std::remove_cvref_t<decltype(scorer)>;
    kvmem::EvictionMemory<host_exec, S> mem(c.config(), static_cast<int>(c.B), scorer);
    REQUIRE(mem.config().budget() == budget);
    REQUIRE(mem.held_bytes() == expect);
    REQUIRE(mem.cache().slots() == budget + 1);
    REQUIRE(static_cast<long>((mem.cache().keys.size() + mem.cache().values.size()) * sizeof(float)) == expect);
    view4<host_mem> y("y", c.B, c.Hq, c.T, c.Dv);
    mem.prefill(to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q"), to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k"),
                to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v"), y, c.lengths);
    REQUIRE(mem.held_bytes() == expect);
    REQUIRE(mem.cache().slots() == budget + 1);
  });
  const auto decoded = run_evict(c, Mode::decode, 0, true);
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      const auto& steps = decoded.steps[b * c.Hkv + h];
      for (long t = 0; t < c.length(b); ++t) REQUIRE(static_cast<long>(steps[t].size()) == std::min(t + 1, budget));
      REQUIRE(decoded.rows[b * c.Hkv + h] == budget);
    }
  // StreamingLLM (s, w, k) is the sliding window (s, w + k, 0) (§6)
  auto streaming = c;
  streaming.kind = Kind::streaming;
  auto wide = streaming;
  wide.window = streaming.window + streaming.top_k, wide.top_k = 0;
  require_same_bits(run_evict(streaming, Mode::prefill), run_evict(wide, Mode::prefill));
}

TEST_CASE("eviction: a bfloat16 cache holds half the bytes of a float32 one", "[eviction][dtype][budget]") {
  EvictCase c;
  c.generate();
  kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention> f32(c.config(), 2);
  kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention, kvmem::bfloat16> bf16(c.config(), 2);
  CHECK(2 * bf16.held_bytes() == f32.held_bytes());
  CHECK(f32.allocated_bytes() - bf16.allocated_bytes() ==
        static_cast<long>(f32.cache().keys.span() + f32.cache().values.span()) * 2);
}

// ---------------------------------------------------------------------------------------------------
// Bad input is named

TEST_CASE("eviction: bad EvictionConfig fields are named", "[eviction][errors]") {
  auto good = [] {
    kvmem::EvictionConfig c;
    c.head_dim = 8, c.value_dim = 6, c.query_heads = 4, c.kv_heads = 2, c.sinks = 1, c.window = 2, c.top_k = 3;
    return c;
  };
  REQUIRE_NOTHROW(good().validate());
  auto expect = [&](auto edit, const std::string& text) {
    auto c = good();
    edit(c);
    INFO(text);
    REQUIRE_THROWS_AS(c.validate(), kvmem::invalid_argument);
    REQUIRE_THROWS_WITH(c.validate(), ContainsSubstring(text));
    REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::KeyNorm>(c, 1)), ContainsSubstring(text));
    REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>(c, 1)), ContainsSubstring(text));
  };
  expect([](auto& c) { c.window = 0; }, "window = 0");
  expect([](auto& c) { c.window = -3; }, "window = -3");
  expect([](auto& c) { c.top_k = -1; }, "top_k = -1");
  expect([](auto& c) { c.sinks = -1; }, "sinks = -1");
  expect([](auto& c) { c.head_dim = 0; }, "head_dim = 0");
  expect([](auto& c) { c.value_dim = 0; }, "value_dim = 0");
  expect([](auto& c) { c.kv_heads = 0; }, "kv_heads = 0");
  expect([](auto& c) { c.query_heads = 3; }, "query_heads = 3");
  expect([](auto& c) { c.query_heads = 0; }, "query_heads = 0");
  expect([](auto& c) { c.decay_interval = 0; }, "decay_interval = 0");
  expect([](auto& c) { c.top_k = 1 << 30; }, "sinks + window + top_k = ");
  REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::None>(good(), 0)), ContainsSubstring("batch = 0"));
  // the Fenwick mask checks its policy too, and NaN keys
  const std::vector<double> kappa{1.0, 2.0, std::nan(""), 0.0};
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(std::vector<double>{1, 2}, 0, 0, 1), ContainsSubstring("window = 0"));
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(std::vector<double>{1, 2}, 0, 1, -1), ContainsSubstring("top_k = -1"));
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(std::vector<double>{1, 2}, -2, 1, 1), ContainsSubstring("sinks = -2"));
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(kappa, 0, 1, 1), ContainsSubstring("kappa[2]"));
}

TEST_CASE("eviction: mismatched shapes, lengths and strides are named and change nothing", "[eviction][errors]") {
  using V4 = Kokkos::View<float****, host_mem>;
  kvmem::EvictionConfig cfg;
  cfg.head_dim = 8, cfg.value_dim = 6, cfg.query_heads = 4, cfg.kv_heads = 2, cfg.sinks = 1, cfg.window = 2, cfg.top_k = 1;
  const long B = 2, T = 5;
  V4 q("q", B, 4, T, 8), k("k", B, 2, T, 8), v("v", B, 2, T, 6), y("y", B, 4, T, 6);
  Kokkos::deep_copy(q, 0.3f);
  Kokkos::deep_copy(k, 0.2f);
  Kokkos::deep_copy(v, 0.1f);
  kvmem::EvictionMemory<host_exec, kvmem::score::KeyNorm> mem(cfg, static_cast<int>(B));
  REQUIRE_NOTHROW(mem.prefill(q, k, v, y));
  std::vector<long> rows_before, rows_after;
  std::vector<std::vector<long>> kept_before, kept_after;
  read_kept(mem, B, 2, 6, rows_before, kept_before);
  auto throws = [&](auto call, const std::string& text) {
    INFO(text);
    REQUIRE_THROWS_AS(call(), kvmem::invalid_argument);
    REQUIRE_THROWS_WITH(call(), ContainsSubstring(text));
  };
  throws([&] { mem.prefill(V4("q", B, 3, T, 8), k, v, y); }, "q.extent(1) = 3");
  throws([&] { mem.prefill(V4("q", 1, 4, T, 8), k, v, y); }, "q.extent(0) = 1");
  throws([&] { mem.prefill(q, V4("k", B, 2, 4, 8), v, y); }, "k.extent(2) = 4");
  throws([&] { mem.prefill(q, V4("k", B, 1, T, 8), v, y); }, "k.extent(1) = 1");
  throws([&] { mem.prefill(q, V4("k", B, 2, T, 6), v, y); }, "k.extent(3) = 6");
  throws([&] { mem.prefill(q, k, V4("v", B, 2, T, 5), y); }, "v.extent(3) = 5");
  throws([&] { mem.prefill(q, k, v, V4("y", B, 4, T, 8)); }, "y.extent(3) = 8");
  throws([&] { mem.prefill(q, k, v, V4("y", B, 4, 6, 6)); }, "y.extent(2) = 6");
  const std::vector<long> too_long{5, 6}, negative{-1, 2}, one{3};
  throws([&] { mem.prefill(q, k, v, y, too_long); }, "lengths[1] = 6");
  throws([&] { mem.prefill(q, k, v, y, negative); }, "lengths[0] = -1");
  throws([&] { mem.prefill(q, k, v, y, one); }, "lengths.size() = 1");
  Kokkos::View<float*****, host_mem> wide("wide", B, 4, T, 8, 2);
  Kokkos::View<const float****, Kokkos::LayoutStride, host_mem> strided =
      Kokkos::subview(wide, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, 0);
  throws([&] { mem.prefill(strided, k, v, y); }, "q.stride(3) = 2");
  const auto first = std::make_pair(0L, 1L);
  auto s4 = [&](const V4& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, first, Kokkos::ALL); };
  throws([&] { mem.decode(q, k, v, y); }, "q.extent(2) = 5");
  throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(V4("y", B, 4, T, 5))); }, "y.extent(3) = 5");
  const std::vector<unsigned char> short_active{1};
  throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(y), short_active); }, "active.size() = 1");
  throws([&] { mem.kept(Kokkos::View<long***, host_mem>("p", 1, 2, 4), Kokkos::View<long**, host_mem>("r", B, 2)); },
         "positions extents = 1 x 2");
  throws([&] { mem.kept(Kokkos::View<long***, host_mem>("p", B, 2, 4), Kokkos::View<long**, host_mem>("r", B, 1)); },
         "rows extents = 2 x 1");
  // nothing changed
  REQUIRE(mem.tokens(0) == T);
  REQUIRE(mem.tokens(1) == T);
  read_kept(mem, B, 2, 6, rows_after, kept_after);
  REQUIRE(rows_after == rows_before);
  REQUIRE(kept_after == kept_before);
  // eviction_masks: n > 1 (the order depends on q) and mismatched shapes
  auto n3 = cfg;
  n3.decay_interval = 3;
  throws([&] { kvmem::training::eviction_masks(host_exec(), n3, kvmem::score::KeyNorm{}, k, v); }, "decay_interval = 3");
  throws([&] { kvmem::training::eviction_masks(host_exec(), cfg, kvmem::score::KeyNorm{}, k, V4("v", B, 2, T, 5)); },
         "v extents");
  throws([&] { kvmem::training::eviction_masks(host_exec(), cfg, kvmem::score::KeyNorm{}, V4("k", B, 3, T, 8), v); },
         "k.extent(1) = 3");
  throws([&] { kvmem::training::eviction_masks(host_exec(), cfg, kvmem::score::KeyNorm{}, k, v, too_long); },
         "lengths[1] = 6");
}
