// The attention mass that H2O row eviction accumulates per state row (kernels::accumulate_row_attention)
// against the per-row loop written out with float32 logits and probabilities (the readout's softmax_exp)
// and float64 statistics: both forms of the kernel (register tiles for CPUs, one thread per row for GPUs)
// run on the default backend and must give that loop's bits (on a GPU, whose compiler may contract other
// float operations, to 1e-5 relative; the two forms still bit for bit), for every storage type of the read
// keys, both merge policies' logits (KVM: tau / sqrt(D); OVQ:
// a factor from the query's norm and a log(count) bias per row), GQA groups, a prefill-like step of many
// queries and a decode step of one, and row counts that leave register tiles part full.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/kernels/update/row_eviction.hpp>
#include <kvmem/policy/merge/k_means_count.hpp>
#include <kvmem/policy/merge/winner_take_all.hpp>
#include <kvmem/policy/score/row_eviction.hpp>

#include "float_bits.hpp"

namespace {
namespace kk = kvmem::kernels;
using namespace kvmem_test;  // uniform, same_bits
using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;

/// The elements of a view of doubles, copied to the host.
template <class View>
std::vector<double> host_copy(const View& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return {h.data(), h.data() + h.span()};
}

/// A memory's storage type and merge policy.
template <class T, class M>
struct Case {
  using storage = T;
  using merge = M;
};

/// The inputs of one step: state rows with random read keys, counts and statistics, queries, log-sum-exps
/// and a plan whose sequences read different numbers of rows.
template <class T>
struct Step {
  kvmem::MemoryConfig cfg;
  kvmem::state::StateRows<mem, T> rows;
  kk::StepPlan<mem> plan;
  Kokkos::View<float****, Kokkos::LayoutRight, mem> q;
  Kokkos::View<float***, Kokkos::LayoutRight, mem> lse;
  Kokkos::View<float*, mem> taus;
  std::vector<long> read;  // rows read per sequence
  long queries = 0, first = 0, offset = 0;

  Step(long n_queries, std::vector<long> read_rows) : read(std::move(read_rows)), queries(n_queries) {
    cfg.head_dim = 40, cfg.value_dim = 8, cfg.query_heads = 6, cfg.kv_heads = 2;
    const int B = static_cast<int>(read.size()), D = cfg.head_dim, Hq = cfg.query_heads, H = cfg.kv_heads;
    const long capacity = 53;
    rows.allocate(B, H, capacity, D, cfg.value_dim);
    rows.allocate_stats();
    {
      auto keys = Kokkos::create_mirror_view(rows.read_keys);
      const auto x = uniform(keys.span(), 11);
      for (std::size_t i = 0; i < keys.span(); ++i) keys.data()[i] = kvmem::from_float<T>(2.0f * x[i]);
      Kokkos::deep_copy(rows.read_keys, keys);
      auto counts = Kokkos::create_mirror_view(rows.counts);
      auto stats = Kokkos::create_mirror_view(rows.stats);
      const auto c = uniform(counts.span(), 12), s = uniform(stats.span(), 13);
      for (std::size_t i = 0; i < counts.span(); ++i) counts.data()[i] = 1.0f + 4.0f * (c[i] + 1.0f);
      for (std::size_t i = 0; i < stats.span(); ++i) stats.data()[i] = 10.0 + s[i];
      Kokkos::deep_copy(rows.counts, counts);
      Kokkos::deep_copy(rows.stats, stats);
    }
    // Queries of positions [offset + first, offset + first + queries) of an input of first + queries tokens.
    first = 3, offset = 100;
    q = decltype(q)("q", B, Hq, first + queries, D);
    lse = decltype(lse)("lse", B, Hq, queries);
    auto hq = Kokkos::create_mirror_view(q);
    const auto xq = uniform(hq.span(), 14);
    for (std::size_t i = 0; i < hq.span(); ++i) hq.data()[i] = xq[i];
    Kokkos::deep_copy(q, hq);
    auto hl = Kokkos::create_mirror_view(lse);
    const auto xl = uniform(hl.span(), 15);
    for (std::size_t i = 0; i < hl.span(); ++i) hl.data()[i] = 4.0f + 2.0f * xl[i];
    Kokkos::deep_copy(lse, hl);
    taus = decltype(taus)("taus", Hq);
    auto ht = Kokkos::create_mirror_view(taus);
    for (int h = 0; h < Hq; ++h) ht(h) = 0.5f + 0.25f * static_cast<float>(h);
    Kokkos::deep_copy(taus, ht);
    plan.allocate(B);
    plan.clear();
    for (int b = 0; b < B; ++b) {
      plan.host(b, kk::input_offset) = offset;
      plan.host(b, kk::query_begin) = offset + first;
      plan.host(b, kk::query_end) = offset + first + queries;
      plan.host(b, kk::read_rows) = read[b];
    }
    plan.upload(exec());
  }

  /// The statistics after the kernel in the form Traits, on the host.
  template <class Merge, class Traits>
  std::vector<double> run() {
    Kokkos::View<double***, Kokkos::LayoutRight, mem> before("before", rows.stats.extent(0), rows.stats.extent(1),
                                                             rows.stats.extent(2));
    Kokkos::deep_copy(before, rows.stats);
    kvmem::LayerWeightsRef w{nullptr, nullptr, taus.data(), taus.data()};
    long most = 0;
    for (long r : read) most = std::max(most, r);
    kk::accumulate_row_attention<Merge, kvmem::score::RowAccumulatedAttention, exec, T, decltype(q), decltype(lse),
                                 Traits>(exec(), cfg, w, rows, plan, q, lse, kvmem::score::RowAccumulatedAttention{},
                                         most);
    const auto after = host_copy(rows.stats);
    Kokkos::deep_copy(rows.stats, before);  // the next form starts from the same statistics
    return after;
  }

  /// The per-row loop on the host: float32 logit (kernels::dot's chain, then mul_add with the merge's
  /// factor and bias), float32 probability (kernels::softmax_exp of logit - lse) and sum over the group's
  /// heads in head order, float64 statistic, queries in position order.
  template <class Merge>
  std::vector<double> reference() const {
    auto hk = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), rows.read_keys);
    auto hc = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), rows.counts);
    auto hs = Kokkos::create_mirror(Kokkos::HostSpace(), rows.stats);  // a copy, even of a host view
    Kokkos::deep_copy(hs, rows.stats);
    auto hq = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), q);
    auto hl = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
    auto ht = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), taus);
    const int G = cfg.group(), D = cfg.head_dim;
    for (std::size_t b = 0; b < read.size(); ++b)
      for (int h = 0; h < cfg.kv_heads; ++h)
        for (long i = 0; i < read[b]; ++i) {
          float dummy_key = 0.0f, dummy_value = 0.0f, radius = 0.0f;
          const kvmem::merge::Row row{&dummy_key, &dummy_value, &radius, &hc(b, h, i)};
          const float bias = Merge::row_bias(row);
          double stat = hs(b, h, i);
          for (long u = 0; u < queries; ++u) {
            float mass = 0.0f;
            for (int g = 0; g < G; ++g) {
              const int head = h * G + g;
              const float* qu = &hq(b, head, first + u, 0);
              float dot = 0.0f;
              for (int c = 0; c < D; ++c) dot = kk::mul_add(qu[c], kvmem::to_float(hk(b, h, i, c)), dot);
              const float logit = kk::mul_add(dot, Merge::logit_scale(ht(head), qu, D), bias);
              mass += kk::softmax_exp(logit - hl(b, head, u));
            }
            stat += mass;
          }
          hs(b, h, i) = stat;
        }
    return {hs.data(), hs.data() + hs.span()};
  }
};

/// Index of the first statistic whose bits differ, or -1; with `relative` > 0, the first whose change from
/// `initial` differs from the other's change by more than that relative error instead.
long first_difference(const std::vector<double>& a, const std::vector<double>& b, double relative = 0.0,
                      const std::vector<double>& initial = {}) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (relative == 0.0) {
      if (!same_bits(a[i], b[i])) return static_cast<long>(i);
    } else if (std::abs((a[i] - initial.at(i)) - (b[i] - initial.at(i))) > relative * std::abs(b[i] - initial.at(i))) {
      return static_cast<long>(i);
    }
  }
  return -1;
}

/// A GPU's logit may differ from the host's in its last bits (device log and sqrt in OVQ's factor and bias,
/// fused multiply-adds where the host's mul_add is two roundings): there the kernel forms are compared with
/// each other bit for bit and the mass they added with the host loop's to 1e-5 relative (float32
/// probabilities: a few ulps each; a float64 exponential would agree to 1e-12).
constexpr double kHostTolerance =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, mem>::accessible ? 0.0 : 1e-5;
}  // namespace

TEMPLATE_TEST_CASE("row attention mass: both kernel forms give the bits of the per-row loop", "[row-eviction][simd]",
                   (Case<float, kvmem::merge::WinnerTakeAll>), (Case<float, kvmem::merge::KMeansCount>),
                   (Case<kvmem::bfloat16, kvmem::merge::WinnerTakeAll>),
                   (Case<kvmem::float16, kvmem::merge::KMeansCount>)) {
  using T = typename TestType::storage;
  using Merge = typename TestType::merge;
  // Sequences reading 53, 17, 1 and 0 rows: full and part-full tiles of rows, a single row, none.
  for (long queries : {1L, 13L}) {
    CAPTURE(queries);
    Step<T> step(queries, {53, 17, 1, 0});
    const auto initial = host_copy(step.rows.stats);
    const auto want = step.template reference<Merge>();
    const auto tiles = step.template run<Merge, kk::RegisterTiles>();
    const auto spread = step.template run<Merge, kk::SpreadTiles>();
    CHECK(first_difference(tiles, spread) == -1);
    CHECK(first_difference(tiles, want, kHostTolerance, initial) == -1);
    CHECK(first_difference(spread, want, kHostTolerance, initial) == -1);
    // The kernel changed every row it read (the test sees the mass) and no other.
    long changed = 0;
    for (std::size_t i = 0; i < tiles.size(); ++i) changed += same_bits(tiles[i], initial[i]) ? 0 : 1;
    CHECK(changed == (53 + 17 + 1 + 0) * step.cfg.kv_heads);
  }
}
