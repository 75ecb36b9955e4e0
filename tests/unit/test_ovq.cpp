// The OVQ memory (KMeansCount x Novelty, one window chunk, no sinks) against the naive float64 reference
// (tests/reference/ovq_reference.hpp) over the spec's edge cases, prefill == decode, and thread counts.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <limits>
#include <random>

#include <kvmem/kvmem.hpp>

#include "../reference/ovq_reference.hpp"
#include "float_bits.hpp"
#include "kvm_harness.hpp"
#include "storage_bound.hpp"

namespace {

using exec = Kokkos::DefaultHostExecutionSpace;
using space = exec::memory_space;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, space>;

struct OvqCase {
  long B = 1, H = 2, T = 30, D = 6, Dv = 5, chunk = 4, N = 6;
  std::vector<long> lengths;
  bool normalize = false, duplicates = false;
  enum class Budget { plateau, linear, power_law } budget = Budget::plateau;
  unsigned seed = 1;
  std::vector<float> q, k, v, beta;

  long length(long b) const { return lengths.empty() ? T : lengths[b]; }
  /// Rounds q, k and v to the storage type S, as a memory of that type receives them.
  template <kvmem::StorageType S>
  void round_inputs() {
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = kvmem::to_float(kvmem::from_float<S>(e));
  }
  void generate() {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    auto fill = [&](std::vector<float>& x, std::size_t n) {
      x.resize(n);
      for (auto& e : x) e = normal(rng);
    };
    fill(q, B * H * T * D);
    fill(k, B * H * T * D);
    fill(v, B * H * T * Dv);
    beta.resize(H);
    for (auto& e : beta) e = 0.5f + 0.25f * std::abs(normal(rng));
    if (duplicates)  // repeated keys: ties in similarity, assignment and new-centroid choice
      for (long i = 0; i < B * H * T; ++i)
        if (i % 3 == 2) std::copy_n(&k[(i - 2) * D], D, &k[i * D]);
  }
  kvmem_ref::OvqParams params() const {
    kvmem_ref::OvqParams p;
    p.chunk = chunk;
    p.max_centroids = N;
    p.normalize_centroids = normalize;
    if (budget == Budget::linear) p.growth = kvmem_ref::OvqGrowth::min;
    if (budget == Budget::power_law) p.budget = [](long t) { return kvmem::budget::PowerLaw{-1, 2.0, 0.5, 1}.rows(t); };
    return p;
  }
  kvmem_ref::OvqSequence sequence(long b) const {
    kvmem_ref::OvqSequence s;
    s.T = length(b), s.D = D, s.Dv = Dv, s.H = H;
    for (long h = 0; h < H; ++h)
      for (long t = 0; t < s.T; ++t) {
        for (long c = 0; c < D; ++c) s.q.push_back(q[((b * H + h) * T + t) * D + c]);
        for (long c = 0; c < D; ++c) s.k.push_back(k[((b * H + h) * T + t) * D + c]);
        for (long c = 0; c < Dv; ++c) s.v.push_back(v[((b * H + h) * T + t) * Dv + c]);
      }
    s.beta.assign(beta.begin(), beta.end());
    return s;
  }
};

struct OvqOutput {
  std::vector<float> y;
  std::vector<float> lse;  // [B, H, T], the readout's log-sum-exp
  std::vector<long> rows;
  std::vector<std::vector<float>> keys, values, counts;
};

/// The OVQ memory over case c with tokens in the storage type S (outputs widened back to float), asking for
/// the readout's log-sum-exp (the AttentionMemory overloads with lse).
template <kvmem::StorageType S = float, class Budget, class Exec>
OvqOutput run_with(const OvqCase& c, const Budget& budget, bool decode, const Exec& ex) {
  using view4 = Kokkos::View<S****, Kokkos::LayoutRight, space>;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = static_cast<int>(c.D);
  cfg.value_dim = static_cast<int>(c.Dv);
  cfg.query_heads = cfg.kv_heads = static_cast<int>(c.H);
  cfg.chunk = static_cast<int>(c.chunk);
  cfg.window_chunks = 1;
  cfg.rope_dims = 0;
  cfg.sinks = 0;
  cfg.max_rows = c.N;
  cfg.normalize_rows = c.normalize;
  auto to4 = [&](const std::vector<float>& x, long d) {
    view4 out("x", c.B, c.H, c.T, d);
    std::vector<S> xs(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) xs[i] = kvmem::from_float<S>(x[i]);
    Kokkos::deep_copy(out, Kokkos::View<const S****, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                               xs.data(), c.B, c.H, c.T, d));
    return out;
  };
  const view4 q = to4(c.q, c.D), k = to4(c.k, c.D), v = to4(c.v, c.Dv);
  view4 y("y", c.B, c.H, c.T, c.Dv);
  Kokkos::View<float***, Kokkos::LayoutRight, space> lse("lse", c.B, c.H, c.T);
  Kokkos::deep_copy(lse, -std::numeric_limits<float>::infinity());  // what a prefill writes past a sequence
  Kokkos::View<float*, space> beta("beta", c.H);
  for (long h = 0; h < c.H; ++h) beta(h) = c.beta[h];
  using memory_t = kvmem::OvqMemory<Exec, Budget, S>;
  memory_t mem(cfg, budget, {{}, {}, beta, beta}, static_cast<int>(c.B), ex);
  std::vector<long> len(c.B);
  for (long b = 0; b < c.B; ++b) len[b] = c.length(b);
  if (!decode) {
    mem.prefill(typename memory_t::inputs{q, k, v, {}}, y, len, lse);
  } else {
    std::vector<unsigned char> active(c.B);
    for (long t = 0; t < c.T; ++t) {
      for (long b = 0; b < c.B; ++b) active[b] = t < len[b];
      const auto at = std::make_pair(t, t + 1);
      auto s4 = [&](const view4& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at, Kokkos::ALL); };
      mem.decode(typename memory_t::inputs{s4(q), s4(k), s4(v), {}}, s4(y), active,
                 Kokkos::subview(lse, Kokkos::ALL, Kokkos::ALL, at));
    }
  }
  OvqOutput out;
  for (std::size_t i = 0; i < y.size(); ++i) out.y.push_back(kvmem::to_float(y.data()[i]));
  out.lse.assign(lse.data(), lse.data() + lse.size());
  const auto& st = mem.rows();
  for (long b = 0; b < c.B; ++b) {
    const long m = mem.cursor(b).rows;
    out.rows.push_back(m);
    out.keys.emplace_back();
    out.values.emplace_back();
    out.counts.emplace_back();
    for (long h = 0; h < c.H; ++h)
      for (long i = 0; i < m; ++i) {
        for (long d = 0; d < c.D; ++d) out.keys[b].push_back(st.keys(b, h, i, d));
        for (long d = 0; d < c.Dv; ++d) out.values[b].push_back(st.values(b, h, i, d));
        out.counts[b].push_back(st.counts(b, h, i));
      }
  }
  return out;
}

template <class Exec = exec, kvmem::StorageType S = float>
OvqOutput run(const OvqCase& c, bool decode, const Exec& ex = Exec()) {
  switch (c.budget) {
    case OvqCase::Budget::linear: return run_with<S>(c, kvmem::budget::Linear{}, decode, ex);
    case OvqCase::Budget::power_law: return run_with<S>(c, kvmem::budget::PowerLaw{-1, 2.0, 0.5, 1}, decode, ex);
    default: return run_with<S>(c, kvmem::budget::Plateau{static_cast<double>(c.N)}, decode, ex);
  }
}

void check(OvqCase c) {
  c.generate();
  for (bool decode : {false, true}) {
    INFO("T=" << c.T << " C=" << c.chunk << " N=" << c.N << " B=" << c.B << " normalize=" << c.normalize
              << " budget=" << static_cast<int>(c.budget) << " decode=" << decode << " seed=" << c.seed);
    const auto got = run(c, decode);
    for (long b = 0; b < c.B; ++b) {
      const auto ref = kvmem_ref::ovq_prefill(c.sequence(b), c.params());
      REQUIRE(got.rows[b] == ref.rows);
      const auto y = kvmem_test::sequence_tokens(got.y, b, c.H, c.T, c.length(b), c.Dv);
      const auto lse = kvmem_test::sequence_tokens(got.lse, b, c.H, c.T, c.length(b), 1);
      CHECK(kvmem_test::relative_error(y, ref.y) <= 1e-4);
      CHECK(kvmem_test::relative_error(lse, ref.lse) <= 1e-4);
      CHECK(kvmem_test::relative_error(got.keys[b], ref.centroid_keys) <= 1e-4);
      CHECK(kvmem_test::relative_error(got.values[b], ref.centroid_values) <= 1e-4);
      CHECK(kvmem_test::relative_error(got.counts[b], ref.counts) == 0.0);
    }
  }
}

}  // namespace

TEST_CASE("ovq matches the float64 reference on the spec's edge cases", "[ovq][reference]") {
  auto with = [](auto edit) {
    OvqCase c;
    edit(c);
    check(c);
  };
  with([](OvqCase& c) { c.T = 3; });                               // T < C: no commit
  with([](OvqCase& c) { c.T = 4; });                               // one full chunk: committed eagerly
  with([](OvqCase& c) { c.T = 14; c.seed = 2; });                  // T not a multiple of C
  with([](OvqCase& c) { c.T = 40; c.chunk = 1; c.seed = 3; });     // chunk 1: the m == 0 quirk
  with([](OvqCase& c) { c.T = 25; c.N = 1; c.seed = 4; });         // max-centroids 1: never live
  with([](OvqCase& c) { c.T = 37; c.duplicates = true; c.seed = 5; });  // count and similarity ties
  with([](OvqCase& c) { c.T = 37; c.normalize = true; c.seed = 6; });
  with([](OvqCase& c) { c.T = 50; c.N = 40; c.chunk = 8; c.budget = OvqCase::Budget::linear; c.seed = 7; });
  with([](OvqCase& c) { c.T = 50; c.N = 30; c.chunk = 5; c.budget = OvqCase::Budget::power_law; c.seed = 8; });
  with([](OvqCase& c) { c.T = 33; c.B = 3; c.lengths = {33, 0, 17}; c.seed = 9; });  // ragged batch
  with([](OvqCase& c) { c.T = 64; c.N = 16; c.chunk = 8; c.D = 16; c.Dv = 8; c.seed = 10; });
}

TEST_CASE("ovq prefill and decode give the same bits; so do 1 and all OpenMP threads", "[ovq][modes]") {
  OvqCase c;
  c.T = 61;
  c.B = 2;
  c.lengths = {61, 40};
  c.N = 12;
  c.chunk = 4;
  c.generate();
  const auto a = run(c, false), b = run(c, true);
  REQUIRE(a.rows == b.rows);
  REQUIRE(a.y == b.y);
  REQUIRE(a.lse == b.lse);
  REQUIRE(a.keys == b.keys);
  REQUIRE(a.counts == b.counts);
#ifdef KOKKOS_ENABLE_OPENMP
  const auto one = run(c, false, Kokkos::OpenMP(1)), all = run(c, false, Kokkos::OpenMP());
  REQUIRE(one.y == all.y);
  REQUIRE(one.lse == all.lse);
  REQUIRE(one.keys == all.keys);
#endif
}

TEMPLATE_TEST_CASE("ovq over bfloat16 / float16 tokens stays within the storage bound of float64", "[ovq][dtype]",
                   kvmem::bfloat16, kvmem::float16) {
  // One centroid (linear growth capped at N = 1): every committed token joins row 0, so no decision can
  // depend on rounding and the bound of docs/numerics.md covers every output. Normalized window keys and
  // the centroid's read key and value are held in the storage type.
  using S = TestType;
  for (bool normalize : {false, true}) {
    OvqCase c;
    c.T = 30, c.B = 2, c.lengths = {30, 19}, c.N = 1, c.chunk = 4, c.normalize = normalize, c.seed = 12;
    c.budget = OvqCase::Budget::linear;
    c.generate();
    c.round_inputs<S>();
    double vmax = 0.0, beta = 0.0;
    for (float x : c.v) vmax = std::max(vmax, std::abs(double(x)));
    for (float x : c.beta) beta = std::max(beta, double(x));
    if (normalize) vmax = std::max(vmax, 1.0);  // a normalized centroid value has elements up to 1
    // logit = beta sqrt(D) qhat . key + log(count), |qhat . key| <= ||key|| <= 1 for every key read.
    const double u = kvmem::unit_roundoff<S>;
    const kvmem_test::StorageBound bound{u, u, u, double(c.D + c.T), double(c.T + 1), beta * std::sqrt(double(c.D)), vmax};
    for (bool decode : {false, true}) {
      INFO("normalize=" << normalize << " decode=" << decode);
      const auto got = run<exec, S>(c, decode);
      for (long b = 0; b < c.B; ++b) {
        const auto ref = kvmem_ref::ovq_prefill(c.sequence(b), c.params());
        REQUIRE(got.rows[b] == ref.rows);
        const auto y = kvmem_test::sequence_tokens(got.y, b, c.H, c.T, c.length(b), c.Dv);
        CHECK(kvmem_test::worst_abs_error(y, ref.y) <= bound.value());
        CHECK(kvmem_test::relative_error(got.counts[b], ref.counts) == 0.0);
      }
    }
  }
}

TEMPLATE_TEST_CASE("ovq in bfloat16 / float16: prefill and decode give the same bits", "[ovq][dtype][modes]",
                   kvmem::bfloat16, kvmem::float16) {
  OvqCase c;
  c.T = 61, c.B = 2, c.lengths = {61, 40}, c.N = 12, c.chunk = 4;
  c.generate();
  const auto a = run<exec, TestType>(c, false), b = run<exec, TestType>(c, true);
  REQUIRE(a.rows == b.rows);
  long differ = 0;
  for (std::size_t i = 0; i < a.y.size(); ++i) differ += !kvmem_test::same_bits(a.y[i], b.y[i]);
  CHECK(differ == 0);
  REQUIRE(a.keys == b.keys);
  REQUIRE(a.counts == b.counts);
}
