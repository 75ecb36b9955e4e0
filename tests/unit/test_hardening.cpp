// Regression tests of the hardening work (docs/reliability.md): every crash or undefined behaviour the
// fuzzers, the sanitizer build or review found, at the library level. (Inputs of whole-file findings are
// replayed by the fuzz.replay.* tests from tests/fuzz/regressions/.)
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <kvmem/io/safetensors.hpp>
#include <kvmem/kvmem.hpp>

using Catch::Matchers::ContainsSubstring;
using kvmem::io::SafetensorsFile;

namespace {
std::vector<unsigned char> file_of(const std::string& header, std::size_t data_bytes = 0) {
  std::vector<unsigned char> bytes(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}
SafetensorsFile parse(const std::vector<unsigned char>& bytes) { return SafetensorsFile::parse(bytes, "x.safetensors"); }
}  // namespace

TEST_CASE("a deeply nested header is rejected, not a stack overflow", "[io][errors][hardening]") {
  // Found by review, reproduced with the fuzz target: error messages quoted header values with
  // nlohmann's dump(), which recurses once per nesting level; 100,000 nested arrays (a 200 kB file)
  // crashed kvmem-run with SIGSEGV. tests/fuzz/regressions/safetensors/stack-overflow-deep-json.
  const std::string deep(200000, '['), closing(200000, ']');
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":)" + deep + closing + R"(,"data_offsets":[0,0]}})")),
                      ContainsSubstring("entries must be non-negative integers"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":)" + deep + closing + "}}")), ContainsSubstring("needs dtype"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"__metadata__":{"k":)" + deep + closing + "}}")),
                      ContainsSubstring("must be a string"));
}

TEST_CASE("header values are quoted briefly in errors", "[io][errors][hardening]") {
  const std::string long_dtype(1 << 20, 'Q');
  try {
    parse(file_of(R"({"a":{"dtype":")" + long_dtype + R"(","shape":[1],"data_offsets":[0,1]}})", 1));
    FAIL("accepted an unknown dtype");
  } catch (const kvmem::invalid_argument& e) {
    REQUIRE_THAT(e.what(), ContainsSubstring("unknown dtype"));
    REQUIRE(std::strlen(e.what()) < 400);
  }
}

TEST_CASE("shape entries past 2^63 are rejected", "[io][errors][hardening]") {
  // Found by the fuzz target's seed corpus: [0, 2^64 - 1] holds no bytes, passed every check, and read
  // back as the int64 shape [0, -1]. tests/fuzz/regressions/safetensors/shape-dim-above-int64.
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}})")),
                      ContainsSubstring("below 2^63"));
  REQUIRE_THROWS_WITH(parse(file_of(R"({"a":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}})")),
                      ContainsSubstring("below 2^63"));
  const auto f = parse(file_of(R"({"a":{"dtype":"F32","shape":[0,9223372036854775807],"data_offsets":[0,0]}})"));
  REQUIRE(f.at("a").shape == std::vector<std::int64_t>{0, std::numeric_limits<std::int64_t>::max()});
  REQUIRE(f.at("a").numel() == 0);
}

TEST_CASE("serialize() is what write() writes and parses back", "[io][hardening]") {
  SafetensorsFile f;
  const double a[] = {1.0, -2.5, 1e300};
  const std::int32_t i[] = {7, -8};
  f.put("a", {3}, a);
  f.put("i", {1, 2}, i);
  f.metadata["note"] = "caf\xc3\xa9";
  const auto bytes = f.serialize();
  REQUIRE((8 + bytes[0] + 256 * bytes[1]) % 8 == 0);  // 8-byte aligned data section
  const auto g = parse(bytes);
  REQUIRE(g.metadata == f.metadata);
  REQUIRE(g.at("a").bytes == f.at("a").bytes);
  REQUIRE(g.at("i").shape == f.at("i").shape);
  const std::string path = "/tmp/kvmem_test_serialize.safetensors";
  f.write(path);
  REQUIRE(SafetensorsFile::read(path).serialize() == bytes);
}

TEST_CASE("budgets past the range of long saturate instead of overflowing", "[budget][hardening]") {
  // A valid (finite) growth factor, exponent or saturation N can still make the double budget exceed
  // LONG_MAX, and converting it was undefined behaviour (UBSan: float-cast-overflow). It saturates now,
  // and the memory caps it by the tokens available and max_rows as before.
  REQUIRE(kvmem::budget::PowerLaw{-1, 1e300, 0.5, 1}.rows(100) == LONG_MAX);
  REQUIRE(kvmem::budget::PowerLaw{-1, 1.0, 1000.0, 1}.rows(10) == LONG_MAX);
  REQUIRE(kvmem::budget::PowerLaw{-1, 1e300, 0.5, 4}.rows(100) % 4 == 0);
  REQUIRE(kvmem::budget::Saturating{-1, 1e308, 1}.rows(10) == LONG_MAX);
  REQUIRE(kvmem::budget::PowerLaw{-1, 16.0, 0.5, 1}.rows(1 << 20) == 16384);  // unchanged in range
  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = 4;
  cfg.query_heads = cfg.kv_heads = 1;
  cfg.chunk = 4;
  cfg.max_rows = LONG_MAX;
  const auto up = kvmem::state::plan_update(cfg, kvmem::budget::PowerLaw{-1, 1e300, 0.5, 1}, 4, 8);
  REQUIRE(up.append == 4);  // capped by the chunk, not by the budget
}

namespace {
/// A scorer that cannot rank every token: NaN for tokens whose memory key has a positive channel 1.
struct NanScorer {
  static constexpr std::string_view name = "nan-test";
  KOKKOS_INLINE_FUNCTION static float score(const float* key, const float* rows_keys, long rows, int dim) {
    return key[1] > 0.0f ? Kokkos::Experimental::quiet_NaN_v<float> : kvmem::score::Novelty::score(key, rows_keys, rows, dim);
  }
};
static_assert(NanScorer::name == "nan-test");  // the concept's name, used (nvcc warns of unused members)
}  // namespace

TEST_CASE("NaN scores neither found extra rows nor write past the planned ones", "[update][hardening]") {
  // Selection ranked tokens with `<`, under which every NaN score ranked first: more tokens than the plan
  // allowed founded rows, writing rows the host had not planned (or allocated) and losing their merges.
  // Found by review (OVQ's seeding scores are raw dot products, NaN for a non-finite key).
  using exec = Kokkos::DefaultHostExecutionSpace;
  using space = exec::memory_space;
  constexpr int D = 8, Dv = 4, T = 96;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = D;
  cfg.value_dim = Dv;
  cfg.query_heads = 2;
  cfg.kv_heads = 1;
  cfg.chunk = 8;
  cfg.window_chunks = 2;
  cfg.rope_dims = 0;
  cfg.sinks = 1;
  cfg.max_rows = 1000;
  const kvmem::budget::PowerLaw budget{8, 2.0, 0.5, 1};
  Kokkos::View<float*, space> ones("ones", D), zeros("zeros", D), tau("tau", 2);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(tau, 1.0f);
  const kvmem::LayerWeights<space> w{ones, zeros, tau, tau};
  Kokkos::View<float****, Kokkos::LayoutRight, space> q("q", 1, 2, T, D), k("k", 1, 1, T, D), v("v", 1, 1, T, Dv),
      y("y", 1, 2, T, Dv);
  Kokkos::View<float***, Kokkos::LayoutRight, space> gate("gate", 1, 1, T);
  std::uint32_t s = 12345;
  auto next = [&] {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / 8388608.0f - 1.0f;
  };
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < D; ++c) q(0, 0, t, c) = next(), q(0, 1, t, c) = next(), k(0, 0, t, c) = next();
    for (int c = 0; c < Dv; ++c) v(0, 0, t, c) = next();
    gate(0, 0, t) = next();
  }
  kvmem::Memory<exec, kvmem::merge::WinnerTakeAll, kvmem::budget::PowerLaw, NanScorer> mem(cfg, budget, w, 1);
  mem.prefill(q, k, v, gate, y);
  const long rows = mem.cursor(0).rows;
  REQUIRE(rows == kvmem::state::final_rows(cfg, budget, T));
  const auto& st = mem.rows();
  for (long i = rows; i < st.capacity(); ++i)
    for (int c = 0; c < D; ++c) REQUIRE(st.keys(0, 0, i, c) == 0.0f);  // nothing founded past the plan
  for (long i = 0; i < static_cast<long>(y.size()); ++i) REQUIRE(std::isfinite(y.data()[i]));
}
