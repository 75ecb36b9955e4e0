// Storage types (kvmem/dtype.hpp): bfloat16 and float16 conversions against their definition, the SIMD
// loads against the scalar conversion, and exact attention and the KVM memory holding their tokens in
// bfloat16 / float16 against the float64 reference within the bound of docs/numerics.md, with prefill ==
// decode bit for bit inside one storage type.
#include <Kokkos_Core.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <kvmem/kernels/eviction/eviction_step.hpp>
#include <kvmem/kernels/readout/exact_attention.hpp>
#include <kvmem/io/safetensors.hpp>
#include <kvmem/math/simd.hpp>

#include "float_bits.hpp"
#include "kvm_harness.hpp"
#include "exact_bound.hpp"
#include "storage_bound.hpp"

using kvmem::bfloat16;
using kvmem::float16;
using exec = Kokkos::DefaultHostExecutionSpace;

namespace {

template <class S>
S from_bits(std::uint16_t b) {
  S s;
  s.bits = b;
  return s;
}
template <class S>
constexpr std::uint16_t largest_finite = std::is_same_v<S, bfloat16> ? 0x7f7f : 0x7bff;

/// Whether `r` is x rounded to nearest, ties to even, among the finite values of S (x inside S's range).
template <class S>
bool nearest_even(float x, S r) {
  const double want = x, got = kvmem::to_float(r);
  for (int step : {-1, 1}) {
    const std::uint16_t nb = static_cast<std::uint16_t>(r.bits + step);
    if ((nb & 0x7fff) > largest_finite<S> || ((nb ^ r.bits) & 0x8000)) continue;  // past Inf or the sign
    const double other = kvmem::to_float(from_bits<S>(nb));
    if (std::abs(want - other) < std::abs(want - got)) return false;
    if (std::abs(want - other) == std::abs(want - got) && (r.bits & 1)) return false;  // a tie goes to even
  }
  return true;
}

}  // namespace

TEMPLATE_TEST_CASE("a 16-bit storage type widens exactly and rounds to nearest even", "[dtype]", bfloat16, float16) {
  using S = TestType;
  // Every bit pattern: widening is exact, so rounding the widened value gives the pattern back.
  long mismatches = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const S s = from_bits<S>(static_cast<std::uint16_t>(b));
    const float x = kvmem::to_float(s);
    const S back = kvmem::from_float<S>(x);
    if (std::isnan(x))
      mismatches += !std::isnan(kvmem::to_float(back));
    else
      mismatches += back.bits != s.bits;
  }
  CHECK(mismatches == 0);
  // Random float32 values over S's whole range, and the midpoints between neighbours (exact ties).
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  const float top = kvmem::to_float(from_bits<S>(largest_finite<S>));
  long wrong = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = Kokkos::bit_cast<float>(bits(rng));
    if (!std::isfinite(x) || std::abs(x) > top) continue;
    wrong += !nearest_even(x, kvmem::from_float<S>(x));
  }
  for (std::uint32_t b = 0; b + 1 < largest_finite<S>; b += 7) {
    const double lo = kvmem::to_float(from_bits<S>(static_cast<std::uint16_t>(b)));
    const double hi = kvmem::to_float(from_bits<S>(static_cast<std::uint16_t>(b + 1)));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in float32
    const S r = kvmem::from_float<S>(mid);
    wrong += (r.bits & 1) != 0 || (r.bits != b && r.bits != b + 1);
  }
  CHECK(wrong == 0);
}

TEMPLATE_TEST_CASE("a 16-bit storage type saturates finite values and keeps Inf and NaN", "[dtype]", bfloat16, float16) {
  using S = TestType;
  const float big = std::numeric_limits<float>::max(), inf = std::numeric_limits<float>::infinity();
  CHECK(kvmem::from_float<S>(big).bits == largest_finite<S>);
  CHECK(kvmem::from_float<S>(-big).bits == (largest_finite<S> | 0x8000));
  CHECK(std::isinf(kvmem::to_float(kvmem::from_float<S>(inf))));
  CHECK(kvmem::to_float(kvmem::from_float<S>(-inf)) == -inf);
  CHECK(std::isnan(kvmem::to_float(kvmem::from_float<S>(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(kvmem::from_float<S>(-0.0f).bits == 0x8000);
  if constexpr (std::is_same_v<S, float16>) {
    CHECK(kvmem::to_float(kvmem::from_float<S>(65504.0f)) == 65504.0f);
    CHECK(kvmem::from_float<S>(65519.0f).bits == 0x7bff);  // rounds down to 65,504
    CHECK(kvmem::from_float<S>(65520.0f).bits == 0x7bff);  // would round to Inf: saturates
    CHECK(kvmem::from_float<S>(1e9f).bits == 0x7bff);
    CHECK(kvmem::from_float<S>(0x1p-24f).bits == 0x0001);      // smallest subnormal
    CHECK(kvmem::from_float<S>(0x1p-25f).bits == 0x0000);      // a tie: to even (zero)
    CHECK(kvmem::from_float<S>(0x1.8p-24f).bits == 0x0002);    // a tie: to even (two)
    CHECK(kvmem::from_float<S>(0x1.ff8p-15f).bits == 0x03ff);  // the largest subnormal
    CHECK(kvmem::from_float<S>(0x1.ffcp-15f).bits == 0x0400);  // a tie: up to even, the smallest normal
  } else {
    CHECK(kvmem::to_float(kvmem::from_float<S>(1.0f + 0x1p-8f)) == 1.0f);  // a tie: to even
    CHECK(kvmem::to_float(kvmem::from_float<S>(1.0f + 0x1.8p-8f)) == 1.0f + 0x1p-7f);
  }
}

TEST_CASE("float16 widens to its definition's float32 bits, NaN payloads included, for every bit pattern", "[dtype]") {
  // The definition: (-1)^s 2^(e - 15) (1 + m / 1024) for 0 < e < 31, (-1)^s 2^-14 (m / 1024) for e = 0,
  // Inf for e = 31 and m = 0, a quiet NaN with m in the float32 payload's top bits otherwise. to_float is
  // the F16C instruction in the -march=native build ("native: " tests) and detail::widen_float16 elsewhere.
  long wrong = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const std::uint32_t sign = (b & 0x8000u) << 16, e = (b >> 10) & 0x1fu, m = b & 0x3ffu;
    std::uint32_t want;
    if (e == 31)
      want = sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x00400000u : 0u);
    else {
      const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, int(e) - 15);
      want = Kokkos::bit_cast<std::uint32_t>(static_cast<float>(v)) | sign;  // exact in float32
    }
    const std::uint16_t h = static_cast<std::uint16_t>(b);
    wrong += Kokkos::bit_cast<std::uint32_t>(kvmem::to_float(from_bits<float16>(h))) != want;
    wrong += Kokkos::bit_cast<std::uint32_t>(kvmem::detail::widen_float16(h)) != want;
  }
  CHECK(wrong == 0);
}

TEST_CASE("float16 rounding keeps a NaN quiet with its payload's top bits and its sign", "[dtype]") {
  // As the CPUs' and GPUs' conversion instructions: sign, all-ones exponent, the quiet bit, and the top 9
  // payload bits of the float32 NaN below it.
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> payload(1, 0x7fffffu);
  long wrong = 0;
  for (int i = 0; i < 4096; ++i) {
    const std::uint32_t u = (i & 1 ? 0x80000000u : 0u) | 0x7f800000u | payload(rng);
    const std::uint16_t want = static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
    wrong += kvmem::from_float<float16>(Kokkos::bit_cast<float>(u)).bits != want;
  }
  CHECK(wrong == 0);
}

TEMPLATE_TEST_CASE("the SIMD load and broadcast of a storage type widen as the scalar conversion does", "[dtype][simd]", bfloat16,
                   float16) {
  using S = TestType;
  constexpr int W = kvmem::kernels::simd::width;
  std::vector<S> all(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) all[b] = from_bits<S>(static_cast<std::uint16_t>(b));
  long differ = 0;
  float lanes[W];
  for (std::uint32_t b = 0; b < 65536; b += W) {
    kvmem::kernels::simd::store(lanes, kvmem::kernels::simd::load(&all[b]));
    for (int i = 0; i < W; ++i) {
      const float want = kvmem::to_float(all[b + i]);
      differ += std::isnan(want) ? !std::isnan(lanes[i]) : !kvmem_test::same_bits(lanes[i], want);
    }
  }
  CHECK(differ == 0);
  // broadcast_from: every lane the widened element (the register tiles' key broadcast), for every pattern.
  long broadcast_differ = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    kvmem::kernels::simd::store(lanes, kvmem::kernels::simd::broadcast_from(&all[b]));
    const float want = kvmem::to_float(all[b]);
    for (int i = 0; i < W; ++i)
      broadcast_differ += std::isnan(want) ? !std::isnan(lanes[i]) : !kvmem_test::same_bits(lanes[i], want);
  }
  CHECK(broadcast_differ == 0);
}

namespace {
/// simd::width rows of `dim` channels and a query (query channel 0 is -0), uniform in [-4, 4) from seeds
/// `seed` and seed + 1, stored as S; rows(k) points at row k.
template <class S>
struct RowGroup {
  std::vector<S> data, q;
  RowGroup(int dim, unsigned seed) {
    constexpr int W = kvmem::kernels::simd::width;
    const auto rows_f = kvmem_test::uniform(std::size_t(W) * dim, seed), q_f = kvmem_test::uniform(dim, seed + 1);
    for (float x : rows_f) data.push_back(kvmem::from_float<S>(4.0f * x));
    for (float x : q_f) q.push_back(kvmem::from_float<S>(4.0f * x));
    q[0] = kvmem::from_float<S>(-0.0f);
    for (int k = 0; k < W; ++k) row.push_back(data.data() + std::size_t(k) * dim);
  }
  std::vector<const S*> row;
};
}  // namespace

TEMPLATE_TEST_CASE("row_dots and an eviction step's row groups over a 16-bit query and rows give the bits of dot",
                   "[dtype][simd][eviction]", bfloat16, float16) {
  // The decode readout reads 16-bit rows against a float32 query; an eviction step reads 16-bit rows against
  // the 16-bit query as the input gave it (kernels::row_group_dots): per row, kernels::dot's chain.
  using S = TestType;
  namespace kk = kvmem::kernels;
  constexpr int W = kk::simd::width;
  // bfloat16 rows go through whole blocks of 2 * W channels (channel pairs) first, then blocks of W, then
  // one channel at a time: dims that end in each of them.
  for (int dim : {1, W - 1, W, W + 3, 2 * W, 2 * W + 1, 3 * W, 3 * W + 5, 64, 128}) {
    INFO("dim=" << dim);
    const RowGroup<S> g(dim, 31 + dim);
    const auto& q = g.q;
    const auto& row = g.row;
    float got[W];
    kk::simd::row_dots(q.data(), 1, dim, row.data(), got);
    for (int k = 0; k < W; ++k) CHECK(kvmem_test::same_bits(got[k], kk::dot(q.data(), row[k], dim)));
    // The decode readout's form: a float32 query in a block's transposed layout (stride 3 here).
    std::vector<float> q_wide(std::size_t(3) * dim, 7.0f), q_one(dim);
    for (int c = 0; c < dim; ++c) q_one[c] = q_wide[std::size_t(3) * c] = kvmem::to_float(q[c]);
    kk::simd::row_dots(q_wide.data(), 3, dim, row.data(), got);
    for (int k = 0; k < W; ++k) CHECK(kvmem_test::same_bits(got[k], kk::dot(q_one.data(), row[k], dim)));
    constexpr int RW = kk::simd::vector_registers ? W : 1;
    for (int n = 1; n <= RW; ++n) {  // a full group and the short groups at the end of the cache
      float l[RW];
      kk::row_group_dots<RW>(q.data(), dim, row.data(), n, l);
      for (int k = 0; k < n; ++k) CHECK(kvmem_test::same_bits(l[k], kk::dot(q.data(), row[k], dim)));
    }
  }
}

namespace {
// Device-callable accessors for add_weighted_rows (nvcc rejects host lambdas called from its
// KOKKOS_INLINE_FUNCTIONs): weight j and row j of a contiguous [n][row_len] block.
struct WeightAt {
  const float* w;
  KOKKOS_INLINE_FUNCTION float operator()(long j) const { return w[j]; }
};
template <class S>
struct RowAt {
  const S* v;
  long row_len;
  KOKKOS_INLINE_FUNCTION const S* operator()(long j) const { return v + j * row_len; }
};
}  // namespace

TEMPLATE_TEST_CASE("add_weighted_rows gives every channel the bits of its scalar chain over the rows",
                   "[dtype][simd][readout]", float, bfloat16, float16) {
  // The value side of the decode readout and of an eviction step: acc[c] = mul_add(w_j, v_j[c], acc[c]),
  // rows j in order. bfloat16 rows are read as channel pairs with the accumulators reordered once per call.
  using S = TestType;
  namespace kk = kvmem::kernels;
  constexpr int W = kk::simd::width;
  constexpr int CV = 8;
  for (long n : {0L, 1L, 5L, 33L}) {
    INFO("rows=" << n);
    const auto v_f = kvmem_test::uniform(std::size_t(n) * CV * W + 1, 50 + unsigned(n)),
               w_f = kvmem_test::uniform(std::size_t(n) + 1, 60 + unsigned(n)),
               a_f = kvmem_test::uniform(std::size_t(CV) * W, 70 + unsigned(n));
    std::vector<S> v;
    for (float x : v_f) v.push_back(kvmem::from_float<S>(8.0f * x));
    kk::simd::vec r[CV];
    for (int x = 0; x < CV; ++x) r[x] = kk::simd::load(a_f.data() + x * W);
    kk::simd::add_weighted_rows(r, n, WeightAt{w_f.data()}, RowAt<S>{v.data(), CV * W});
    float got[CV * W];
    for (int x = 0; x < CV; ++x) kk::simd::store(got + x * W, r[x]);
    long differ = 0;
    for (int c = 0; c < CV * W; ++c) {
      float want = a_f[c];
      for (long j = 0; j < n; ++j) want = kk::mul_add(w_f[j], kvmem::to_float(v[j * CV * W + c]), want);
      differ += !kvmem_test::same_bits(got[c], want);
    }
    CHECK(differ == 0);
  }
}

TEMPLATE_TEST_CASE("exact attention over bfloat16 / float16 tokens stays within the storage bound", "[dtype][exact]",
                   bfloat16, float16) {
  const long B = 2, T = 70, D = 20, Dv = 12;
  for (auto [Hq, Hkv] : {std::pair{1L, 1L}, {4L, 2L}, {40L, 1L}}) {
    INFO("Hq=" << Hq << " Hkv=" << Hkv);
    kvmem_test::exact_attention_within_bound<exec, TestType>(B, Hq, Hkv, T, D, Dv, kvmem_test::uniform(B * Hq * T * D, 21),
                                           kvmem_test::uniform(B * Hkv * T * D, 22),
                                           kvmem_test::uniform(B * Hkv * T * Dv, 23));
  }
}

namespace {

/// A KVM case whose merge decisions cannot depend on rounding: sinks = chunk - 1 and a fixed budget of one
/// chunk of rows leave one non-sink row, so every merged token routes to it and no token is ever ranked.
/// The bound then covers every output (docs/numerics.md: decisions are discrete; a near-tie may go either
/// way once keys are rounded, and the bound holds where the decisions are the reference's).
kvmem_test::KvmCase single_target_case(unsigned seed) {
  kvmem_test::KvmCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 72, c.D = 16, c.Dv = 12, c.seed = seed;
  c.lengths = {72, 45};
  c.params.chunk = 8, c.params.window_chunks = 2, c.params.rope_dims = 4, c.params.sinks = 7;
  c.params.schedule = kvmem_ref::Schedule::fixed, c.params.min_len = 8, c.params.max_chunks = 1;
  c.generate();
  return c;
}

/// The KVM memory over case c (inputs rounded to S here) against the float64 reference within the bound.
template <class S>
void kvm_within_bound(kvmem_test::KvmCase c, kvmem_test::Mode mode) {
  c.round_inputs<S>();
  INFO("seed " << c.seed << " mode " << static_cast<int>(mode));
  const auto got = kvmem_test::run_kvm<exec, S>(c, mode, c.T / 2);
  const double vmax = kvmem_test::value_norm_max(c);  // a read value's element is at most its row's radius
  // Held read keys and read values are rounded (u); the state's float32 sums over up to T tokens add
  // gamma(T) to the float32 terms (counted with D).
  const double u = kvmem::unit_roundoff<S>;
  const kvmem_test::StorageBound bound{u, u, u, double(c.D + c.T), double(c.T + c.params.chunk), kvmem_test::kvm_logit_abs(c), vmax};
  for (long b = 0; b < c.B; ++b) {
    const auto ref = kvmem_ref::kvm_prefill(c.sequence(b), c.params);
    REQUIRE(got.rows[b] == ref.rows);
    CHECK(kvmem_test::worst_abs_error(kvmem_test::sequence_y(got, c, b), ref.y) <= bound.value());
    // The merge sums are float32 of the same (rounded) inputs: they match as closely as in float32.
    CHECK(kvmem_test::relative_error(got.keys[b], ref.state_keys) <= 1e-4);
    CHECK(kvmem_test::relative_error(got.values[b], ref.state_values) <= 1e-4);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("kvm over bfloat16 / float16 tokens stays within the storage bound of float64", "[dtype][kvm]",
                   bfloat16, float16) {
  for (unsigned seed : {3u, 4u})
    for (auto mode : {kvmem_test::Mode::prefill, kvmem_test::Mode::decode})
      kvm_within_bound<TestType>(single_target_case(seed), mode);
}

namespace {
/// The first `T` tokens of the embedded real layer (examples/data/default.safetensors: a BERT layer's q,
/// k, v, B = 1, 2 heads, D = 32, neutral gate and weights) as a KVM case with one merge target (chunk 32,
/// sinks 31, a fixed budget of 32 rows).
kvmem_test::KvmCase embedded_layer_case(long T) {
  const auto file = kvmem::io::SafetensorsFile::read(KVMEM_EMBEDDED_LAYER);
  kvmem_test::KvmCase c;
  c.B = 1, c.Hq = 2, c.Hkv = 2, c.T = T, c.D = 32, c.Dv = 32;
  c.params.chunk = 32, c.params.window_chunks = 2, c.params.rope_dims = 0, c.params.sinks = 31;
  c.params.schedule = kvmem_ref::Schedule::fixed, c.params.min_len = 32, c.params.max_chunks = 1;
  auto tokens = [&](const char* name, long dim) {  // [1, 2, 4096, dim] -> the first T tokens of each head
    const auto all = kvmem::io::to_double(file.at(name), name);
    const long total = file.at(name).shape[2];
    std::vector<float> out;
    for (long h = 0; h < 2; ++h)
      for (long t = 0; t < T * dim; ++t) out.push_back(static_cast<float>(all[h * total * dim + t]));
    return out;
  };
  c.q = tokens("q", 32), c.k = tokens("k", 32), c.v = tokens("v", 32), c.gate = tokens("gate", 1);
  c.ln_weight.assign(32, 1.0f), c.ln_bias.assign(32, 0.0f), c.tau_state.assign(2, 1.0f), c.tau_bswa.assign(2, 1.0f);
  return c;
}
}  // namespace

TEMPLATE_TEST_CASE("on the embedded real layer, exact attention and kvm in bfloat16 / float16 stay within the bound",
                   "[dtype][kvm][exact][real]", bfloat16, float16) {
  const auto c = embedded_layer_case(512);
  kvmem_test::exact_attention_within_bound<exec, TestType>(1, 2, 2, c.T, 32, 32, c.q, c.k, c.v);
  for (auto mode : {kvmem_test::Mode::prefill, kvmem_test::Mode::decode}) kvm_within_bound<TestType>(c, mode);
}

TEMPLATE_TEST_CASE("kvm in bfloat16 / float16: prefill, decode and a split give the same bits", "[dtype][kvm][modes]",
                   bfloat16, float16) {
  // Full decisions (power-law growth: novelty ranking, routing among many rows), two sequences.
  kvmem_test::KvmCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 90, c.D = 16, c.Dv = 12, c.seed = 9, c.lengths = {90, 61};
  c.params.chunk = 8, c.params.window_chunks = 2, c.params.rope_dims = 4, c.params.sinks = 1;
  c.params.schedule = kvmem_ref::Schedule::power_law, c.params.min_len = 8, c.params.growth_factor = 2.0;
  c.params.max_chunks = 4;
  c.generate();
  using kvmem_test::Mode;
  const auto whole = kvmem_test::run_kvm<exec, TestType>(c, Mode::prefill);
  {
    // Its merge decisions are the float32 memory's on the same (rounded) tokens: scores and routes compare
    // float32 decision keys, KVM's window keys are the inputs as they are, so the state sums are the float32
    // memory's bit for bit; only what the readout reads is rounded.
    auto rounded = c;
    rounded.round_inputs<TestType>();
    const auto f32 = kvmem_test::run_kvm<exec, float>(rounded, Mode::prefill);
    CHECK(f32.rows == whole.rows);
    CHECK(f32.keys == whole.keys);
    CHECK(f32.values == whole.values);
    CHECK(f32.radius == whole.radius);
  }
  for (auto [mode, split] : {std::pair{Mode::decode, 0L}, {Mode::prefill_then_decode, 37L}}) {
    const auto other = kvmem_test::run_kvm<exec, TestType>(c, mode, split);
    long differ = 0;
    for (std::size_t i = 0; i < whole.y.size(); ++i) differ += !kvmem_test::same_bits(whole.y[i], other.y[i]);
    CHECK(differ == 0);
    CHECK(other.rows == whole.rows);
    CHECK(other.keys == whole.keys);
  }
}

TEST_CASE("a float16 memory saturates a read value beyond 65,504 instead of storing Inf", "[dtype][kvm]") {
  // One kv-head, D = Dv = 4, chunk 2, one sink: row 0 and row 1 are verbatim tokens; later tokens merge
  // into row 1. Row 1 is founded by v = (60000, 60000, 60000, 60000) (radius 120,000); merged values
  // (60000, 0, 0, 0) turn its direction towards channel 0, whose read value rho V_0 / ||V|| then exceeds
  // float16's range.
  using S = float16;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = 4, cfg.query_heads = cfg.kv_heads = 1;
  cfg.chunk = 2, cfg.window_chunks = 1, cfg.rope_dims = 0, cfg.sinks = 1, cfg.max_rows = 2;
  const long T = 40;
  Kokkos::View<S****, Kokkos::LayoutRight, Kokkos::HostSpace> q("q", 1, 1, T, 4), k("k", 1, 1, T, 4), v("v", 1, 1, T, 4),
      y("y", 1, 1, T, 4);
  for (long t = 0; t < T; ++t)
    for (int c = 0; c < 4; ++c) {
      q(0, 0, t, c) = kvmem::from_float<S>(c == 0 ? 1.0f : 0.0f);
      k(0, 0, t, c) = kvmem::from_float<S>(c == t % 4 ? 1.0f : -0.5f);
      v(0, 0, t, c) = kvmem::from_float<S>(t == 1 || c == 0 ? 60000.0f : 0.0f);
    }
  Kokkos::View<float*, Kokkos::HostSpace> ones("ones", 4), zeros("zeros", 4), tau("tau", 1);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(tau, 1.0f);
  kvmem::KvmMemory<exec, kvmem::budget::Fixed, S> mem(cfg, kvmem::budget::Fixed{2}, {ones, zeros, tau, tau}, 1);
  mem.prefill(q, k, v, {}, y);
  const auto& st = mem.rows();
  REQUIRE(mem.cursor(0).rows == 2);
  CHECK(kvmem::to_float(st.read_values(0, 0, 1, 0)) == 65504.0f);  // saturated, not Inf
  CHECK(st.values(0, 0, 1, 0) / st.values(0, 0, 1, 1) > 2.0f);      // the float32 sum itself is unchanged
  long nonfinite = 0;
  for (long t = 0; t < T; ++t)
    for (int c = 0; c < 4; ++c) nonfinite += !std::isfinite(kvmem::to_float(y(0, 0, t, c)));
  CHECK(nonfinite == 0);
}

TEST_CASE("a bfloat16 memory holds its window in half the bytes of a float32 one", "[dtype][kvm]") {
  kvmem_test::KvmCase c = single_target_case(5);
  kvmem::MemoryConfig cfg = c.config();
  Kokkos::View<float*, Kokkos::HostSpace> w("w", c.D), b("b", c.D), tau("tau", c.Hq);
  Kokkos::deep_copy(w, 1.0f);
  Kokkos::deep_copy(tau, 1.0f);
  kvmem::KvmMemory<exec, kvmem::budget::Fixed> f32(cfg, kvmem::budget::Fixed{8}, {w, b, tau, tau}, 2);
  kvmem::KvmMemory<exec, kvmem::budget::Fixed, bfloat16> bf16(cfg, kvmem::budget::Fixed{8}, {w, b, tau, tau}, 2);
  // Empty memories hold nothing; their allocations differ by 2 bytes per element of the read caches and of
  // the window ring (2 sequences x Hkv x (L + C) slots x (D + Dv) channels).
  CHECK(f32.held_bytes() == 0);
  CHECK(bf16.held_bytes() == 0);
  const long ring = 2L * cfg.kv_heads * (cfg.window() + cfg.chunk) * (cfg.head_dim + cfg.value_dim);
  const long halves = static_cast<long>(f32.rows().read_keys.span() + f32.rows().read_values.span()) * 2 + ring * 2;
  // ... less the float32 decision keys a 16-bit memory keeps beside its read keys.
  const long decision = static_cast<long>(bf16.rows().decision_keys.span()) * 4;
  CHECK(bf16.rows().decision_keys.span() == f32.rows().read_keys.span());
  CHECK(f32.allocated_bytes() - bf16.allocated_bytes() == halves - decision);
}
