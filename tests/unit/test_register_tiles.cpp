// The register tiles of the CPU kernels (math/simd.hpp, kernels/update/update.hpp): a block of queries or
// tokens in vector lanes against rows broadcast one channel at a time must give, per (lane, row), the
// bits of one `dot` -- the readout's block of queries and its decode query, and the update's tiles and
// its one-thread-per-token path (the path of GPUs), must agree exactly (spec KVM.md §5.3, §5.5).
#include <catch2/catch_test_macros.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "float_bits.hpp"

namespace {
using kvmem_test::same_bits;
using kvmem_test::uniform;
constexpr int L = kvmem::kernels::update_lanes;

/// The kernels' callbacks are device functions too: functors, not host lambdas (nvcc checks the calls).
struct StoreTile {
  float* out;
  KOKKOS_INLINE_FUNCTION void operator()(int k, int x, const kvmem::kernels::simd::vec& s) const {
    kvmem::kernels::simd::store(out + k * L + x * kvmem::kernels::simd::width, s);
  }
};
struct RowOf {
  const float* rows;
  int dim;
  KOKKOS_INLINE_FUNCTION const float* operator()(long i) const { return rows + i * dim; }
};

/// at [dim][L]: lane u holds vectors[u] (transposed, as the kernels lay a block out).
std::vector<float> transpose(const std::vector<float>& vectors, int dim) {
  std::vector<float> at(std::size_t(dim) * L);
  for (int u = 0; u < L; ++u)
    for (int c = 0; c < dim; ++c) at[std::size_t(c) * L + u] = vectors[std::size_t(u) * dim + c];
  return at;
}
}  // namespace

TEST_CASE("lane_dots gives each lane the bits of one dot per row", "[simd][readout][update]") {
  for (int dim : {1, 7, 40, 64, 128}) {
    auto vectors = uniform(std::size_t(L) * dim, 3 + dim), rows = uniform(4 * std::size_t(dim), 4 + dim);
    vectors[0] = -0.0f;  // signed zeros and a large value go through unchanged
    rows[0] = -0.0f;
    vectors[dim] = 3.0e38f;
    const auto at = transpose(vectors, dim);
    const float* r[4] = {rows.data(), rows.data() + dim, rows.data() + 2 * dim, rows.data() + 3 * dim};
    std::vector<float> got(4 * L);
    kvmem::kernels::simd::lane_dots<L, 4>(at.data(), dim, r, StoreTile{got.data()});
    for (int k = 0; k < 4; ++k)
      for (int u = 0; u < L; ++u)
        CHECK(same_bits(got[k * L + u], kvmem::kernels::dot(vectors.data() + std::size_t(u) * dim, r[k], dim)));
  }
}

TEST_CASE("transpose and row_dots: a query against a register's width of rows, the bits of dot per row",
          "[simd][readout]") {
  namespace simd = kvmem::kernels::simd;
  constexpr int W = simd::width;
  std::vector<float> m = uniform(W * W, 5);
  simd::vec r[W];
  for (int i = 0; i < W; ++i) r[i] = simd::load(m.data() + i * W);
  simd::transpose(r);
  std::vector<float> t(W * W);
  for (int i = 0; i < W; ++i) simd::store(t.data() + i * W, r[i]);
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) CHECK(same_bits(t[i * W + j], m[j * W + i]));
  for (int dim : {1, W - 1, W, W + 3, 40, 64, 128}) {
    INFO("dim=" << dim);
    auto rows = uniform(std::size_t(W) * dim, 6 + dim), q = uniform(std::size_t(3) * dim, 7 + dim);
    rows[0] = -0.0f;  // signed zeros and a large value go through unchanged
    q[0] = -0.0f;
    rows[std::size_t(dim) * (W - 1)] = 3.0e38f;
    std::vector<const float*> row(W);
    for (int k = 0; k < W; ++k) row[k] = rows.data() + std::size_t(k) * dim;
    std::vector<float> q_strided(std::size_t(3) * dim), got(W);  // the query as one lane of a [dim][3] block
    for (int c = 0; c < dim; ++c) q_strided[std::size_t(c) * 3] = q[c];
    simd::row_dots(q_strided.data(), 3, dim, row.data(), got.data());
    for (int k = 0; k < W; ++k) CHECK(same_bits(got[k], kvmem::kernels::dot(q.data(), row[k], dim)));
  }
}

TEST_CASE("token_rows_max is the row-order argmax of route and the maximum of novelty", "[simd][update]") {
  const int dim = 24;
  auto tokens = uniform(std::size_t(L) * dim, 21);
  auto rows = uniform(13 * std::size_t(dim), 22);
  // Rows 5 and 9 equal row 2 (ties go to the lower row); token 3 is NaN (a non-finite key); token 4 is
  // zero (every score ties at 0).
  for (int c = 0; c < dim; ++c) rows[5 * dim + c] = rows[9 * dim + c] = rows[2 * dim + c];
  tokens[3 * dim + 1] = std::numeric_limits<float>::quiet_NaN();
  for (int c = 0; c < dim; ++c) tokens[4 * dim + c] = 0.0f;
  const auto at = transpose(tokens, dim);
  const RowOf row_of{rows.data(), dim};
  for (long first = 0; first <= 2; ++first)
    for (long end = first; end <= 13; ++end)  // no rows, fewer than a group of 4, groups and tails
      for (bool take_first : {true, false}) {
        float best[L];
        int row[L];
        kvmem::kernels::token_rows_max<L>(at.data(), dim, first, end, take_first, row_of, best, row);
        for (int u = 0; u < L; ++u) {
          // The one-thread-per-token loops of kernels::update_state (route) and score::Novelty.
          float want = -std::numeric_limits<float>::infinity();
          long want_row = first;
          for (long i = first; i < end; ++i) {
            const float s = kvmem::kernels::dot(tokens.data() + std::size_t(u) * dim, row_of(i), dim);
            if (s > want || (take_first && i == first)) want = s, want_row = i;
          }
          CHECK(same_bits(best[u], want));
          CHECK(row[u] == want_row);
        }
      }
}

// Device-callable functors for the scans (nvcc rejects host lambdas called from KOKKOS_INLINE_FUNCTIONs).
struct NoveltyAndRoute {  // the score pass: the novelty maximum over every row, the route's from `first`
  kvmem::kernels::LaneArgmax<L>* novelty;
  kvmem::kernels::LaneArgmax<L>* route;
  long first;
  KOKKOS_INLINE_FUNCTION void operator()(long i, int x, const kvmem::kernels::simd::vec& s) const {
    novelty->keep(i, x, s, false);
    if (i >= first) route->keep(i, x, s, i == first);
  }
};
struct Continue {  // the route pass over the appended rows
  kvmem::kernels::LaneArgmax<L>* route;
  KOKKOS_INLINE_FUNCTION void operator()(long i, int x, const kvmem::kernels::simd::vec& s) const {
    route->keep(i, x, s, false);
  }
};
struct OneToken {  // one thread per token: the scores as they come, and the route's argmax
  const float* key;
  RowOf row_of;
  int dim;
  long first;
  float* best;
  long* best_row;
  int* wrong_bits;
  KOKKOS_INLINE_FUNCTION void operator()(long i, float s) const {
    const float want = kvmem::kernels::dot(key, row_of(i), dim);
    if (Kokkos::bit_cast<unsigned>(s) != Kokkos::bit_cast<unsigned>(want)) ++*wrong_bits;
    if (s > *best || i == first) *best = s, *best_row = i;
  }
};

TEST_CASE("a route continued over the appended rows from the score pass's best row is one scan of every row",
          "[simd][update]") {
  // update_state's score pass scans rows [0, m) once for the novelty maximum and the route's best row among
  // [first, m); the route pass continues from it over [m, end). Both forms (lanes and one thread per token)
  // must give one scan's row and bits, NaN scores and ties included.
  const int dim = 20;
  auto tokens = uniform(std::size_t(L) * dim, 31);
  auto rows = uniform(12 * std::size_t(dim), 32);
  for (int c = 0; c < dim; ++c) rows[7 * dim + c] = rows[3 * dim + c];  // an appended row ties an old one
  tokens[2 * dim + 5] = std::numeric_limits<float>::quiet_NaN();
  for (int c = 0; c < dim; ++c) rows[0 * dim + c] = 0.0f, tokens[6 * dim + c] = 0.0f;
  const auto at = transpose(tokens, dim);
  const RowOf row_of{rows.data(), dim};
  namespace k = kvmem::kernels;
  const float inf = std::numeric_limits<float>::infinity();
  for (long first = 0; first <= 2; ++first)
    for (long m = first + 1; m <= 12; ++m)
      for (long end = m; end <= 12; ++end) {
        INFO("first " << first << ", m " << m << ", end " << end);
        float whole[L], part[L], novelty_best[L], novelty_want[L];
        int whole_row[L], part_row[L], novelty_row[L];
        k::token_rows_max<L>(at.data(), dim, first, end, true, row_of, whole, whole_row);
        k::token_rows_max<L>(at.data(), dim, 0, m, false, row_of, novelty_want, novelty_row);
        k::LaneArgmax<L> novelty, route;
        novelty.start(-inf, 0);
        route.start(-inf, first);
        k::token_rows_scan<L>(at.data(), dim, 0, m, row_of, NoveltyAndRoute{&novelty, &route, first});
        route.store(part, part_row);
        k::LaneArgmax<L> continued;
        continued.start(part, part_row);
        k::token_rows_scan<L>(at.data(), dim, m, end, row_of, Continue{&continued});
        continued.store(part, part_row);
        novelty.store(novelty_best, novelty_row);
        for (int u = 0; u < L; ++u) {
          CHECK(same_bits(part[u], whole[u]));
          CHECK(part_row[u] == whole_row[u]);
          CHECK(same_bits(novelty_best[u], novelty_want[u]));
          float one = -inf;
          long one_row = first;
          int wrong_bits = 0;
          k::key_rows_scan(tokens.data() + std::size_t(u) * dim, dim, first, end, row_of,
                           OneToken{tokens.data() + std::size_t(u) * dim, row_of, dim, first, &one, &one_row, &wrong_bits});
          CHECK(wrong_bits == 0);
          CHECK(same_bits(one, whole[u]));
          CHECK(one_row == whole_row[u]);
        }
      }
}

namespace register_tiles_test {
/// score::Novelty without its max_similarity declaration: the update scores it one thread per token.
struct NoveltyPerToken {
  static constexpr std::string_view name = "novelty (per token)";
  KOKKOS_INLINE_FUNCTION static float score(const float* key, const float* rows_keys, long rows, int dim) {
    return kvmem::score::Novelty::score(key, rows_keys, rows, dim);
  }
};
}  // namespace register_tiles_test
using register_tiles_test::NoveltyPerToken;

TEST_CASE("a KVM memory scored in register tiles gives the bits of one thread per token", "[simd][update][kvm]") {
  using exec = Kokkos::DefaultHostExecutionSpace;
  using space = exec::memory_space;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = 40, cfg.value_dim = 24, cfg.query_heads = 4, cfg.kv_heads = 2, cfg.chunk = 20, cfg.window_chunks = 2;
  cfg.rope_dims = 8, cfg.sinks = 3, cfg.max_rows = 1 << 16;
  const kvmem::budget::PowerLaw budget{.min_rows = 30, .growth_factor = 4.0, .growth_exponent = 0.5};
  Kokkos::View<float*, space> ones("ones", cfg.head_dim), zeros("zeros", cfg.head_dim), taus("tau", cfg.query_heads);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  const kvmem::LayerWeights<space> weights{ones, zeros, taus, taus};
  const long T = 700, prompt = 600;
  using V4 = Kokkos::View<float****, Kokkos::LayoutRight, space>;
  using V3 = Kokkos::View<float***, Kokkos::LayoutRight, space>;
  V4 q("q", 1, cfg.query_heads, T, cfg.head_dim), k("k", 1, cfg.kv_heads, T, cfg.head_dim),
      v("v", 1, cfg.kv_heads, T, cfg.value_dim);
  V3 gate("gate", 1, cfg.kv_heads, T);
  for (auto [view, seed] : {std::pair{q, 1u}, std::pair{k, 2u}, std::pair{v, 3u}}) {
    const auto x = uniform(view.size(), seed);
    std::memcpy(view.data(), x.data(), x.size() * sizeof(float));
  }
  const auto g = uniform(gate.size(), 4);
  std::memcpy(gate.data(), g.data(), g.size() * sizeof(float));
  auto run = [&](auto& memory) {
    V4 y("y", 1, cfg.query_heads, T, cfg.value_dim);
    auto tokens = [](auto view, long t0, long t1) {
      return Kokkos::subview(view, Kokkos::ALL, Kokkos::ALL, Kokkos::make_pair(t0, t1), Kokkos::ALL);
    };
    auto gates = [&](long t0, long t1) { return Kokkos::subview(gate, Kokkos::ALL, Kokkos::ALL, Kokkos::make_pair(t0, t1)); };
    memory.prefill(tokens(q, 0, prompt), tokens(k, 0, prompt), tokens(v, 0, prompt), gates(0, prompt), tokens(y, 0, prompt));
    for (long t = prompt; t < T; ++t)
      memory.decode(tokens(q, t, t + 1), tokens(k, t, t + 1), tokens(v, t, t + 1), gates(t, t + 1), tokens(y, t, t + 1));
    exec().fence();
    return std::vector<float>(y.data(), y.data() + y.size());
  };
  static_assert(kvmem::kernels::scores_max_similarity<kvmem::score::Novelty>);
  static_assert(!kvmem::kernels::scores_max_similarity<NoveltyPerToken>);
  kvmem::Memory<exec, kvmem::merge::WinnerTakeAll, kvmem::budget::PowerLaw, kvmem::score::Novelty> tiles(cfg, budget,
                                                                                                      weights, 1);
  kvmem::Memory<exec, kvmem::merge::WinnerTakeAll, kvmem::budget::PowerLaw, NoveltyPerToken> per_token(cfg, budget,
                                                                                                     weights, 1);
  const auto a = run(tiles), b = run(per_token);
  REQUIRE(tiles.cursor(0).rows > 2 * cfg.chunk);  // the state grew: blocks were scored and routed
  REQUIRE(a.size() == b.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
