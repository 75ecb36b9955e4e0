// The two ways a readout team covers a key tile (kernels/common/tile_traits.hpp): register tiles (CPUs) and one
// thread per logit, lane softmax and output channel (GPUs: TileTraits<Kokkos::Cuda>). Both must give the
// same bits, so that a backend's prefill and decode agree whichever form it runs and a GPU's results can
// be read against the CPU's. Both forms run on the default backend (kernels::RegisterTiles and
// kernels::SpreadTiles), the spread one with one thread per team and with a full team.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/kernels/readout/exact_attention.hpp>
#include <kvmem/kernels/readout/launch.hpp>

#include "float_bits.hpp"

namespace {
using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;
namespace kk = kvmem::kernels;
using kvmem_test::same_bits;
using kvmem_test::uniform;

template <class T>
using view4 = Kokkos::View<T****, Kokkos::LayoutRight, mem>;

/// A view [a, b, c, d] of T filled with uniform values in [-1, 1) times `scale` (rounded to T).
template <class T>
view4<T> random_view(const char* name, long a, long b, long c, long d, unsigned seed, float scale = 1.0f) {
  view4<T> v(std::string(name), a, b, c, d);
  auto h = Kokkos::create_mirror_view(v);
  const auto x = uniform(v.span(), seed);
  for (std::size_t i = 0; i < v.span(); ++i) h.data()[i] = kvmem::from_float<T>(scale * x[i]);
  Kokkos::deep_copy(v, h);
  return v;
}

/// y of exact_causal_attention with the tile form `Traits`, widened to float32 on the host.
template <class Traits, class T>
std::vector<float> exact_y(const view4<T>& q, const view4<T>& k, const view4<T>& v, long first_position) {
  view4<T> y("y", q.extent(0), q.extent(1), q.extent(2), v.extent(3));
  kk::exact_causal_attention<exec, view4<T>, view4<T>, view4<T>, Traits>(exec(), q, k, v, y, nullptr, first_position);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  std::vector<float> out(h.span());
  for (std::size_t i = 0; i < h.span(); ++i) out[i] = kvmem::to_float(h.data()[i]);
  return out;
}

/// Index of the first element whose bits differ, or -1.
long first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) return static_cast<long>(i);
  return -1;
}

/// One query block over `keys` keys (stored as S) with a logit bias per key and a key count per lane (some
/// lanes read none of a tile, some none at all), through attend_block in the form `Spread` with `team_size`
/// threads per team (0: Kokkos::AUTO), in a block carved with room for packed key tiles or without
/// (`packed`: QueryBlock::packs widens 16-bit key tiles into it). Returns every lane's accumulator, max
/// logit and normalizer.
struct BlockCase {
  int lanes = 32, dim = 40, value_dim = 24;
  long keys = 100;
  std::vector<long> counts;  ///< [lanes]
};

template <bool Spread, class S = float>
std::vector<float> block_state(const BlockCase& c, int team_size, bool packed = false) {
  using policy_t = Kokkos::TeamPolicy<exec>;
  using member_t = policy_t::member_type;
  using scratch_t = Kokkos::View<float*, exec::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  const int D = c.dim, Dv = c.value_dim, lanes = c.lanes;
  const long K = c.keys;
  const auto keys = random_view<S>("keys", 1, 1, K, D, 11);
  const auto values = random_view<S>("values", 1, 1, K, Dv, 12);
  const auto queries = random_view<float>("queries", 1, 1, lanes, D, 13, 3.0f);
  const auto bias = random_view<float>("bias", 1, 1, 1, K, 14, 2.0f);
  Kokkos::View<long*, mem> counts("counts", lanes);
  auto counts_h = Kokkos::create_mirror_view(counts);
  long most = 0;
  for (int u = 0; u < lanes; ++u) counts_h(u) = c.counts[u], most = c.counts[u] > most ? c.counts[u] : most;
  Kokkos::deep_copy(counts, counts_h);
  const long per_lane = 2 + Dv;
  Kokkos::View<float*, mem> out("state", long(kk::QueryBlock::lanes) * per_lane);
  const long floats = kk::QueryBlock::scratch_floats(D, Dv, packed);
  policy_t policy = team_size > 0 ? policy_t(exec(), 1, team_size) : policy_t(exec(), 1, Kokkos::AUTO);
  int level = 0;
  policy = kk::with_float_scratch(policy, floats, level);
  Kokkos::parallel_for(
      "test_tile_spread::block", policy, KOKKOS_LAMBDA(const member_t& team) {
        scratch_t scratch(team.team_scratch(level), floats);
        kk::QueryBlock blk;
        blk.carve(scratch.data(), lanes, D, Dv, packed);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kk::QueryBlock::lanes), [&](int u) {
          blk.load(u, u < lanes ? &queries(0, 0, u, 0) : static_cast<const float*>(nullptr));
          blk.scales[u] = 0.125f + 0.01f * static_cast<float>(u);
        });
        team.team_barrier();
        kk::attend_block<Spread>(
            team, blk, blk.scales, most, [&](int u) { return counts(u); }, [&](long j) { return &keys(0, 0, j, 0); },
            [&](long j) { return &values(0, 0, j, 0); }, [&](long j) { return bias(0, 0, 0, j); });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, lanes), [&](int u) {
          out(u * per_lane) = blk.max_logit[u];
          out(u * per_lane + 1) = blk.normalizer[u];
          for (int x = 0; x < Dv; ++x) out(u * per_lane + 2 + x) = blk.acc[long(u) * Dv + x];
        });
      });
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
  return std::vector<float>(h.data(), h.data() + h.span());
}

/// A team as wide as the backend runs: 128 threads on a GPU, every thread (at most 2 here) on a CPU.
int widest_team() {
  const int threads = exec().concurrency();
  return threads >= 128 ? 128 : (threads >= 2 ? 2 : 1);
}
}  // namespace

namespace {
/// Query blocks of every shape the readout forms: full, causal, a GQA decode step, a G = 1 decode step,
/// decode steps that the spread form walks in runs of tiles, ragged lanes.
std::vector<BlockCase> block_cases() {
  std::vector<BlockCase> v;
  BlockCase full;  // every lane reads every key; a last tile of 4 keys
  full.counts.assign(32, 100);
  v.push_back(full);
  BlockCase causal;  // a causal block: lane u reads 37 + u keys; D, Dv not multiples of a vector
  causal.dim = 33, causal.value_dim = 17, causal.keys = 68;
  for (int u = 0; u < 32; ++u) causal.counts.push_back(37 + u);
  v.push_back(causal);
  // Decode steps (one position: every live lane reads every key): `lanes` query heads of a group, D, Dv.
  auto decode = [&](int lanes, int dim, int value_dim, long keys) {
    BlockCase c;
    c.lanes = lanes, c.dim = dim, c.value_dim = value_dim, c.keys = keys;
    c.counts.assign(lanes, keys);
    v.push_back(c);
  };
  decode(4, 64, 64, 300);  // a group of 4 query heads (4 live lanes)
  decode(1, 40, 24, 7);    // G = 1: one live lane, a tile of 7 keys
  // The spread form walks these in runs of several tiles (kernels::attend_run_spread): G = 8 in runs of 4
  // tiles ending in a partial run and tile, G = 16 in runs of 2, G = 1 in runs of 8 with a last run of one
  // partial tile, and D, Dv not multiples of the four channels read ahead.
  decode(8, 64, 40, 301);
  decode(16, 35, 18, 130);
  decode(1, 129, 130, 520);
  BlockCase ragged;  // lanes that read nothing in some tiles and nothing at all
  ragged.lanes = 20, ragged.keys = 90;
  for (int u = 0; u < 20; ++u) ragged.counts.push_back(u % 5 == 0 ? 0 : 3 * u + 20);
  v.push_back(ragged);
  return v;
}
}  // namespace

TEST_CASE("a query block gives the same bits in register tiles and spread one thread per element",
          "[readout][tiles]") {
  const std::vector<BlockCase> cases = block_cases();
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto tiled = block_state<false>(cases[i], 0);
    REQUIRE(tiled.size() == std::size_t(kk::QueryBlock::lanes) * (2 + cases[i].value_dim));
    for (int team : {1, widest_team()}) {
      const auto spread = block_state<true>(cases[i], team);
      const long at = first_difference(tiled, spread);
      INFO("case " << i << ", spread over teams of " << team << " threads: first difference at " << at);
      CHECK(at == -1);
    }
  }
}

TEMPLATE_TEST_CASE("a query block over 16-bit keys gives the same bits with its key tiles packed to float32",
                   "[readout][tiles][dtype]", kvmem::bfloat16, kvmem::float16) {
  // QueryBlock::packs: a block of more than one query widens each 16-bit key tile and its values once into
  // scratch; the G = 1 decode step (one lane) reads them as stored. Widening is exact, so the bits are those
  // of the block read as stored (spread form, which never packs) on every team width.
  const auto cases = block_cases();
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto stored = block_state<true, TestType>(cases[i], 1);
    for (int team : {1, widest_team()}) {
      const auto packed = block_state<false, TestType>(cases[i], team, true);
      const auto unpacked = block_state<false, TestType>(cases[i], team, false);
      INFO("case " << i << ", teams of " << team << " threads");
      CHECK(first_difference(stored, packed) == -1);
      CHECK(first_difference(stored, unpacked) == -1);
    }
  }
}

namespace {
/// An exact-attention shape: q [B, Hq, T, D] at positions [first, first + T) against k, v of first + T tokens.
struct ExactShape {
  long B, Hq, Hkv, T, D, Dv, first;
};

/// For every storage type (float32, bfloat16, float16) and shape: random q, k, v (seeds seed, seed + 1,
/// seed + 2) rounded to the type, then compare(q, k, v, first) with the type and shape as context.
template <std::size_t N, class Compare>
void for_each_exact_case(const ExactShape (&shapes)[N], unsigned seed, Compare compare) {
  auto check = [&]<class T>(T) {
    for (const auto& s : shapes) {
      const long Tk = s.first + s.T;
      const auto q = random_view<T>("q", s.B, s.Hq, s.T, s.D, seed, 2.0f);
      const auto k = random_view<T>("k", s.B, s.Hkv, Tk, s.D, seed + 1);
      const auto v = random_view<T>("v", s.B, s.Hkv, Tk, s.Dv, seed + 2);
      INFO(kvmem::dtype_name<T> << " B " << s.B << " Hq " << s.Hq << " Hkv " << s.Hkv << " T " << s.T << " D " << s.D
                                  << " first " << s.first);
      compare(q, k, v, s.first);
    }
  };
  check(0.0f);
  check(kvmem::bfloat16{});
  check(kvmem::float16{});
}

/// A tile form with `N` query blocks per team (TileTraits::blocks_per_team; kernels::attend_blocks).
template <class Form, int N>
struct BlocksPerTeam : Form {
  static constexpr int blocks_per_team = N;
};
}  // namespace

TEST_CASE("exact attention gives the same bits in register tiles and spread, in every storage type",
          "[readout][tiles][exact]") {
  // GQA G = 4, G = 1 with odd dims, G = 40 (two head groups per kv-head), decode steps at position 100 and
  // at 2,100 (three splits of readout_split_keys keys, read in runs of tiles by the spread form).
  const ExactShape shapes[] = {{2, 8, 2, 77, 40, 24, 0}, {1, 3, 3, 70, 33, 17, 0}, {1, 40, 1, 9, 16, 8, 0},
                               {2, 8, 2, 1, 64, 64, 100}, {1, 4, 1, 1, 48, 40, 2100}};
  for_each_exact_case(shapes, 21, [](const auto& q, const auto& k, const auto& v, long first) {
    CHECK(first_difference(exact_y<kk::RegisterTiles>(q, k, v, first), exact_y<kk::SpreadTiles>(q, k, v, first)) ==
          -1);
  });
}

TEST_CASE("exact attention gives the same bits for one, two or three query blocks per team, in every storage type",
          "[readout][tiles][exact]") {
  // attend_blocks: a team's blocks share each key tile (and its float32 widening); every lane runs the
  // operations it runs alone. Shapes whose last team holds fewer blocks than the others, blocks that read
  // fewer tiles than the team's last (causal), G = 4 blocks of 8 positions, and a decode step.
  const ExactShape shapes[] = {{1, 2, 2, 100, 40, 24, 0}, {2, 8, 2, 77, 33, 17, 0}, {1, 4, 1, 45, 16, 8, 30},
                               {1, 8, 2, 1, 64, 64, 100}};
  for_each_exact_case(shapes, 31, [](const auto& q, const auto& k, const auto& v, long first) {
    const auto one = exact_y<BlocksPerTeam<kk::RegisterTiles, 1>>(q, k, v, first);
    CHECK(first_difference(one, exact_y<BlocksPerTeam<kk::RegisterTiles, 2>>(q, k, v, first)) == -1);
    CHECK(first_difference(one, exact_y<BlocksPerTeam<kk::RegisterTiles, 3>>(q, k, v, first)) == -1);
    CHECK(first_difference(one, exact_y<BlocksPerTeam<kk::SpreadTiles, 2>>(q, k, v, first)) == -1);
  });
}
