// Bad input is answered on the host, before any kernel, with an error naming the parameter and value.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "kvm_harness.hpp"

using Catch::Matchers::ContainsSubstring;
using exec = Kokkos::DefaultHostExecutionSpace;
using space = exec::memory_space;

namespace {
kvmem::MemoryConfig good_config() {
  kvmem::MemoryConfig c;
  c.head_dim = 8;
  c.value_dim = 4;
  c.query_heads = 4;
  c.kv_heads = 2;
  c.chunk = 4;
  c.rope_dims = 2;
  return c;
}
kvmem::LayerWeights<space> weights(long d, long hq) {
  Kokkos::View<float*, space> w("w", d), b("b", d), t("t", hq);
  Kokkos::deep_copy(w, 1.0f);
  Kokkos::deep_copy(t, 1.0f);
  return {w, b, t, t};
}
template <class Edit>
void expect_config_error(Edit edit, const std::string& name) {
  auto c = good_config();
  edit(c);
  REQUIRE_THROWS_WITH(c.validate(), ContainsSubstring(name));
}
}  // namespace

TEST_CASE("bad config fields are named", "[errors]") {
  expect_config_error([](auto& c) { c.chunk = 0; }, "chunk = 0");
  expect_config_error([](auto& c) { c.window_chunks = 0; }, "window_chunks = 0");
  expect_config_error([](auto& c) { c.rope_dims = 9; }, "rope_dims = 9");
  expect_config_error([](auto& c) { c.rope_dims = -1; }, "rope_dims = -1");
  expect_config_error([](auto& c) { c.query_heads = 3; }, "query_heads = 3");
  expect_config_error([](auto& c) { c.head_dim = 0; }, "head_dim = 0");
  expect_config_error([](auto& c) { c.sinks = -2; }, "sinks = -2");
  expect_config_error([](auto& c) { c.max_rows = 0; }, "max_rows = 0");
  auto c = good_config();
  c.sinks = 4;
  REQUIRE_NOTHROW(c.check_sinks(12));  // T <= L + C: sinks have no effect
  REQUIRE_THROWS_WITH(c.check_sinks(13), ContainsSubstring("sinks = 4"));
}

TEST_CASE("bad budget parameters are named", "[errors]") {
  REQUIRE_THROWS_WITH((kvmem::budget::PowerLaw{-1, 1.0, 0.5, 0}.validate()), ContainsSubstring("round_down = 0"));
  REQUIRE_THROWS_WITH((kvmem::budget::PowerLaw{-5}.validate()), ContainsSubstring("min_rows = -5"));
  REQUIRE_THROWS_WITH((kvmem::budget::Saturating{-1, 0.0}.validate()), ContainsSubstring("saturation_n = 0"));
  REQUIRE_THROWS_WITH((kvmem::budget::PowerLaw{-1, -1.0}.validate()), ContainsSubstring("growth_factor = -1"));
}

TEST_CASE("bad weights and shapes are named", "[errors]") {
  using memory_t = kvmem::KvmMemory<exec, kvmem::budget::Fixed>;
  REQUIRE_THROWS_WITH(memory_t(good_config(), {}, weights(7, 4), 1), ContainsSubstring("ln_weight.extent(0) = 7"));
  REQUIRE_THROWS_WITH(memory_t(good_config(), {}, weights(8, 2), 1), ContainsSubstring("tau_state.extent(0) = 2"));
  REQUIRE_THROWS_WITH(memory_t(good_config(), {}, weights(8, 4), 0), ContainsSubstring("batch = 0"));

  memory_t mem(good_config(), {}, weights(8, 4), 2);
  using v4 = Kokkos::View<float****, space>;
  using v3 = Kokkos::View<float***, space>;
  v4 q("q", 2, 4, 10, 8), k("k", 2, 2, 10, 8), v("v", 2, 2, 10, 4), y("y", 2, 4, 10, 4);
  v3 g("g", 2, 2, 10);
  REQUIRE_THROWS_WITH(mem.prefill(v4("q", 2, 4, 10, 7), k, v, g, y), ContainsSubstring("q.extent(3) = 7"));
  REQUIRE_THROWS_WITH(mem.prefill(q, v4("k", 2, 3, 10, 8), v, g, y), ContainsSubstring("k.extent(1) = 3"));
  REQUIRE_THROWS_WITH(mem.prefill(q, k, v4("v", 2, 2, 9, 4), g, y), ContainsSubstring("v.extent(2) = 9"));
  REQUIRE_THROWS_WITH(mem.prefill(q, k, v, v3("g", 1, 2, 10), y), ContainsSubstring("gate.extent(0) = 1"));
  const long too_long[] = {10, 11};
  REQUIRE_THROWS_WITH(mem.prefill(q, k, v, g, y, too_long), ContainsSubstring("lengths[1] = 11"));
  const long one[] = {10};
  REQUIRE_THROWS_WITH(mem.prefill(q, k, v, g, y, one), ContainsSubstring("lengths.size() = 1"));
  REQUIRE_NOTHROW(mem.prefill(q, k, v, g, y));
  REQUIRE_NOTHROW(mem.prefill(q, k, v, g, y));  // a second prefill continues (chunked prefill)
  REQUIRE(mem.cursor(1).tokens == 20);
  REQUIRE_THROWS_WITH(mem.decode(q, k, v, g, y), ContainsSubstring("q.extent(2) = 10"));

  auto cfg = good_config();
  cfg.sinks = 4;
  memory_t sinky(cfg, {}, weights(8, 4), 2);
  v4 q2("q", 2, 4, 13, 8), k2("k", 2, 2, 13, 8), v2("v", 2, 2, 13, 4), y2("y", 2, 4, 13, 4);
  REQUIRE_THROWS_WITH(sinky.prefill(q2, k2, v2, v3("g", 2, 2, 13), y2), ContainsSubstring("sinks = 4"));
}

TEST_CASE("a log-sum-exp output of the wrong shape is named, before anything changes", "[errors][lse]") {
  using memory_t = kvmem::KvmMemory<exec, kvmem::budget::Fixed>;
  memory_t mem(good_config(), {}, weights(8, 4), 2);
  using v4 = Kokkos::View<float****, space>;
  using v3 = Kokkos::View<float***, space>;
  v4 q("q", 2, 4, 10, 8), k("k", 2, 2, 10, 8), v("v", 2, 2, 10, 4), y("y", 2, 4, 10, 4);
  const memory_t::inputs in{q, k, v, v3("g", 2, 2, 10)};
  REQUIRE_THROWS_WITH(mem.prefill(in, y, {}, v3("lse", 2, 2, 10)), ContainsSubstring("lse.extent(1) = 2"));
  REQUIRE_THROWS_WITH(mem.prefill(in, y, {}, v3("lse", 2, 4, 9)), ContainsSubstring("lse.extent(2) = 9"));
  REQUIRE(mem.cursor(0).tokens == 0);
  REQUIRE_NOTHROW(mem.prefill(in, y, {}, v3("lse", 2, 4, 10)));
  const auto one = std::make_pair(0L, 1L);
  auto t4 = [&](const v4& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, one, Kokkos::ALL); };
  const memory_t::inputs step{t4(q), t4(k), t4(v), {}};
  REQUIRE_THROWS_WITH(mem.decode(step, t4(y), {}, v3("lse", 1, 4, 1)), ContainsSubstring("lse.extent(0) = 1"));
  REQUIRE_THROWS_WITH(mem.decode_async(step, t4(y), v3("lse", 2, 4, 2)), ContainsSubstring("lse.extent(2) = 2"));
  REQUIRE(mem.cursor(0).tokens == 10);

  kvmem::EvictionConfig ec;
  ec.head_dim = 8, ec.value_dim = 4, ec.query_heads = 4, ec.kv_heads = 2, ec.sinks = 1, ec.window = 2, ec.top_k = 2;
  kvmem::EvictionMemory<exec, kvmem::score::AccumulatedAttention> evict(ec, 2);
  const decltype(evict)::inputs ein{q, k, v};
  REQUIRE_THROWS_WITH(evict.prefill(ein, y, {}, v3("lse", 2, 4, 11)), ContainsSubstring("lse.extent(2) = 11"));
  REQUIRE(evict.tokens(0) == 0);
  REQUIRE_THROWS_WITH(evict.decode(decltype(evict)::inputs{t4(q), t4(k), t4(v)}, t4(y), {}, v3("lse", 2, 3, 1)),
                      ContainsSubstring("lse.extent(1) = 3"));
  REQUIRE(evict.tokens(0) == 0);
}
