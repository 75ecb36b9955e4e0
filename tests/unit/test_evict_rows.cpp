// Row eviction after a fold (kernels::evict_rows_team, the evict pass of kvmem::update) against the serial
// scan written out on the host: for team sizes 1, 2 and the backend's largest, every array of the state
// (keys, read caches, decision keys, values, radius, counts, statistics) must hold the scan's bits after
// the kernel, with ties among statistics (the older row goes), evictions that run past the rows that
// existed before the fold into its fresh rows, every row but the sinks evicted, none evicted, and a NaN
// statistic at the first row in play (evicted) and further on (never evicted).
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/kernels/update/row_eviction.hpp>

#include "float_bits.hpp"

namespace {
namespace kk = kvmem::kernels;
using namespace kvmem_test;  // uniform, same_bits
using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;

/// The fold of one sequence: rows that existed before it, rows it appended, rows to evict.
struct Fold {
  long before, append, evicted;
};

/// Every element of a view as doubles, copied to the host.
template <class View>
std::vector<double> elements(const View& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<double> out(h.span());
  for (std::size_t i = 0; i < h.span(); ++i) out[i] = static_cast<double>(kvmem::to_float(h.data()[i]));
  return out;
}
std::vector<double> elements(const Kokkos::View<double***, Kokkos::LayoutRight, mem>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return {h.data(), h.data() + h.span()};
}

/// Index of the first element whose bits differ, or -1.
long first_difference(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) return static_cast<long>(i);
  return -1;
}

/// Random state rows and statistics (drawn from four values, so that ties are common) for the folds of
/// `folds`, 2 kv-heads, head_dim 20 (a column group of 16 channels and one of 4), value_dim 7, 2 sinks.
template <class T>
struct Rows {
  kvmem::MemoryConfig cfg;
  kvmem::state::StateRows<mem, T> rows, initial;
  kk::StepPlan<mem> plan;
  std::vector<Fold> folds;
  static constexpr long capacity = 48;

  explicit Rows(std::vector<Fold> f) : folds(std::move(f)) {
    cfg.head_dim = 20, cfg.value_dim = 7, cfg.query_heads = 2, cfg.kv_heads = 2, cfg.sinks = 2;
    const int B = static_cast<int>(folds.size());
    for (auto* r : {&rows, &initial}) {
      r->allocate(B, cfg.kv_heads, capacity, cfg.head_dim, cfg.value_dim);
      r->allocate_stats();
    }
    unsigned seed = 21;
    auto fill = [&](const auto& view, float scale) {
      auto h = Kokkos::create_mirror_view(view);
      const auto x = uniform(h.span(), seed++);
      for (std::size_t i = 0; i < h.span(); ++i)
        h.data()[i] = kvmem::from_float<typename std::remove_reference_t<decltype(h)>::value_type>(scale * x[i]);
      Kokkos::deep_copy(view, h);
    };
    fill(initial.keys, 2.0f), fill(initial.values, 2.0f), fill(initial.read_keys, 1.0f);
    fill(initial.read_values, 1.0f), fill(initial.radius, 3.0f), fill(initial.counts, 5.0f);
    if (initial.decision_keys.data() != nullptr) fill(initial.decision_keys, 1.0f);
    auto s = Kokkos::create_mirror_view(initial.stats);
    const auto x = uniform(s.span(), seed++);
    for (std::size_t i = 0; i < s.span(); ++i) s.data()[i] = 0.5 * std::floor(2.0 + 2.0 * x[i]);  // 0, 0.5, 1, 1.5
    Kokkos::deep_copy(initial.stats, s);
    plan.allocate(B);
    plan.clear();
    for (int b = 0; b < B; ++b) {
      plan.host(b, kk::block_count) = 16;
      plan.host(b, kk::rows_before) = folds[b].before;
      plan.host(b, kk::append_count) = folds[b].append;
      plan.host(b, kk::rows_evicted) = folds[b].evicted;
    }
    plan.upload(exec());
  }
  /// Sets statistic (b, h, i) of the initial rows.
  void set_stat(long b, long h, long i, double value) {
    auto s = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), initial.stats);
    s(b, h, i) = value;
    Kokkos::deep_copy(initial.stats, s);
  }
  /// Every array of `r`, in a fixed order.
  static std::vector<std::vector<double>> arrays(const kvmem::state::StateRows<mem, T>& r) {
    std::vector<std::vector<double>> out{elements(r.keys),   elements(r.values), elements(r.read_keys),
                                         elements(r.read_values), elements(r.radius), elements(r.counts),
                                         elements(r.stats)};
    if (r.decision_keys.data() != nullptr) out.push_back(elements(r.decision_keys));
    return out;
  }
  /// The arrays after the kernel with `team_size` threads per (sequence, kv-head), from the initial rows.
  std::vector<std::vector<double>> run(int team_size) {
    Kokkos::deep_copy(rows.keys, initial.keys);
    Kokkos::deep_copy(rows.values, initial.values);
    Kokkos::deep_copy(rows.radius, initial.radius);
    Kokkos::deep_copy(rows.counts, initial.counts);
    Kokkos::deep_copy(rows.read_keys, initial.read_keys);
    Kokkos::deep_copy(rows.read_values, initial.read_values);
    if (rows.decision_keys.data() != nullptr) Kokkos::deep_copy(rows.decision_keys, initial.decision_keys);
    Kokkos::deep_copy(rows.stats, initial.stats);
    Kokkos::parallel_for("test_evict_rows", policy(team_size), kernel());
    exec().fence();
    return arrays(rows);
  }
  using policy_t = Kokkos::TeamPolicy<exec>;
  /// The kernel: a team per (sequence, kv-head). (A functor: nvcc's extended lambdas cannot be returned
  /// from a function with a deduced return type.)
  struct Kernel {
    kvmem::state::StateRows<mem, T> rows;
    decltype(kk::StepPlan<mem>::device) plan;
    kvmem::MemoryConfig cfg;
    long heads;
    KOKKOS_FUNCTION void operator()(const typename policy_t::member_type& team) const {
      // With the team's selection scratch: on Cuda the search for the lowest row is CUB's (team_select.hpp).
      kk::evict_rows_team(team, cfg, rows, plan, team.league_rank() / heads, team.league_rank() % heads,
                          kk::team_select_scratch(team));
    }
  };
  [[nodiscard]] Kernel kernel() const { return Kernel{rows, plan.device, cfg, cfg.kv_heads}; }
  [[nodiscard]] policy_t policy(int team_size) const {
    policy_t p(exec(), static_cast<long>(folds.size()) * cfg.kv_heads, team_size);
    if (kk::team_select_bytes<exec> > 0) p.set_scratch_size(0, Kokkos::PerTeam(kk::team_select_bytes<exec>));
    return p;
  }
  /// Team sizes 1, 2 and the backend's largest for this kernel (those the backend allows).
  [[nodiscard]] std::vector<int> team_sizes() const {
    const int most = policy(1).team_size_max(kernel(), Kokkos::ParallelForTag());
    std::vector<int> sizes{1};
    if (most >= 2) sizes.push_back(2);
    if (most > 2) sizes.push_back(most);
    return sizes;
  }

  /// The serial scan on host copies of the initial rows: per (sequence, kv-head), fresh rows' statistics
  /// to 0; then, rows before the fold first, fresh rows after, repeatedly the first row not yet evicted
  /// unless a later one has a strictly lower statistic; then every kept row moved down in order.
  std::vector<std::vector<double>> reference() const {
    auto a = arrays(initial);  // keys, values, read keys, read values, radius, counts, stats[, decision keys]
    const long H = cfg.kv_heads, C = capacity, D = cfg.head_dim, Dv = cfg.value_dim, sinks = cfg.sinks;
    const std::vector<long> widths{D, Dv, D, Dv, 1, 1, 1, D};
    const double gone = std::numeric_limits<double>::infinity();
    for (std::size_t b = 0; b < folds.size(); ++b)
      for (long h = 0; h < H; ++h) {
        auto stat = [&](long i) -> double& { return a[6][(static_cast<long>(b) * H + h) * C + i]; };
        const long before = folds[b].before, m = before + folds[b].append;
        for (long i = before; i < m; ++i) stat(i) = 0.0;
        long evict = folds[b].evicted;
        for (int pass = 0; pass < 2 && evict > 0; ++pass) {
          const long lo = pass == 0 ? sinks : std::max(before, sinks), hi = pass == 0 ? before : m;
          for (; evict > 0; --evict) {
            long worst = -1;
            for (long i = lo; i < hi; ++i)
              if (stat(i) != gone && (worst < 0 || stat(i) < stat(worst))) worst = i;
            if (worst < 0) break;
            stat(worst) = gone;
          }
        }
        std::vector<bool> kept(m);
        for (long i = 0; i < m; ++i) kept[i] = i < sinks || stat(i) != gone;
        for (std::size_t x = 0; x < a.size(); ++x) {
          const long w = widths[x];
          double* base = &a[x][(static_cast<long>(b) * H + h) * C * w];
          long out = 0;
          for (long i = 0; i < m; ++i)
            if (kept[i]) std::copy(base + i * w, base + (i + 1) * w, base + (out++) * w);
        }
      }
    return a;
  }
};

/// Runs every team size against the reference and requires the same bits in every array.
template <class T>
void require_reference(Rows<T>& r) {
  const auto want = r.reference();
  for (int size : r.team_sizes()) {
    CAPTURE(size);
    const auto got = r.run(size);
    REQUIRE(got.size() == want.size());
    for (std::size_t x = 0; x < want.size(); ++x) {
      CAPTURE(x);
      CHECK(first_difference(got[x], want[x]) == -1);
    }
  }
}
}  // namespace

TEMPLATE_TEST_CASE("row eviction: the team pass keeps the serial scan's rows bit for bit", "[row-eviction]", float,
                   kvmem::bfloat16) {
  // Evictions among the old rows; past them into the fresh rows; every row but the sinks; none (only the
  // fresh rows' statistics reset); a fold that appended nothing; fewer old rows than sinks (fresh rows
  // among the sinks).
  Rows<TestType> r({{30, 3, 4}, {12, 5, 12}, {40, 4, 42}, {9, 6, 0}, {20, 0, 3}, {1, 8, 3}});
  // The evictions changed something the test can see: the kept rows moved.
  const auto want = r.reference();
  CHECK(first_difference(want[0], Rows<TestType>::arrays(r.initial)[0]) != -1);
  require_reference(r);
}

TEST_CASE("row eviction: a NaN statistic at the first row in play is evicted, elsewhere never", "[row-eviction]") {
  Rows<float> r({{20, 2, 3}, {20, 2, 3}});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  r.set_stat(0, 0, 2, nan);   // the first row after the 2 sinks: the scan evicts it first
  r.set_stat(0, 1, 7, nan);   // never
  r.set_stat(1, 0, 2, -0.0);  // ties of -0 and +0: the older row
  r.set_stat(1, 0, 5, 0.0);
  r.set_stat(1, 1, 3, nan), r.set_stat(1, 1, 2, 4.0);
  // The reference itself: (0, 0) kept no NaN row among its 19, (0, 1) kept its one.
  const auto stats = r.reference()[6];
  auto nans = [&](long b, long h) {
    long n = 0;
    for (long i = 0; i < 19; ++i) n += std::isnan(stats[(b * 2 + h) * Rows<float>::capacity + i]) ? 1 : 0;
    return n;
  };
  CHECK(nans(0, 0) == 0);
  CHECK(nans(0, 1) == 1);
  require_reference(r);
}
