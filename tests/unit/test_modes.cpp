// One meaning for prefill and decode, and the same bits on every host backend (spec KVM.md §6).
#include <catch2/catch_test_macros.hpp>
#include <type_traits>
#include <vector>

#include "kvm_harness.hpp"

using kvmem_ref::Schedule;
using kvmem_test::KvmCase;
using kvmem_test::Mode;

namespace {
KvmCase growing_case(long T, long chunk, long B = 1) {
  KvmCase c;
  c.B = B;
  c.T = T;
  c.Hq = 4;
  c.Hkv = 2;
  c.D = 16;
  c.Dv = 8;
  c.params.chunk = chunk;
  c.params.window_chunks = 2;
  c.params.rope_dims = 4;
  c.params.sinks = chunk > 1 ? 1 : 0;
  c.params.schedule = Schedule::power_law;
  c.params.growth_factor = 2.0;
  c.params.min_len = chunk;
  c.params.max_chunks = 1000;
  c.seed = static_cast<unsigned>(T * 31 + chunk);
  if (B > 1) {
    c.lengths.resize(B);
    for (long b = 0; b < B; ++b) c.lengths[b] = T - (b * 7) % T;
  }
  c.generate();
  return c;
}

void require_same_bits(const kvmem_test::KvmOutput& a, const kvmem_test::KvmOutput& b) {
  REQUIRE(a.rows == b.rows);
  REQUIRE(a.y == b.y);
  REQUIRE(a.lse == b.lse);
  REQUIRE(a.keys == b.keys);
  REQUIRE(a.values == b.values);
  REQUIRE(a.radius == b.radius);
}
}  // namespace

TEST_CASE("prefill and decode token by token give the same bits", "[kvm][modes]") {
  for (long T : {1L, 7L, 16L, 33L, 49L, 50L, 131L})
    for (long chunk : {1L, 4L, 8L}) {
      INFO("T=" << T << " chunk=" << chunk);
      const auto c = growing_case(T, chunk);
      require_same_bits(kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, Mode::prefill),
                        kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, Mode::decode));
    }
}

TEST_CASE("a cache built by prefill continues in decode", "[kvm][modes]") {
  const auto c = growing_case(101, 8, 3);
  const auto whole = kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, Mode::prefill);
  for (long split : {0L, 1L, 8L, 24L, 33L, 64L, 100L}) {
    INFO("split=" << split);
    require_same_bits(whole, kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, Mode::prefill_then_decode, split));
  }
}

TEST_CASE("reruns give the same bits", "[kvm][determinism]") {
  // Prefill, decode and prefill-then-decode, each run twice on the same inputs (a ragged batch with ties).
  auto c = growing_case(150, 8, 3);
  c.duplicate_tokens = true;
  c.zero_value_rows = true;
  c.generate();
  for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode}) {
    INFO("mode=" << static_cast<int>(mode));
    require_same_bits(kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, mode, 61),
                      kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, mode, 61));
  }
}

#ifdef KOKKOS_ENABLE_OPENMP
TEST_CASE("OpenMP on one thread, on two threads and on every thread give the same bits", "[kvm][backends][determinism]") {
  const int all = Kokkos::OpenMP().concurrency();
  if (all < 2) WARN("the OpenMP pool has " << all << " thread(s): nothing to compare against one thread");
  for (long T : {20L, 97L, 200L}) {
    const auto c = growing_case(T, 8, 3);
    for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode}) {
      INFO("T=" << T << " mode=" << static_cast<int>(mode));
      const auto one = kvmem_test::run_kvm(c, mode, 13, Kokkos::OpenMP(1));
      if (all >= 2) require_same_bits(one, kvmem_test::run_kvm(c, mode, 13, Kokkos::OpenMP(2)));
      if (all > 2) require_same_bits(one, kvmem_test::run_kvm(c, mode, 13, Kokkos::OpenMP()));
    }
  }
}
#endif

#if defined(KOKKOS_ENABLE_OPENMP) && defined(KOKKOS_ENABLE_SERIAL)
TEST_CASE("Serial and OpenMP give the same bits", "[kvm][backends]") {
  for (long T : {20L, 97L, 200L}) {
    const auto c = growing_case(T, 8, 3);
    for (Mode mode : {Mode::prefill, Mode::decode}) {
      INFO("T=" << T << " mode=" << static_cast<int>(mode));
      require_same_bits(kvmem_test::run_kvm<Kokkos::Serial>(c, mode), kvmem_test::run_kvm<Kokkos::OpenMP>(c, mode));
    }
  }
}
#endif

TEST_CASE("KVM with H2O row eviction: prefill, decode, a split and every host backend give the same bits",
          "[kvm][modes][row-eviction]") {
  // One sequence and one kv-head, so that a fold's team on OpenMP has every thread (the evict pass of the
  // update kernel split over them), and a row cap that power-law growth passes early, so most folds evict.
  auto c = growing_case(200, 8);
  c.Hq = 2, c.Hkv = 1;
  c.generate();
  const kvmem::score::RowAccumulatedAttention h2o{.max_rows = 12};
  using host = Kokkos::DefaultHostExecutionSpace;
  auto run = [&](Mode mode, const auto& exec) { return kvmem_test::run_kvm<std::remove_cvref_t<decltype(exec)>, float>(c, mode, 61, exec, h2o); };
  const auto whole = run(Mode::prefill, host());
  REQUIRE(whole.rows == std::vector<long>{12});  // the cap was reached: rows were evicted
  require_same_bits(whole, run(Mode::decode, host()));
  require_same_bits(whole, run(Mode::prefill_then_decode, host()));
#ifdef KOKKOS_ENABLE_SERIAL
  require_same_bits(whole, run(Mode::prefill, Kokkos::Serial()));
#endif
#ifdef KOKKOS_ENABLE_OPENMP
  require_same_bits(whole, run(Mode::prefill, Kokkos::OpenMP(1)));
#endif
}

TEST_CASE("exact causal attention equals a memory whose window holds every token", "[exact]") {
  // With T <= L the memory never reads its state: its output is exact causal attention with tau_bswa.
  auto c = growing_case(48, 8);
  c.params.window_chunks = 6;
  c.tau_bswa.assign(c.Hq, 1.0f);
  const auto mem = kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, Mode::prefill);
  using space = Kokkos::HostSpace;
  Kokkos::View<const float****, Kokkos::LayoutRight, space, Kokkos::MemoryUnmanaged> q(c.q.data(), 1, c.Hq, c.T, c.D),
      k(c.k.data(), 1, c.Hkv, c.T, c.D), v(c.v.data(), 1, c.Hkv, c.T, c.Dv);
  Kokkos::View<float****, Kokkos::LayoutRight, space> y("y", 1, c.Hq, c.T, c.Dv);
  kvmem::kernels::exact_causal_attention(Kokkos::DefaultHostExecutionSpace(), q, k, v, y);
  REQUIRE(std::vector<float>(y.data(), y.data() + y.size()) == mem.y);
}
