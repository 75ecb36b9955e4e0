// The device-written parts of the readout on tensor cores (kernels/readout/flashinfer.hpp) on the CPU
// backends, where they run as on a GPU: the schedule and page tables FlashInfer reads (flashinfer_schedule)
// against a host reference of the same schedule, written from the documented rules; the logit scales and
// row biases (flashinfer_readout_scales) against Merge's hooks; and the log-sum-exp merge of two segments
// (flashinfer_merge_segments) against a float64 merge. FlashInfer's own launch runs only on a GPU
// (test_flashinfer_readout.cpp).
#include <Kokkos_Core.hpp>
#include <catch2/catch_test_macros.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <kvmem/kernels/readout/flashinfer.hpp>
#include <kvmem/policy/merge/k_means_count.hpp>
#include <kvmem/policy/merge/winner_take_all.hpp>

#include "worst_error.hpp"

namespace kk = kvmem::kernels;
using exec = Kokkos::DefaultExecutionSpace;
using space = exec::memory_space;

namespace {

/// A step plan of B sequences from (query_begin, query_end, window_begin_pos, read_rows, input_offset).
struct PlanRow {
  long begin, end, window_begin, rows, offset;
};

kk::StepPlan<space> make_plan(const std::vector<PlanRow>& rows) {
  kk::StepPlan<space> plan;
  plan.allocate(static_cast<int>(rows.size()));
  plan.clear();
  for (std::size_t b = 0; b < rows.size(); ++b) {
    plan.host(b, kk::query_begin) = rows[b].begin;
    plan.host(b, kk::query_end) = rows[b].end;
    plan.host(b, kk::window_begin_pos) = rows[b].window_begin;
    plan.host(b, kk::read_rows) = rows[b].rows;
    plan.host(b, kk::input_offset) = rows[b].offset;
  }
  plan.upload(exec());
  exec().fence();
  return plan;
}

template <class View>
auto host(const View& v) {
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
}

/// The schedule of a Memory's step written on the device against the rules of flashinfer_schedule, computed
/// here on the host from the same plan.
void check_schedule(const std::vector<PlanRow>& plan_rows, long M, int G, int Hkv, long R, long S, long q_step) {
  const long B = static_cast<long>(plan_rows.size());
  const auto plan = make_plan(plan_rows);
  kvmem::state::WindowRing<space, kvmem::bfloat16> ring;
  ring.allocate(static_cast<int>(B), Hkv, S, 8, 8);
  const kk::FlashInferShape sh(B, M, G, R, S);
  kk::FlashInferWork<space, kvmem::bfloat16> work;
  work.reserve(exec(), B, M, G * Hkv, Hkv, R, S, 8, sh.most_blocks(), sh.most_chunks());
  const kk::PlanCounts<decltype(plan.device), decltype(ring)> counts{plan.device, ring, Hkv};
  kk::flashinfer_schedule(exec(), counts, q_step, S, sh, G, work);
  exec().fence();
  const auto tiles = host(work.tiles);
  const auto valid = host(work.valid);
  const auto lens = host(work.lens);
  const auto indptr = host(work.indptr);
  const auto pages = host(work.window_pages);
  const auto state_pages = host(work.state_pages);
  const auto chunk = host(work.chunk_size);
  const auto rows = host(work.rows);
  auto queries = [&](long b) { return plan_rows[b].end - plan_rows[b].begin; };
  auto keys = [&](int s, long b) {
    if (queries(b) <= 0) return 0L;
    return s == 0 ? plan_rows[b].rows : plan_rows[b].end - plan_rows[b].window_begin;
  };
  const long packed = M * G, tile = packed > 64 ? 128 : packed > 16 ? 64 : 16, n_tiles = (packed + tile - 1) / tile;
  REQUIRE(sh.tile == tile);
  REQUIRE(sh.tiles == n_tiles);
  long mismatches = 0;
  for (int s = 0; s < 2; ++s) {
    const long keys_max = s == 0 ? R : S;
    const long chunks = M == 1 && keys_max > 1024 ? (keys_max + 1023) / 1024 : 1;
    REQUIRE(sh.chunks[s] == chunks);
    REQUIRE(sh.blocks[s] == B * n_tiles * chunks);
    long x = 0;
    for (long b = 0; b < B; ++b)
      for (long t = 0; t < n_tiles; ++t)
        for (long c = 0; c < chunks; ++c, ++x) {
          mismatches += tiles(s, 0, x) != b || tiles(s, 1, x) != t || tiles(s, 2, x) != c;
          mismatches += valid(s, x) != (t * tile < queries(b) * G && c * 1024 < keys(s, b));
        }
    if (chunks > 1) {  // partition offsets: the chunks of the sequences before b that have a query
      long offset = 0;
      for (long b = 0; b <= B; ++b) {
        mismatches += indptr(4 + s, b) != offset;
        if (b < B && queries(b) > 0) offset += (keys(s, b) + 1023) / 1024;
      }
    }
  }
  for (long b = 0; b <= B; ++b) {
    const long first = b < B && queries(b) > 0 ? plan_rows[b].begin - plan_rows[b].offset : 0;
    mismatches += indptr(0, b) != b * q_step + first;
    mismatches += indptr(1, b) != b * M || indptr(2, b) != b || indptr(3, b) != b * S;
    if (b == B) continue;
    mismatches += lens(0, b) != queries(b) || lens(1, b) != keys(0, b) || lens(2, b) != keys(1, b) || lens(3, b) != 1;
    mismatches += state_pages(b) != b;
    for (long j = 0; j < S; ++j) mismatches += pages(b * S + j) != b * Hkv * S + (plan_rows[b].window_begin + j) % S;
  }
  CHECK(chunk(0) == 1024);
  CHECK(rows(0) == static_cast<std::uint32_t>(B));
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("the tensor-core schedule written on the device is the host reference's", "[flashinfer][schedule]") {
  SECTION("prefill: ragged queries, a sequence without queries, one without state rows, G = 4") {
    // (query_begin, query_end, window_begin, read_rows, input_offset)
    check_schedule({{0, 100, 0, 0, 0}, {64, 64, 0, 12, 0}, {300, 333, 200, 40, 300}}, 100, 4, 2, 64, 160, 120);
  }
  SECTION("prefill: one query tile of 16 (G = 1, M = 16) and a window wrapping around the ring") {
    check_schedule({{1000, 1016, 950, 30, 1000}, {5, 20, 0, 0, 5}}, 16, 1, 3, 32, 80, 16);
  }
  SECTION("decode: KV partitions of 1,024 keys for a state of 2,048 rows and a ring of 1,344 slots") {
    check_schedule({{5000, 5001, 3700, 1500, 5000}, {900, 900, 0, 0, 900}, {2000, 2001, 700, 1024, 2000},
                    {1400, 1401, 57, 1, 1400}},
                   1, 8, 2, 2048, 1344, 1);
  }
  SECTION("decode: no partition below 1,025 keys") {
    check_schedule({{10, 11, 0, 5, 10}, {700, 701, 400, 300, 700}}, 1, 2, 1, 1024, 1024, 4);
  }
}

TEST_CASE("exact attention's tensor-core schedule: every sequence's queries over the first keys", "[flashinfer][schedule]") {
  for (long M : {1L, 37L})
    for (long keys : {1L, 1024L, 1025L, 3000L}) {
      INFO("M=" << M << " keys=" << keys);
      const long B = 3;
      const int G = 4;
      const kk::FlashInferShape sh(B, M, G, keys, 0);
      kk::FlashInferWork<space, kvmem::float16> work;
      work.reserve(exec(), B, M, G * 2, 2, 0, 0, 8, sh.most_blocks(), sh.most_chunks());
      kk::flashinfer_schedule(exec(), kk::UniformCounts{M, keys}, 7 * M, 0, sh, G, work);
      exec().fence();
      const auto lens = host(work.lens);
      const auto indptr = host(work.indptr);
      const auto valid = host(work.valid);
      const long chunks = M == 1 && keys > 1024 ? (keys + 1023) / 1024 : 1;
      REQUIRE(sh.chunks[0] == chunks);
      REQUIRE(sh.chunks[1] == 1);
      long mismatches = 0;
      for (long b = 0; b < B; ++b) {
        mismatches += lens(0, b) != M || lens(1, b) != keys || lens(2, b) != 0;
        mismatches += indptr(0, b) != b * 7 * M;
        if (chunks > 1) mismatches += indptr(4, b) != b * chunks;
      }
      for (long x = 0; x < sh.blocks[1]; ++x) mismatches += valid(1, x);  // no window: segment 1 never runs
      CHECK(mismatches == 0);
    }
}

TEST_CASE("the tensor-core readout's logit scales and row biases are the merge policy's", "[flashinfer][schedule]") {
  const long B = 2, M = 5, R = 8, Hq = 4, Hkv = 2, D = 8;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = static_cast<int>(D), cfg.query_heads = static_cast<int>(Hq), cfg.kv_heads = static_cast<int>(Hkv);
  cfg.chunk = 4, cfg.rope_dims = 0;
  const auto plan = make_plan({{10, 15, 0, 6, 10}, {3, 5, 0, 0, 0}});
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  Kokkos::View<kvmem::bfloat16****, Kokkos::LayoutRight, space> q("q", B, Hq, 6, D);
  auto qh = Kokkos::create_mirror_view(q);
  for (std::size_t i = 0; i < qh.size(); ++i) qh.data()[i] = kvmem::from_float<kvmem::bfloat16>(normal(rng));
  Kokkos::deep_copy(q, qh);
  kvmem::state::StateRows<space, kvmem::bfloat16> rows;
  rows.allocate(static_cast<int>(B), static_cast<int>(Hkv), R, static_cast<int>(D), static_cast<int>(D));
  auto counts_h = Kokkos::create_mirror_view(rows.counts);
  for (std::size_t i = 0; i < counts_h.size(); ++i) counts_h.data()[i] = 1.0f + static_cast<float>(i % 7);
  Kokkos::deep_copy(rows.counts, counts_h);
  Kokkos::View<float*, space> tau_s("tau_s", Hq), tau_w("tau_w", Hq);
  auto ts = Kokkos::create_mirror_view(tau_s), tw = Kokkos::create_mirror_view(tau_w);
  for (long h = 0; h < Hq; ++h) ts(h) = 0.5f + 0.25f * h, tw(h) = 2.0f - 0.125f * h;
  Kokkos::deep_copy(tau_s, ts);
  Kokkos::deep_copy(tau_w, tw);
  const kvmem::LayerWeightsRef w{nullptr, nullptr, tau_s.data(), tau_w.data()};
  const kk::FlashInferShape sh(B, M, static_cast<int>(Hq / Hkv), R, 16);
  kk::FlashInferWork<space, kvmem::bfloat16> work;
  work.reserve(exec(), B, M, static_cast<int>(Hq), static_cast<int>(Hkv), R, 16, static_cast<int>(D), sh.most_blocks(),
               sh.most_chunks());
  auto check = [&](auto merge_tag, bool biased) {
    using Merge = decltype(merge_tag);
    kk::flashinfer_readout_scales<Merge>(exec(), cfg, w, rows, plan.device, q, sh, work);
    exec().fence();
    const auto scales = host(work.scales);
    const auto bias = host(work.row_bias);
    long mismatches = 0;
    for (long b = 0; b < B; ++b) {
      const long begin = plan.host(b, kk::query_begin), n = plan.host(b, kk::query_end) - begin;
      for (long u = 0; u < n; ++u)
        for (long hq = 0; hq < Hq; ++hq) {
          const long i = (b * M + u) * Hq + hq;
          const auto* qu = &qh(b, hq, begin + u - plan.host(b, kk::input_offset), 0);
          mismatches += scales(0, i) != Merge::logit_scale(ts(hq), qu, static_cast<int>(D));
          mismatches += scales(1, i) != Merge::logit_scale(tw(hq), qu, static_cast<int>(D));
        }
      for (long h = 0; h < Hkv; ++h)
        for (long r = 0; r < plan.host(b, kk::read_rows); ++r) {
          const float want = biased ? std::log(counts_h(b, h, r)) : 0.0f;
          mismatches += std::abs(bias((b * Hkv + h) * R + r) - want) > 1e-6f * (1.0f + std::abs(want));
        }
    }
    CHECK(mismatches == 0);
  };
  check(kvmem::merge::WinnerTakeAll{}, false);  // KVM: tau / sqrt(D), no bias
  check(kvmem::merge::KMeansCount{}, true);     // OVQ: a per-query scale, log count
}

TEST_CASE("the log-sum-exp merge of two segments is the float64 merge, and copies a lone segment", "[flashinfer][schedule]") {
  const long B = 3, M = 4, Hq = 2, D = 16;
  // Sequence 0: both segments; 1: window only (no state rows); 2: state only (an empty window, as exact
  // attention's one segment).
  const auto plan = make_plan({{20, 24, 10, 7, 20}, {0, 3, 0, 0, 0}, {40, 42, 42, 5, 38}});
  kvmem::state::WindowRing<space, kvmem::bfloat16> ring;
  ring.allocate(static_cast<int>(B), 1, 32, static_cast<int>(D), static_cast<int>(D));
  const kk::PlanCounts<decltype(plan.device), decltype(ring)> counts{plan.device, ring, 1};
  const kk::FlashInferShape sh(B, M, static_cast<int>(Hq), 7, 32);
  kk::FlashInferWork<space, kvmem::bfloat16> work;
  work.reserve(exec(), B, M, static_cast<int>(Hq), 1, 8, 32, static_cast<int>(D), sh.most_blocks(), sh.most_chunks());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  auto part = Kokkos::create_mirror_view(work.partials);
  auto lse = Kokkos::create_mirror_view(work.lse);
  for (std::size_t i = 0; i < part.size(); ++i) part.data()[i] = kvmem::from_float<kvmem::bfloat16>(normal(rng));
  for (std::size_t i = 0; i < lse.size(); ++i) lse.data()[i] = 4.0f * normal(rng);
  Kokkos::deep_copy(work.partials, part);
  Kokkos::deep_copy(work.lse, lse);
  Kokkos::View<float****, Kokkos::LayoutRight, space> y("y", B, Hq, 6, D);
  Kokkos::View<float***, Kokkos::LayoutRight, space> out_lse("lse", B, Hq, 6);
  kk::flashinfer_merge_segments(exec(), counts, static_cast<int>(Hq), static_cast<int>(D), sh, y, out_lse, work);
  exec().fence();
  const auto yh = host(y);
  const auto lh = host(out_lse);
  kvmem_test::WorstError worst, worst_lse;
  long copies_differ = 0;
  for (long b = 0; b < B; ++b) {
    const long begin = plan.host(b, kk::query_begin), n = plan.host(b, kk::query_end) - begin;
    const bool has0 = plan.host(b, kk::read_rows) > 0, has1 = plan.host(b, kk::query_end) > plan.host(b, kk::window_begin_pos);
    for (long u = 0; u < n; ++u)
      for (long hq = 0; hq < Hq; ++hq) {
        const long i = (b * M + u) * Hq + hq, t = begin + u - plan.host(b, kk::input_offset);
        const double l0 = has0 ? lse(0, i) : -INFINITY, l1 = has1 ? lse(1, i) : -INFINITY;
        const double m = std::max(l0, l1), a0 = has0 ? std::exp2(l0 - m) : 0.0, a1 = has1 ? std::exp2(l1 - m) : 0.0;
        for (long c = 0; c < D; ++c) {
          const double y0 = kvmem::to_float(part(0, i * D + c)), y1 = kvmem::to_float(part(1, i * D + c));
          const double want = (a0 * y0 + a1 * y1) / (a0 + a1);
          worst.add_error(std::abs(yh(b, hq, t, c) - want) / (1.0 + std::abs(want)));
          if (!(has0 && has1)) copies_differ += yh(b, hq, t, c) != static_cast<float>(has0 ? y0 : y1);
        }
        worst_lse.add(lh(b, hq, t), (m + std::log2(a0 + a1)) * std::log(2.0));
      }
  }
  CHECK(worst <= 1e-6);
  CHECK(worst_lse <= 1e-5);
  CHECK(copies_differ == 0);
}

TEST_CASE("the tensor-core buffers only grow: a prefill after reserve() leaves them fit for decode", "[flashinfer][schedule]") {
  kk::FlashInferWork<space, kvmem::bfloat16> work;
  const long B = 2, R = 2048, S = 1344;
  const int Hq = 8, Hkv = 2, D = 16;
  const kk::FlashInferShape decode(B, 1, Hq / Hkv, R, S), prefill(B, 300, Hq / Hkv, R, S);
  REQUIRE(decode.most_chunks() == 2);
  REQUIRE(prefill.most_chunks() == 1);
  auto reserve = [&](const kk::FlashInferShape& sh) {
    work.reserve(exec(), B, sh.M, Hq, Hkv, R, S, D, sh.most_blocks(), sh.most_chunks());
  };
  auto holds = [&](const kk::FlashInferShape& sh) {
    return work.holds(B, sh.M, Hq, Hkv, R, S, D, sh.most_blocks(), sh.most_chunks());
  };
  CHECK_FALSE(holds(decode));
  reserve(decode);
  CHECK(holds(decode));
  const auto* chunk_out = work.chunk_out.data();
  const auto* window_pages = work.window_pages.data();
  const auto* partials = work.partials.data();
  reserve(decode);  // nothing grows: the same addresses (what a captured decode step relies on)
  CHECK(work.chunk_out.data() == chunk_out);
  CHECK(work.partials.data() == partials);
  CHECK_FALSE(holds(prefill));
  reserve(prefill);  // the query buffers grow; the partition's and the page tables stay
  CHECK(holds(prefill));
  CHECK(holds(decode));
  CHECK(work.chunk_out.data() == chunk_out);
  CHECK(work.window_pages.data() == window_pages);
  CHECK(work.partials.data() != partials);
  CHECK(work.holds(B, 1, Hq, Hkv, R, S, D, prefill.most_blocks(), 1));  // unpartitioned steps need no chunk buffers
}
