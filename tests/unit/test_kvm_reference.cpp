// The KVM kernels against the naive float64 reference (tests/reference/kvm_reference.hpp) on random
// inputs over the spec's edge cases, in prefill and in decode, on every host execution space built.
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <limits>
#include <string>

#include "kvm_harness.hpp"

using kvmem_ref::Schedule;
using kvmem_test::KvmCase;
using kvmem_test::Mode;

namespace {

/// Tolerance of float32 kernels against the float64 reference (the acceptance criterion).
constexpr double tolerance = 1e-4;

std::string describe(const KvmCase& c) {
  const auto& p = c.params;
  return "B=" + std::to_string(c.B) + " Hq=" + std::to_string(c.Hq) + " Hkv=" + std::to_string(c.Hkv) +
         " T=" + std::to_string(c.T) + " D=" + std::to_string(c.D) + " C=" + std::to_string(p.chunk) +
         " nb=" + std::to_string(p.window_chunks) + " r=" + std::to_string(p.rope_dims) + " S=" +
         std::to_string(p.sinks) + " schedule=" + std::to_string(static_cast<int>(p.schedule)) +
         " min_len=" + std::to_string(p.min_len) + " max_chunks=" + std::to_string(p.max_chunks) +
         " seed=" + std::to_string(c.seed) + " lengths=" + [&] {
           std::string l;
           for (long x : c.lengths) l += std::to_string(x) + ",";
           return l;
         }();
}

template <class ExecSpace>
void check_against_reference(KvmCase c, Mode mode) {
  c.generate();
  INFO(describe(c) << " mode=" << static_cast<int>(mode) << " space=" << ExecSpace::name());
  const auto got = kvmem_test::run_kvm<ExecSpace>(c, mode, c.T / 2);
  for (long b = 0; b < c.B; ++b) {
    INFO("sequence " << b << " length " << c.length(b));
    const auto ref = kvmem_ref::kvm_prefill(c.sequence(b), c.params);
    REQUIRE(got.rows[b] == ref.rows);
    CHECK(kvmem_test::relative_error(kvmem_test::sequence_y(got, c, b), ref.y) <= tolerance);
    CHECK(kvmem_test::relative_error(kvmem_test::sequence_lse(got, c, b), ref.lse) <= tolerance);
    CHECK(kvmem_test::relative_error(got.keys[b], ref.state_keys) <= tolerance);
    CHECK(kvmem_test::relative_error(got.values[b], ref.state_values) <= tolerance);
    CHECK(kvmem_test::relative_error(got.radius[b], ref.state_radius) <= tolerance);
    for (long h = 0; h < c.Hq; ++h)  // padding past the sequence: y zero, log-sum-exp -inf (no key read)
      for (long t = c.length(b); t < c.T; ++t) {
        for (long d = 0; d < c.Dv; ++d) REQUIRE(got.y[((b * c.Hq + h) * c.T + t) * c.Dv + d] == 0.0f);
        if (mode != Mode::decode) REQUIRE(got.lse[(b * c.Hq + h) * c.T + t] == -std::numeric_limits<float>::infinity());
      }
  }
}

/// The edge cases of the issue and spec KVM.md §4 and §9.
std::vector<KvmCase> edge_cases() {
  std::vector<KvmCase> cases;
  KvmCase base;
  base.params.chunk = 4, base.params.window_chunks = 2, base.params.rope_dims = 3, base.params.sinks = 1;
  auto add = [&](auto edit) { kvmem_test::add_case(cases, base, 11, edit); };
  add([](KvmCase& c) { c.T = 3; });                                         // T < chunk
  add([](KvmCase& c) { c.T = 1; });                                         // a single token
  add([](KvmCase& c) { c.T = 8; });                                         // T == window
  add([](KvmCase& c) { c.T = 12; });                                        // T == L + C: no update yet
  add([](KvmCase& c) { c.T = 13; });                                        // first update
  add([](KvmCase& c) { c.T = 37; });                                        // T not a multiple of chunk
  add([](KvmCase& c) { c.T = 60; c.params.schedule = Schedule::power_law; c.params.growth_factor = 2.0;
                       c.params.min_len = 2; c.params.max_chunks = 100; });  // growth capped by tokens
  add([](KvmCase& c) { c.T = 60; c.params.schedule = Schedule::saturation; c.params.saturation_n = 24;
                       c.params.min_len = 1; c.params.max_chunks = 100; });
  add([](KvmCase& c) { c.T = 50; c.params.schedule = Schedule::fixed; c.params.min_len = 2; });  // budget < chunk
  add([](KvmCase& c) { c.T = 50; c.params.schedule = Schedule::fixed; c.params.min_len = 9; c.params.max_chunks = 3; });
  add([](KvmCase& c) { c.T = 45; c.params.schedule = Schedule::power_law; c.params.growth_factor = 3.0;
                       c.params.min_len = 4; c.params.max_chunks = 2; c.params.round_down = 2; });
  add([](KvmCase& c) { c.T = 40; c.duplicate_tokens = true; c.params.schedule = Schedule::power_law;
                       c.params.growth_factor = 2.0; c.params.max_chunks = 100; });  // ties
  add([](KvmCase& c) { c.T = 40; c.zero_value_rows = true; });               // zero-norm values
  add([](KvmCase& c) { c.T = 41; c.Hq = 4; c.Hkv = 2; });                    // GQA
  add([](KvmCase& c) { c.T = 41; c.Hq = 3; c.Hkv = 3; c.params.sinks = 0; });
  add([](KvmCase& c) { c.T = 41; c.params.sinks = 3; });
  add([](KvmCase& c) { c.T = 41; c.params.rope_dims = 0; });
  add([](KvmCase& c) { c.T = 41; c.params.rope_dims = 8; });                 // r = D: code parity
  add([](KvmCase& c) { c.T = 30; c.params.chunk = 1; c.params.window_chunks = 1; c.params.sinks = 0;
                       c.params.schedule = Schedule::power_law; c.params.max_chunks = 100; });
  add([](KvmCase& c) { c.T = 35; c.params.chunk = 3; c.params.window_chunks = 3; });
  add([](KvmCase& c) { c.T = 33; c.B = 4; c.lengths = {33, 0, 14, 27}; c.params.schedule = Schedule::power_law;
                       c.params.growth_factor = 2.0; c.params.max_chunks = 100; });  // ragged batch
  add([](KvmCase& c) { c.T = 70; c.D = 16; c.Dv = 12; c.params.chunk = 8; c.params.rope_dims = 8;
                       c.params.schedule = Schedule::power_law; c.params.growth_factor = 4.0; c.params.max_chunks = 100; });
  return cases;
}

}  // namespace

TEST_CASE("kvm kernels match the float64 reference on the edge cases", "[kvm][reference]") {
  for (const auto& c : edge_cases())
    for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode})
      check_against_reference<Kokkos::DefaultHostExecutionSpace>(c, mode);
}

#ifdef KOKKOS_ENABLE_SERIAL
TEST_CASE("kvm kernels match the float64 reference on the edge cases (Serial)", "[kvm][reference]") {
  for (const auto& c : edge_cases())
    for (Mode mode : {Mode::prefill, Mode::decode}) check_against_reference<Kokkos::Serial>(c, mode);
}
#endif

#ifdef KOKKOS_ENABLE_OPENMP
TEST_CASE("kvm kernels match the float64 reference on the edge cases (OpenMP)", "[kvm][reference]") {
  for (const auto& c : edge_cases())
    for (Mode mode : {Mode::prefill, Mode::decode}) check_against_reference<Kokkos::OpenMP>(c, mode);
}
#endif

TEST_CASE("kvm kernels match the float64 reference on random configurations", "[kvm][reference][random]") {
  std::mt19937 rng(2024);
  for (int i = 0; i < 40; ++i) {
    KvmCase c;
    auto pick = [&](long lo, long hi) { return std::uniform_int_distribution<long>(lo, hi)(rng); };
    c.params.chunk = pick(1, 8);
    c.params.window_chunks = pick(1, 3);
    c.D = pick(3, 12);
    c.Dv = pick(1, 10);
    // r = D - 1 leaves one free channel: every memory key is the same vector up to sign, so routing is
    // a tie broken by rounding noise that no float32 kernel can share with a float64 reference.
    c.params.rope_dims = i % 7 == 0 ? c.D : pick(0, c.D - 2);
    c.params.sinks = pick(0, c.params.chunk - 1);
    c.Hkv = pick(1, 2);
    c.Hq = c.Hkv * pick(1, 3);
    c.T = pick(0, 90);
    c.B = pick(1, 3);
    if (c.B > 1) {
      c.lengths.resize(c.B);
      for (auto& l : c.lengths) l = pick(0, c.T);
    }
    c.params.schedule = static_cast<Schedule>(pick(0, 2));
    c.params.min_len = pick(-1, 12);
    c.params.growth_factor = 0.5 * static_cast<double>(pick(1, 8));
    c.params.growth_exponent = i % 3 == 0 ? 0.5 : 0.25 * static_cast<double>(pick(1, 3));
    c.params.round_down = pick(1, 3);
    c.params.saturation_n = static_cast<double>(pick(4, 64));
    c.params.max_chunks = pick(1, 30);
    c.seed = static_cast<unsigned>(100 + i);
    check_against_reference<Kokkos::DefaultHostExecutionSpace>(c, i % 2 ? Mode::decode : Mode::prefill);
  }
}

#ifdef KOKKOS_ENABLE_CUDA
TEST_CASE("kvm kernels match the float64 reference on the edge cases (Cuda)", "[kvm][reference][cuda]") {
  for (const auto& c : edge_cases())
    for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode})
      check_against_reference<Kokkos::Cuda>(c, mode);
}
#endif
