// A team's choices (kernels/common/team_select.hpp): order_key orders floats as `<` does with NaN last; team_lowest
// picks the entry the serial scan picks (lowest score, ties to the lower index, NaN at the first entry
// picked, NaN elsewhere never, skipped entries never); team_rank gives std::stable_sort's ranks. Each runs
// on the default execution space at several team sizes, with and without the team's selection scratch:
// on Kokkos::Cuda with it, CUB's warp reduction and block radix sort (backend/cuda/team_select.hpp),
// without it the portable Kokkos path, so where a GPU runs this test the CUB fast paths must choose what
// the portable paths choose, and both what the host reference chooses. The tests also call the CUB
// functions directly and require them to apply exactly where they should (whole warps, or a team of
// rank_team threads, given the scratch), so a fast path that silently fell back would fail here.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include <kvmem/backend/cuda/team_select.hpp>
#include <kvmem/kernels/common/team_select.hpp>

namespace {

namespace kk = kvmem::kernels;
using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;
using policy_t = Kokkos::TeamPolicy<exec>;
using member_t = policy_t::member_type;

constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double nan_value = std::numeric_limits<double>::quiet_NaN();

/// Team sizes to run: 1, 2, the warp multiples CUB takes (where the backend allows them) and the largest.
template <class Kernel>
std::vector<int> team_sizes(long league, const Kernel& kernel) {
  const int most = policy_t(exec(), league, 1).team_size_max(kernel, Kokkos::ParallelForTag());
  std::vector<int> sizes;
  for (int s : {1, 2, 32, 64, 128, 256, most})
    if (s <= most && std::find(sizes.begin(), sizes.end(), s) == sizes.end()) sizes.push_back(s);
  return sizes;
}

/// A policy of `league` teams of `size` threads, with the selection scratch when `with_scratch`.
policy_t select_policy(long league, int size, bool with_scratch) {
  policy_t policy(exec(), league, size);
  if (with_scratch && kk::team_select_bytes<exec> > 0)
    policy.set_scratch_size(0, Kokkos::PerTeam(kk::team_select_bytes<exec>));
  return policy;
}

// ---- order_key ----

template <class F>
std::vector<F> special_values() {
  using lim = std::numeric_limits<F>;
  return {-lim::infinity(), -lim::max(), F(-1.5), F(-1), -lim::min(), -lim::denorm_min(), F(-0.0), F(0.0),
          lim::denorm_min(), lim::min(),  F(1),      F(1.5), lim::max(), lim::infinity(), lim::quiet_NaN(),
          -lim::quiet_NaN(), lim::signaling_NaN()};
}

template <class F>
void check_order_keys() {
  const auto values = special_values<F>();
  for (F a : values)
    for (F b : values) {
      const bool nan_a = std::isnan(a), nan_b = std::isnan(b);
      const bool before = nan_a || nan_b ? (nan_b && !nan_a) : a < b;
      const bool same = nan_a || nan_b ? (nan_a && nan_b) : a == b;
      INFO("a = " << a << ", b = " << b);
      CHECK((kk::order_key(a) < kk::order_key(b)) == before);
      CHECK((kk::order_key(a) == kk::order_key(b)) == same);
    }
}

#ifdef KOKKOS_ENABLE_CUDA
static_assert(!std::is_same_v<exec, Kokkos::Cuda> || kk::team_select_bytes<exec> > 0,
              "on Cuda the selections take CUB's paths, which need team scratch");
#endif

TEST_CASE("team select: order_key orders numbers as < does, -0 as +0, every NaN after +inf", "[team-select]") {
  check_order_keys<float>();
  check_order_keys<double>();
}

// ---- team_lowest ----

/// The serial scan over [begin, end): the first strictly lower score among entries not skipped; a NaN at
/// begin stays (begin is never skipped).
long serial_lowest(const std::vector<double>& s, const std::vector<int>& skip, long begin, long end) {
  long best = begin;
  for (long i = begin + 1; i < end; ++i)
    if (!skip[i] && s[i] < s[best]) best = i;
  return best;
}

struct LowestCase {
  std::vector<double> scores;
  std::vector<int> skip;
  long begin = 0, end = 0;
};

/// Ranges with many exact ties, NaN, +-inf, -0.0 and +0.0, skipped entries, short and long ranges, and the
/// edge cases: every score +inf (Kokkos 4's Min<double> identity is DBL_MAX), NaN at the first entry, NaN
/// everywhere but the first, a single entry.
std::vector<LowestCase> lowest_cases(long width) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> kind(0, 30), level(0, 5);
  std::vector<LowestCase> cases;
  for (long n : {1L, 2L, 3L, 31L, 32L, 33L, 100L, 257L, width}) {
    for (int rep = 0; rep < 6; ++rep) {
      LowestCase c;
      c.scores.resize(width);
      c.skip.assign(width, 0);
      for (auto& s : c.scores) {
        const int k = kind(rng);
        s = k == 0 ? nan_value : k == 1 ? inf : k == 2 ? -inf : k == 3 ? -0.0 : k == 4 ? 0.0 : 0.25 * level(rng);
      }
      c.begin = std::min<long>(rep * 3, width - n);
      c.end = c.begin + n;
      for (long i = c.begin + 1; i < c.end; ++i) c.skip[i] = kind(rng) < 3 ? 1 : 0;
      if (rep == 0 && n > 1) c.scores[c.begin] = nan_value;  // NaN first: picked
      if (rep == 1) std::fill(c.scores.begin(), c.scores.end(), inf);
      if (rep == 2)
        for (long i = c.begin + 1; i < c.end; ++i) c.scores[i] = nan_value;
      cases.push_back(c);
    }
  }
  return cases;
}

/// The kernel: team x takes case x. (A functor: extended lambdas cannot be returned from a function with a
/// deduced return type.)
struct LowestKernel {
  Kokkos::View<double**, Kokkos::LayoutRight, mem> scores;
  Kokkos::View<int**, Kokkos::LayoutRight, mem> skip;
  Kokkos::View<long**, Kokkos::LayoutRight, mem> range;  // [case, 2]: begin, end
  Kokkos::View<long*, mem> out;
  Kokkos::View<long*, mem> fast;  // CUB's own answer where its path applies, -1 where it does not
  bool with_scratch;
  KOKKOS_FUNCTION void operator()(const member_t& team) const {
    const long x = team.league_rank();
    const kk::TeamSelectScratch select = with_scratch ? kk::team_select_scratch(team) : kk::TeamSelectScratch{};
    long cub = -1;
    const bool applies = kvmem::backend::cuda::team_lowest(
        team, range(x, 0), range(x, 1),
        [&](long i) { return skip(x, i) != 0 ? ~std::uint64_t{0} : kk::order_key(scores(x, i)); }, select.shared, cub);
    Kokkos::single(Kokkos::PerTeam(team), [&] { fast(x) = applies ? cub : -1; });
    const long lowest = kk::team_lowest(
        team, range(x, 0), range(x, 1), [&](long i) { return scores(x, i); }, [&](long i) { return skip(x, i) != 0; },
        select);
    // Twice in a row on the same scratch: the second call must not see the first one's partials.
    const long again = kk::team_lowest(
        team, range(x, 0), range(x, 1), [&](long i) { return scores(x, i); }, [&](long i) { return skip(x, i) != 0; },
        select);
    Kokkos::single(Kokkos::PerTeam(team), [&] { out(x) = lowest == again ? lowest : -2; });
  }
};

TEST_CASE("team select: team_lowest picks the serial scan's entry at every team size, CUB or portable",
          "[team-select]") {
  const long width = 700;
  const auto cases = lowest_cases(width);
  const long n = static_cast<long>(cases.size());
  LowestKernel k{Kokkos::View<double**, Kokkos::LayoutRight, mem>("scores", n, width),
                 Kokkos::View<int**, Kokkos::LayoutRight, mem>("skip", n, width),
                 Kokkos::View<long**, Kokkos::LayoutRight, mem>("range", n, 2), Kokkos::View<long*, mem>("out", n),
                 Kokkos::View<long*, mem>("fast", n), true};
  auto sh = Kokkos::create_mirror_view(k.scores);
  auto kh = Kokkos::create_mirror_view(k.skip);
  auto rh = Kokkos::create_mirror_view(k.range);
  std::vector<long> expected(n);
  for (long x = 0; x < n; ++x) {
    for (long i = 0; i < width; ++i) sh(x, i) = cases[x].scores[i], kh(x, i) = cases[x].skip[i];
    rh(x, 0) = cases[x].begin, rh(x, 1) = cases[x].end;
    expected[x] = serial_lowest(cases[x].scores, cases[x].skip, cases[x].begin, cases[x].end);
  }
  Kokkos::deep_copy(k.scores, sh);
  Kokkos::deep_copy(k.skip, kh);
  Kokkos::deep_copy(k.range, rh);
  for (bool with_scratch : {true, false}) {
    k.with_scratch = with_scratch;
    for (int size : team_sizes(n, k)) {
      Kokkos::deep_copy(k.out, -1L);
      Kokkos::parallel_for("test_team_lowest", select_policy(n, size, with_scratch), k);
      const auto out = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.out);
      const auto fast = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.fast);
      // CUB's path applies on Cuda to a team of whole warps (vector length 1) given the scratch, nowhere else.
      const bool cub_applies = kk::team_select_bytes<exec> > 0 && with_scratch && size % 32 == 0;
      for (long x = 0; x < n; ++x) {
        INFO("team size " << size << (with_scratch ? " with" : " without") << " the selection scratch, case " << x
                          << ": [" << cases[x].begin << ", " << cases[x].end << ")");
        REQUIRE(out(x) == expected[x]);
        REQUIRE(fast(x) == (cub_applies ? expected[x] : -1));
      }
    }
  }
}

// ---- team_rank ----

/// The update kernel's sequence on one team's scratch: rank (select), lowest (row eviction's search), rank
/// (group) again; the second ranks must equal the first, and the lowest item is the one ranked 0. `fast`:
/// whether CUB's sort applied, by calling it directly once more.
struct RankKernel {
  Kokkos::View<std::uint32_t**, Kokkos::LayoutRight, mem> keys;
  Kokkos::View<long*, mem> counts;
  Kokkos::View<long**, Kokkos::LayoutRight, mem> ranks, again, cub;
  Kokkos::View<long*, mem> lowest, fast;
  bool with_scratch;
  KOKKOS_FUNCTION void operator()(const member_t& team) const {
    const long x = team.league_rank(), n = counts(x);
    const kk::TeamSelectScratch select = with_scratch ? kk::team_select_scratch(team) : kk::TeamSelectScratch{};
    auto key = [&](long j) { return keys(x, j); };
    kk::team_rank(team, n, key, [&](long j, long r) { ranks(x, j) = r; }, select);
    if (n > 0) {
      const long l = kk::team_lowest(
          team, 0, n, [&](long j) { return static_cast<double>(keys(x, j)); }, [](long) { return false; }, select);
      Kokkos::single(Kokkos::PerTeam(team), [&] { lowest(x) = l; });
    }
    kk::team_rank(team, n, key, [&](long j, long r) { again(x, j) = r; }, select);
    const bool applies =
        kvmem::backend::cuda::team_rank(team, n, key, [&](long j, long r) { cub(x, j) = r; }, select.shared);
    Kokkos::single(Kokkos::PerTeam(team), [&] { fast(x) = applies ? 1 : 0; });
  }
};

TEST_CASE("team select: team_rank gives std::stable_sort's ranks at every team size, CUB or portable",
          "[team-select]") {
  const long width = 1100;  // past CUB's 1,024 items: the portable path takes those blocks
  std::mt19937 rng(5);
  std::vector<long> sizes{0, 1, 2, 31, 128, 256, 257, 1000, 1024, 1025, width};
  const long n = static_cast<long>(sizes.size()) * 2;
  using ranks_view = Kokkos::View<long**, Kokkos::LayoutRight, mem>;
  RankKernel k{Kokkos::View<std::uint32_t**, Kokkos::LayoutRight, mem>("keys", n, width),
               Kokkos::View<long*, mem>("counts", n),
               ranks_view("ranks", n, width),
               ranks_view("again", n, width),
               ranks_view("cub", n, width),
               Kokkos::View<long*, mem>("lowest", n),
               Kokkos::View<long*, mem>("fast", n),
               true};
  auto kh = Kokkos::create_mirror_view(k.keys);
  auto ch = Kokkos::create_mirror_view(k.counts);
  std::vector<std::vector<long>> expected(n);
  for (long x = 0; x < n; ++x) {
    const long count = sizes[x / 2];
    ch(x) = count;
    // Even cases: a few distinct keys (many ties) and the largest key, which pads CUB's sort; odd cases:
    // order_key of scores with NaN, -0.0, +0.0 and +-inf (the update's token scores).
    std::uniform_int_distribution<int> level(0, 6), kind(0, 20);
    for (long j = 0; j < width; ++j) {
      if (x % 2 == 0) {
        const int l = level(rng);
        kh(x, j) = l == 6 ? ~std::uint32_t{0} : static_cast<std::uint32_t>(l * 1000);
      } else {
        const int c = kind(rng);
        const float s = c == 0 ? std::numeric_limits<float>::quiet_NaN() : c == 1 ? -0.0f : c == 2 ? 0.0f
                      : c == 3 ? std::numeric_limits<float>::infinity() : 0.5f * static_cast<float>(level(rng)) - 1.0f;
        kh(x, j) = kk::order_key(s);
      }
    }
    std::vector<long> order(count);
    std::iota(order.begin(), order.end(), 0L);
    std::stable_sort(order.begin(), order.end(), [&](long a, long b) { return kh(x, a) < kh(x, b); });
    expected[x].resize(count);
    for (long r = 0; r < count; ++r) expected[x][order[r]] = r;
  }
  Kokkos::deep_copy(k.keys, kh);
  Kokkos::deep_copy(k.counts, ch);
  // Where CUB's sort exists (Cuda), the team sizes include the one it takes.
  const auto sizes_run = team_sizes(n, k);
  if (kk::team_select_bytes<exec> > 0)
    REQUIRE(std::find(sizes_run.begin(), sizes_run.end(), kvmem::backend::cuda::rank_team) != sizes_run.end());
  for (bool with_scratch : {true, false}) {
    k.with_scratch = with_scratch;
    for (int size : sizes_run) {
      Kokkos::deep_copy(k.ranks, -1L);
      Kokkos::deep_copy(k.again, -1L);
      Kokkos::deep_copy(k.cub, -1L);
      Kokkos::parallel_for("test_team_rank", select_policy(n, size, with_scratch), k);
      const auto ranks = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.ranks);
      const auto again = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.again);
      const auto cub = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.cub);
      const auto lowest = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.lowest);
      const auto fast = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, k.fast);
      for (long x = 0; x < n; ++x) {
        // CUB's sort applies on Cuda to a team of kvmem::backend::cuda::rank_team threads given the scratch,
        // for at most rank_team * rank_items items; nowhere else.
        const bool cub_applies = kk::team_select_bytes<exec> > 0 && with_scratch &&
                                 size == kvmem::backend::cuda::rank_team &&
                                 ch(x) <= long(kvmem::backend::cuda::rank_team) * kvmem::backend::cuda::rank_items;
        INFO("team size " << size << (with_scratch ? " with" : " without") << " the selection scratch, " << ch(x)
                          << " items");
        REQUIRE(fast(x) == (cub_applies ? 1 : 0));
        for (long j = 0; j < ch(x); ++j) {
          INFO("item " << j);
          REQUIRE(ranks(x, j) == expected[x][j]);
          REQUIRE(again(x, j) == expected[x][j]);
          if (cub_applies) REQUIRE(cub(x, j) == expected[x][j]);
          if (expected[x][j] == 0) REQUIRE(lowest(x) == j);
        }
      }
    }
  }
}

}  // namespace
