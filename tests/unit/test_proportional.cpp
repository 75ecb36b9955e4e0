// merge::Proportional (ProportionalMemory) against the float64 reference (tests/reference/kvm_reference.hpp,
// MergeRule::proportional) on random inputs over the chunk schedule's edge cases and every budget schedule,
// in prefill and in decode; prefill == decode bit for bit; a memory that holds every token as its own row is
// exact causal attention; the fold's count saturation.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>

#include <kvmem/kernels/readout/exact_attention.hpp>

#include "kvm_harness.hpp"

using kvmem_ref::MergeRule;
using kvmem_ref::Schedule;
using kvmem_test::KvmCase;
using kvmem_test::Mode;

namespace {

using host = Kokkos::DefaultHostExecutionSpace;

/// Tolerance of float32 kernels against the float64 reference (as KVM's).
constexpr double tolerance = 1e-4;

template <class ExecSpace = host>
kvmem_test::KvmOutput run(const KvmCase& c, Mode mode, long split = 0, const ExecSpace& exec = ExecSpace()) {
  return kvmem_test::run_kvm<ExecSpace, float, kvmem::score::KeepRows, kvmem::merge::Proportional>(c, mode, split, exec);
}

std::string describe(const KvmCase& c) {
  const auto& p = c.params;
  return "B=" + std::to_string(c.B) + " Hq=" + std::to_string(c.Hq) + " Hkv=" + std::to_string(c.Hkv) + " T=" +
         std::to_string(c.T) + " D=" + std::to_string(c.D) + " C=" + std::to_string(p.chunk) + " nb=" +
         std::to_string(p.window_chunks) + " S=" + std::to_string(p.sinks) + " schedule=" +
         std::to_string(static_cast<int>(p.schedule)) + " min_len=" + std::to_string(p.min_len) +
         " max_chunks=" + std::to_string(p.max_chunks) + " seed=" + std::to_string(c.seed);
}

/// y, the rows' sums and counts of the memory against the reference, per sequence.
void check_reference(const KvmCase& c, const kvmem_test::KvmOutput& got) {
  for (long b = 0; b < c.B; ++b) {
    INFO("sequence " << b << " length " << c.length(b));
    const auto ref = kvmem_ref::kvm_prefill(c.sequence(b), c.params);
    REQUIRE(got.rows[b] == ref.rows);
    CHECK(kvmem_test::relative_error(kvmem_test::sequence_y(got, c, b), ref.y) <= tolerance);
    CHECK(kvmem_test::relative_error(kvmem_test::sequence_lse(got, c, b), ref.lse) <= tolerance);
    CHECK(kvmem_test::relative_error(got.keys[b], ref.state_keys) <= tolerance);
    CHECK(kvmem_test::relative_error(got.values[b], ref.state_values) <= tolerance);
    std::vector<double> counts(ref.state_counts.begin(), ref.state_counts.end());
    std::vector<float> got_counts(got.counts[b].begin(), got.counts[b].end());
    CHECK(kvmem_test::relative_error(got_counts, counts) == 0.0);  // counts are exact integers
  }
}

bool same_bits(const kvmem_test::KvmOutput& a, const kvmem_test::KvmOutput& b) {
  return a.y.size() == b.y.size() && std::memcmp(a.y.data(), b.y.data(), a.y.size() * sizeof(float)) == 0 &&
         a.lse.size() == b.lse.size() && std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0 &&
         a.rows == b.rows && a.keys == b.keys && a.values == b.values && a.counts == b.counts;
}

std::vector<KvmCase> edge_cases() {
  std::vector<KvmCase> cases;
  KvmCase base;
  base.params.rule = MergeRule::proportional;
  base.params.chunk = 4, base.params.window_chunks = 2, base.params.rope_dims = 0, base.params.sinks = 1;
  auto add = [&](auto edit) { kvmem_test::add_case(cases, base, 71, edit); };
  add([](KvmCase& c) { c.T = 3; });   // T < chunk
  add([](KvmCase& c) { c.T = 1; });   // a single token
  add([](KvmCase& c) { c.T = 12; });  // T == L + C: no fold yet
  add([](KvmCase& c) { c.T = 13; });  // the first fold
  add([](KvmCase& c) { c.T = 37; });  // T not a multiple of the chunk
  add([](KvmCase& c) { c.T = 50; c.params.min_len = 2; });  // budget < chunk: most tokens merge
  add([](KvmCase& c) { c.T = 50; c.params.min_len = 9; c.params.max_chunks = 3; });
  add([](KvmCase& c) { c.T = 60; c.params.schedule = Schedule::power_law; c.params.growth_factor = 2.0;
                       c.params.min_len = 2; c.params.max_chunks = 100; });
  add([](KvmCase& c) { c.T = 60; c.params.schedule = Schedule::saturation; c.params.saturation_n = 24;
                       c.params.min_len = 1; c.params.max_chunks = 100; });
  add([](KvmCase& c) { c.T = 40; c.duplicate_tokens = true; c.params.min_len = 5; });  // routing ties
  add([](KvmCase& c) { c.T = 41; c.Hq = 4; c.Hkv = 2; c.params.min_len = 6; });         // GQA
  add([](KvmCase& c) { c.T = 41; c.params.sinks = 0; c.params.min_len = 6; });
  add([](KvmCase& c) { c.T = 41; c.params.sinks = 3; c.params.min_len = 6; });
  add([](KvmCase& c) { c.T = 35; c.params.chunk = 3; c.params.window_chunks = 3; c.params.min_len = 5; });
  add([](KvmCase& c) { c.T = 33; c.B = 4; c.lengths = {33, 0, 14, 27}; c.params.schedule = Schedule::power_law;
                       c.params.growth_factor = 2.0; c.params.max_chunks = 100; });  // ragged batch
  add([](KvmCase& c) { c.T = 70; c.D = 16; c.Dv = 12; c.params.chunk = 8; c.params.min_len = 12;
                       c.params.max_chunks = 4; });
  return cases;
}

}  // namespace

TEST_CASE("proportional merge matches the float64 reference on the edge cases", "[proportional][reference]") {
  for (auto c : edge_cases()) {
    c.generate();
    INFO(describe(c));
    for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode}) {
      INFO("mode " << static_cast<int>(mode));
      check_reference(c, run(c, mode, c.T / 2));
    }
  }
}

TEST_CASE("proportional merge: prefill, decode and a prefill continued in decode give the same bits",
          "[proportional][modes]") {
  for (auto c : edge_cases()) {
    c.generate();
    INFO(describe(c));
    const auto whole = run(c, Mode::prefill);
    REQUIRE(same_bits(whole, run(c, Mode::decode)));
    for (long split : {1L, 5L, c.T / 2, c.T - 1})
      if (split > 0 && split < c.T) {
        INFO("split " << split);
        REQUIRE(same_bits(whole, run(c, Mode::prefill_then_decode, split)));
      }
  }
}

#ifdef KOKKOS_ENABLE_OPENMP
TEST_CASE("proportional merge: OpenMP on one thread and on every thread (and Serial) give the same bits",
          "[proportional][backends][determinism]") {
  auto c = edge_cases().back();
  c.B = 3, c.lengths = {70, 23, 51};
  c.generate();
  for (Mode mode : {Mode::prefill, Mode::decode}) {
    const auto one = run<Kokkos::OpenMP>(c, mode, 0, Kokkos::OpenMP(1));
    REQUIRE(same_bits(one, run<Kokkos::OpenMP>(c, mode)));
#ifdef KOKKOS_ENABLE_SERIAL
    REQUIRE(same_bits(one, run<Kokkos::Serial>(c, mode)));
#endif
  }
}
#endif

TEST_CASE("proportional merge that holds every token as its own row is exact causal attention",
          "[proportional][exact]") {
  KvmCase c;
  c.params.rule = MergeRule::proportional;
  c.params.chunk = 4, c.params.window_chunks = 2, c.params.sinks = 1, c.params.rope_dims = 0;
  c.params.min_len = 1000, c.params.max_chunks = 1000;  // room for every token
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 57, c.D = 16, c.Dv = 8;
  c.generate();
  std::fill(c.tau_state.begin(), c.tau_state.end(), 1.0f);  // the model's own scale 1 / sqrt(D)
  std::fill(c.tau_bswa.begin(), c.tau_bswa.end(), 1.0f);
  using view4 = Kokkos::View<float****, Kokkos::LayoutRight, Kokkos::HostSpace>;
  auto to4 = [&](std::vector<float>& x, long h, long d) { return view4(x.data(), c.B, h, c.T, d); };
  view4 y("y", c.B, c.Hq, c.T, c.Dv);
  kvmem::kernels::exact_causal_attention(Kokkos::DefaultHostExecutionSpace(), to4(c.q, c.Hq, c.D), to4(c.k, c.Hkv, c.D),
                                         to4(c.v, c.Hkv, c.Dv), y);
  Kokkos::fence();
  for (Mode mode : {Mode::prefill, Mode::decode}) {
    const auto got = run(c, mode);
    const long C = c.params.chunk, L = C * c.params.window_chunks;
    REQUIRE(got.rows[0] == (c.T + C - 1) / C * C - L);  // every token that left the window founded a row
    for (float n : got.counts[0]) REQUIRE(n == 1.0f);
    // float32 rounding: the same logits, summed in another order
    CHECK(kvmem_test::relative_error(got.y, std::span<const float>(y.data(), y.size())) <= 1e-6);
    // The log-sum-exp is exact attention's: log sum_{p <= u} exp(q_u . k_p / sqrt(D)), in float64 here.
    kvmem_test::WorstError worst_lse;
    const long G = c.Hq / c.Hkv;
    for (long b = 0; b < c.B; ++b)
      for (long h = 0; h < c.Hq; ++h)
        for (long u = 0; u < c.T; ++u) {
          std::vector<double> logits;
          for (long p = 0; p <= u; ++p) {
            double d = 0;
            for (long x = 0; x < c.D; ++x)
              d += double(c.q[((b * c.Hq + h) * c.T + u) * c.D + x]) * c.k[((b * c.Hkv + h / G) * c.T + p) * c.D + x];
            logits.push_back(d / std::sqrt(double(c.D)));
          }
          const double mx = *std::max_element(logits.begin(), logits.end());
          double sum = 0;
          for (double l : logits) sum += std::exp(l - mx);
          worst_lse.add(got.lse[(b * c.Hq + h) * c.T + u], mx + std::log(sum));
        }
    CHECK(worst_lse <= 1e-5);
  }
}

TEST_CASE("proportional merge: a row's count saturates at 2^24 and the row stays a mean", "[proportional][numerics]") {
  using P = kvmem::merge::Proportional;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = 2, cfg.value_dim = 1;
  float key[2] = {4.0f, -2.0f}, value[1] = {8.0f}, count = P::max_count - 1.0f, radius = 0;
  const float x[2] = {1.0f, 3.0f}, xv[1] = {-1.0f};
  const kvmem::merge::Row row{key, value, &radius, &count};
  P::fold(cfg, row, x, xv, 0.5f);  // the gate is ignored: 2^24 - 1 + 1 is exact
  REQUIRE(count == P::max_count);
  REQUIRE(key[0] == 5.0f);
  REQUIRE(key[1] == 1.0f);
  REQUIRE(value[0] == 7.0f);
  P::fold(cfg, row, x, xv, 1.0f);  // saturated: sums scaled by 1 - 2^-24, then the token added
  REQUIRE(count == P::max_count);
  const float keep = 1.0f - 1.0f / P::max_count;
  REQUIRE(key[0] == kvmem::kernels::mul_add(5.0f, keep, 1.0f));
  REQUIRE(key[1] == kvmem::kernels::mul_add(1.0f, keep, 3.0f));
  REQUIRE(value[0] == kvmem::kernels::mul_add(7.0f, keep, -1.0f));
  float read[2];
  P::read_key(cfg, {}, row, read);  // still read as sum / count
  REQUIRE(read[0] == key[0] * (1.0f / P::max_count));
  REQUIRE(P::row_bias(row) == Kokkos::log(P::max_count));
}
