// Compression per chunk and at the end of a prompt (EvictionConfig::chunk, observation_window; docs/eviction.md):
// the eviction memory that evicts once per chunk of C positions, or at the first decode step after a
// prompt (C = 0), scored by the observation window of queries (H2O, TOVA, KNorm, StreamingLLM, SnapKV's
// score::ObservationWindow), against the float64 reference's definition (tests/reference/eviction_reference.hpp,
// EvictPolicy::chunk); a chunk of one token is the streaming memory bit for bit; a prompt given in pieces
// (extend) is the whole prompt bit for bit when C >= 1; with C = 0 SnapKV keeps kernels::snapkv_keep's tokens;
// the rows held grow with the prompt only at C = 0.
#include <catch2/catch_test_macros.hpp>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <kvmem/eviction.hpp>

#include "eviction_harness.hpp"

using namespace kvmem_test::eviction;

namespace {

/// A case of the harness with its chunking: C, W_obs and the length of the prompt (the first `prompt`
/// tokens in one prefill call, the rest decode steps; `pieces` > 1 splits the prompt into that many extend
/// calls of equal length).
struct ChunkCase {
  EvictCase c;
  bool snapkv = false;  // score::ObservationWindow instead of c.kind's scorer
  int chunk = 1, observation = 64;
  long prompt = 0;
  int pieces = 1;

  [[nodiscard]] kvmem::EvictionConfig config() const {
    auto cfg = c.config();
    cfg.chunk = chunk;
    cfg.observation_window = observation;
    return cfg;
  }
  [[nodiscard]] std::vector<long> calls() const {  // the prompt calls' lengths
    std::vector<long> out;
    for (int i = 0; i < pieces; ++i) out.push_back(prompt * (i + 1) / pieces - prompt * i / pieces);
    return out;
  }
  /// The tokens sequence b takes in each prompt call (its length may end inside or before the prompt).
  [[nodiscard]] std::vector<long> calls_of(long b) const {
    std::vector<long> out;
    long at = 0;
    for (long n : calls()) {
      out.push_back(std::clamp(c.length(b) - at, 0L, n));
      at += n;
    }
    return out;
  }
  [[nodiscard]] kvmem_ref::EvictPolicy policy(long b, long h) const {
    auto p = c.policy(b, h);
    if (snapkv) p.kind = kvmem_ref::EvictKind::snapkv;
    p.chunk = chunk, p.observation = observation;
    p.prompt_calls = calls_of(b);
    return p;
  }
  [[nodiscard]] std::string describe() const {
    return c.describe() + (snapkv ? " snapkv" : "") + " chunk=" + std::to_string(chunk) + " W_obs=" +
           std::to_string(observation) + " prompt=" + std::to_string(prompt) + " pieces=" + std::to_string(pieces);
  }
};

struct ChunkOutput {
  std::vector<float> y, lse;
  std::vector<std::vector<long>> kept;  // per (b, h) after the last step
  long slots = 0;
};

template <class Scorer>
ChunkOutput run_chunked(const ChunkCase& cc, const Scorer& scorer) {
  const EvictCase& c = cc.c;
  using space = host_mem;
  const auto q = to_device<space>(c.q, c.B, c.Hq, c.T, c.D, "q");
  const auto k = to_device<space>(c.k, c.B, c.Hkv, c.T, c.D, "k");
  const auto v = to_device<space>(c.v, c.B, c.Hkv, c.T, c.Dv, "v");
  view4<space> y("y", c.B, c.Hq, c.T, c.Dv);
  Kokkos::View<float***, Kokkos::LayoutRight, space> lse("lse", c.B, c.Hq, c.T);
  using memory_t = kvmem::EvictionMemory<host_exec, Scorer>;
  memory_t mem(cc.config(), static_cast<int>(c.B), scorer);
  auto slice = [](const auto& x, long from, long to) {
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(from, to), Kokkos::ALL);
  };
  long at = 0;
  const auto calls = cc.calls();
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const long n = calls[i];
    std::vector<long> len(c.B);  // ragged: a sequence takes what is left of its length
    for (long b = 0; b < c.B; ++b) len[b] = cc.calls_of(b)[i];
    const typename memory_t::inputs in{slice(q, at, at + n), slice(k, at, at + n), slice(v, at, at + n)};
    const auto l = Kokkos::subview(lse, Kokkos::ALL, Kokkos::ALL, std::make_pair(at, at + n));
    if (at == 0) mem.prefill(in, slice(y, at, at + n), len, l);  // the first piece starts the prompt
    else mem.extend(in, slice(y, at, at + n), len, l);
    at += n;
  }
  std::vector<unsigned char> active(c.B);
  for (; at < c.T; ++at) {
    for (long b = 0; b < c.B; ++b) active[b] = at < c.length(b);
    const typename memory_t::inputs in{slice(q, at, at + 1), slice(k, at, at + 1), slice(v, at, at + 1)};
    mem.decode(in, slice(y, at, at + 1), active, Kokkos::subview(lse, Kokkos::ALL, Kokkos::ALL, std::make_pair(at, at + 1)));
  }
  ChunkOutput out;
  out.kept = cached_positions(mem);
  out.slots = mem.cache().slots();
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  out.y.assign(yh.data(), yh.data() + yh.size());
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  out.lse.assign(lh.data(), lh.data() + lh.size());
  return out;
}

ChunkOutput run_chunked(const ChunkCase& cc) {
  if (cc.snapkv) return run_chunked(cc, kvmem::score::ObservationWindow{});
  ChunkOutput out;
  with_scorer<host_mem>(cc.c, [&](const auto& scorer) { out = run_chunked(cc, scorer); });
  return out;
}

/// The memory against the float64 reference: the cache after the last step exactly, y and lse to the
/// harness' tolerance (NaN-aware).
void check_chunked(const ChunkCase& cc) {
  INFO(cc.describe());
  const EvictCase& c = cc.c;
  const auto got = run_chunked(cc);
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      INFO("sequence " << b << ", kv-head " << h);
      const auto ref = kvmem_ref::evict_decode(c.head(b, h), cc.policy(b, h));
      REQUIRE(got.kept[b * c.Hkv + h] == ref.kept);
      std::vector<float> y, lse;
      for (long g = 0; g < c.G(); ++g)
        for (long t = 0; t < c.length(b); ++t) {
          for (long d = 0; d < c.Dv; ++d) y.push_back(got.y[((b * c.Hq + h * c.G() + g) * c.T + t) * c.Dv + d]);
          lse.push_back(got.lse[(b * c.Hq + h * c.G() + g) * c.T + t]);
        }
      CHECK(kvmem_test::relative_error(y, ref.y) <= tolerance);
      CHECK(kvmem_test::relative_error(lse, ref.lse) <= tolerance);
    }
}

ChunkCase make(Kind kind, bool snapkv, int chunk, int observation, long prompt, unsigned seed) {
  ChunkCase cc;
  cc.c.kind = kind;
  cc.c.B = 2, cc.c.Hq = 4, cc.c.Hkv = 2, cc.c.T = 48, cc.c.D = 8, cc.c.Dv = 6;
  cc.c.sinks = 2, cc.c.window = 3, cc.c.top_k = 6;
  cc.c.seed = seed;
  cc.c.generate();
  cc.snapkv = snapkv, cc.chunk = chunk, cc.observation = observation, cc.prompt = prompt;
  return cc;
}

}  // namespace

TEST_CASE("chunked eviction: every scorer, chunk and observation window against the reference", "[eviction][chunk]") {
  unsigned seed = 1;
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::h2o, Kind::tova, Kind::kvpop})
    for (bool snapkv : {false, true}) {
      if (snapkv && kind != Kind::h2o) continue;  // one run of the SnapKV scorer per setting
      for (int chunk : {0, 1, 2, 5, 16})
        for (int observation : {0, 1, 3})
          for (bool merge : {false, true}) {
            if (chunk > 1 && observation > chunk) continue;  // refused (the bad-input case below)
            auto cc = make(kind, snapkv, chunk, observation, /*prompt=*/30, seed++);
            cc.c.merge = merge;
            check_chunked(cc);
            if (chunk == 0) {  // a prompt in pieces: extend's token-by-token steps at the end of a prompt
              cc.pieces = 3;
              check_chunked(cc);
            }
          }
    }
}

TEST_CASE("chunked eviction: edge cases against the reference", "[eviction][chunk]") {
  // the whole sequence a prompt (no decode step: nothing evicted at chunk 0), a prompt of one token (an
  // observation window of one query), a chunk longer than the sequence, the observation window as long as
  // the chunk, the window wider than a chunk, k = 0, ragged-free G = 1
  for (int chunk : {0, 3, 64}) {
    check_chunked(make(Kind::h2o, false, chunk, chunk == 3 ? 3 : 4, 48, 50 + chunk));
    check_chunked(make(Kind::tova, false, chunk, 1, 1, 60 + chunk));
    auto wide = make(Kind::knorm, false, chunk, 0, 20, 70 + chunk);
    wide.c.window = 9, wide.c.top_k = 0;
    wide.c.generate();
    check_chunked(wide);
    auto g1 = make(Kind::h2o, true, chunk, chunk == 3 ? 2 : 5, 25, 80 + chunk);
    g1.c.Hq = 3, g1.c.Hkv = 3, g1.c.sinks = 0;
    g1.c.generate();
    check_chunked(g1);
  }
}

TEST_CASE("chunked eviction: a chunk of one token is the streaming memory bit for bit", "[eviction][chunk]") {
  // the harness' streaming run (the default EvictionConfig, the same prefill then decode steps) against
  // chunk 1 with another observation window, which means nothing at C = 1
  for (Kind kind : {Kind::knorm, Kind::h2o, Kind::tova, Kind::kvpop}) {
    auto cc = make(kind, false, 1, 5, 20, 90 + static_cast<unsigned>(kind));
    const auto a = run_chunked(cc);
    const auto b = run_evict(cc.c, Mode::prefill_then_decode, cc.prompt);
    INFO(cc.describe());
    REQUIRE(same_bits(a.y, b.y));
    REQUIRE(same_bits(a.lse, b.lse));
    REQUIRE(a.kept == b.kept);
    REQUIRE(a.slots == cc.c.budget() + 1);
  }
}

TEST_CASE("chunked eviction: ragged prompts and sequences at different stages", "[eviction][chunk]") {
  // three sequences: one whose prompt ends before the others', one empty, one longer than the prompt;
  // at chunk 0 the whole prompt takes exact attention and later steps mix prompts and decode steps
  for (int chunk : {0, 3})
    for (bool snapkv : {false, true}) {
      auto cc = make(Kind::tova, snapkv, chunk, chunk == 0 ? 4 : 3, 24, 700 + static_cast<unsigned>(chunk) + snapkv);
      cc.c.B = 3, cc.c.lengths = {48, 0, 17};
      cc.c.generate();
      check_chunked(cc);
      cc.pieces = 2;
      check_chunked(cc);
    }
}

TEST_CASE("chunked eviction: a prompt in pieces is the whole prompt when the chunks are positions", "[eviction][chunk]") {
  for (int chunk : {1, 4, 7}) {
    auto whole = make(Kind::h2o, true, chunk, 3, 36, 120 + chunk);
    auto pieces = whole;
    pieces.pieces = 5;
    const auto a = run_chunked(whole), b = run_chunked(pieces);
    INFO(whole.describe());
    REQUIRE(same_bits(a.y, b.y));
    REQUIRE(a.kept == b.kept);
    REQUIRE(a.slots == whole.c.budget() + chunk);  // budget + C rows, whatever the prompt
  }
}

TEST_CASE("chunked eviction: at the end of a prompt SnapKV keeps snapkv_keep's tokens", "[eviction][chunk][snapkv]") {
  // SnapKV after a prompt of L tokens with W_obs observation queries and C_max = W_obs + k: the memory with
  // chunk 0, no sinks, window W_obs + 1 and top_k k holds, after the first decode step, SnapKV's tokens and
  // the new one.
  for (int W : {1, 4, 8})
    for (long k : {0L, 5L, 12L}) {
      ChunkCase cc = make(Kind::h2o, true, 0, W, 40, 200 + static_cast<unsigned>(W * 16 + k));
      cc.c.sinks = 0, cc.c.window = W + 1, cc.c.top_k = static_cast<int>(k), cc.c.T = 41;
      cc.c.generate();
      const auto got = run_chunked(cc);
      const auto q = to_device<host_mem>(cc.c.q, cc.c.B, cc.c.Hq, cc.c.T, cc.c.D, "q");
      const auto kk = to_device<host_mem>(cc.c.k, cc.c.B, cc.c.Hkv, cc.c.T, cc.c.D, "k");
      Kokkos::View<long*, host_mem> len("len", cc.c.B);
      Kokkos::deep_copy(len, 40L);
      kvmem::kernels::SnapKvScratch<host_mem> scratch;
      scratch.allocate(cc.c.B, cc.c.Hq, cc.c.Hkv, cc.c.T, W);
      Kokkos::View<long***, host_mem> positions("positions", cc.c.B, cc.c.Hkv, 41);
      Kokkos::View<long**, host_mem> rows("rows", cc.c.B, cc.c.Hkv);
      kvmem::kernels::snapkv_keep(host_exec(), q, kk, len, W, static_cast<int>(k), scratch, positions, rows);
      host_exec().fence();
      for (long b = 0; b < cc.c.B; ++b)
        for (long h = 0; h < cc.c.Hkv; ++h) {
          std::vector<long> want;
          for (long i = 0; i < rows(b, h); ++i) want.push_back(positions(b, h, i));
          want.push_back(40);
          INFO(cc.describe() << " sequence " << b << " kv-head " << h);
          REQUIRE(got.kept[b * cc.c.Hkv + h] == want);
        }
    }
}

TEST_CASE("chunked eviction: the rows grow with the prompt only at the end of a prompt", "[eviction][chunk]") {
  auto cc = make(Kind::h2o, false, 0, 4, 30, 300);
  const auto got = run_chunked(cc);
  REQUIRE(got.slots == cc.c.budget() + 1 + 30);  // the prompt held whole until the first decode step
  for (const auto& kept : got.kept) REQUIRE(static_cast<long>(kept.size()) <= cc.c.budget());
}

TEST_CASE("chunked eviction: bad chunking is refused before anything runs", "[eviction][chunk][errors]") {
  auto cc = make(Kind::h2o, false, -1, 4, 0, 400);
  REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>(cc.config(), 1)),
                      Catch::Matchers::ContainsSubstring("chunk = -1"));
  cc.chunk = 2, cc.observation = -3;
  REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>(cc.config(), 1)),
                      Catch::Matchers::ContainsSubstring("observation_window = -3"));
  cc.observation = 3;  // more queries than a chunk has
  REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>(cc.config(), 1)),
                      Catch::Matchers::ContainsSubstring("observation_window = 3"));
  cc.observation = 2;
  kvmem::score::LastQueryAttention layer;
  layer.layer_mean = true;
  REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::LastQueryAttention>(cc.config(), 1, layer)),
                      Catch::Matchers::ContainsSubstring("chunk = 2"));
}

TEST_CASE("chunked eviction: a prompt shorter than the observation window is refused at the end of a prompt",
          "[eviction][chunk][errors]") {
  // at chunk 0 a sequence that holds nothing must be given at least W_obs tokens; a later piece of the
  // prompt may be shorter, and so may a sequence given no tokens in the call
  auto cc = make(Kind::h2o, false, 0, 8, 0, 410);
  cc.c.B = 2, cc.c.T = 20, cc.c.generate();
  using memory_t = kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>;
  memory_t mem(cc.config(), 2);
  const auto q = to_device<host_mem>(cc.c.q, 2, cc.c.Hq, 20, cc.c.D, "q");
  const auto k = to_device<host_mem>(cc.c.k, 2, cc.c.Hkv, 20, cc.c.D, "k");
  const auto v = to_device<host_mem>(cc.c.v, 2, cc.c.Hkv, 20, cc.c.Dv, "v");
  view4<host_mem> y("y", 2, cc.c.Hq, 20, cc.c.Dv);
  auto first = [](const auto& x, long from, long to) {
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(from, to), Kokkos::ALL);
  };
  const memory_t::inputs head{first(q, 0, 10), first(k, 0, 10), first(v, 0, 10)};
  const std::vector<long> short_prompt{10, 7};
  REQUIRE_THROWS_WITH(mem.prefill(head, first(y, 0, 10), short_prompt),
                      Catch::Matchers::ContainsSubstring("observation_window = 8") &&
                          Catch::Matchers::ContainsSubstring("prompt of sequence 1 (7 tokens"));
  REQUIRE(mem.tokens(0) == 0);  // nothing changed
  REQUIRE(mem.tokens(1) == 0);
  const std::vector<long> one_waits{10, 0};
  mem.prefill(head, first(y, 0, 10), one_waits);  // sequence 1 takes no tokens: not a prompt yet
  const memory_t::inputs tail{first(q, 10, 13), first(k, 10, 13), first(v, 10, 13)};
  const std::vector<long> piece{3, 0};
  mem.extend(tail, first(y, 10, 13), piece);  // a later piece of 3 tokens: all of its queries observe
  REQUIRE(mem.tokens(0) == 13);
}

TEST_CASE("chunked eviction: a second turn after the prompt compressed attends what was kept, then evicts",
          "[eviction][chunk]") {
  // chunk 0: prefill P1, decode (the first step compresses), extend P2 (a second turn: appended and attended
  // exactly over the kept rows and P2, causally; nothing evicted), decode (compresses again)
  auto cc = make(Kind::h2o, false, 0, 4, 0, 420);
  cc.c.B = 1, cc.c.T = 40, cc.c.lengths = {}, cc.c.generate();
  const EvictCase& c = cc.c;
  using memory_t = kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>;
  memory_t mem(cc.config(), 1);
  const auto q = to_device<host_mem>(c.q, 1, c.Hq, c.T, c.D, "q");
  const auto k = to_device<host_mem>(c.k, 1, c.Hkv, c.T, c.D, "k");
  const auto v = to_device<host_mem>(c.v, 1, c.Hkv, c.T, c.Dv, "v");
  view4<host_mem> y("y", 1, c.Hq, c.T, c.Dv);
  auto part = [](const auto& x, long from, long to) {
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(from, to), Kokkos::ALL);
  };
  auto in = [&](long from, long to) { return memory_t::inputs{part(q, from, to), part(k, from, to), part(v, from, to)}; };
  mem.prefill(in(0, 20), part(y, 0, 20));
  for (long t = 20; t < 24; ++t) mem.decode(in(t, t + 1), part(y, t, t + 1));
  const auto kept = cached_positions(mem);
  for (const auto& rows : kept) REQUIRE(static_cast<long>(rows.size()) == c.budget());
  mem.extend(in(24, 34), part(y, 24, 34));
  const auto after = cached_positions(mem);
  for (std::size_t h = 0; h < after.size(); ++h) {
    REQUIRE(static_cast<long>(after[h].size()) == c.budget() + 10);  // the second turn held whole
    auto expect = kept[h];
    for (long t = 24; t < 34; ++t) expect.push_back(t);
    auto got = after[h];
    std::sort(got.begin(), got.end());
    std::sort(expect.begin(), expect.end());
    REQUIRE(got == expect);
  }
  // the second turn's outputs: one softmax over the kept rows and the turn's tokens up to the query (float64)
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  for (long hq = 0; hq < c.Hq; ++hq) {
    const long h = hq / c.G();
    for (long t = 24; t < 34; ++t) {
      std::vector<long> keys = kept[h];
      for (long j = 24; j <= t; ++j) keys.push_back(j);
      std::vector<double> logit;
      double top = -1e300;
      for (long j : keys) {
        double dot = 0;
        for (long d = 0; d < c.D; ++d) dot += double(c.q[(hq * c.T + t) * c.D + d]) * c.k[(h * c.T + j) * c.D + d];
        logit.push_back(dot / std::sqrt(double(c.D)));
        top = std::max(top, logit.back());
      }
      double sum = 0;
      for (auto& l : logit) sum += (l = std::exp(l - top));
      for (long d = 0; d < c.Dv; ++d) {
        double want = 0;
        for (std::size_t i = 0; i < keys.size(); ++i) want += logit[i] / sum * c.v[(h * c.T + keys[i]) * c.Dv + d];
        INFO("query head " << hq << ", position " << t << ", channel " << d);
        REQUIRE(std::abs(yh(0, hq, t, d) - want) <= 1e-4 * (1 + std::abs(want)));
      }
    }
  }
  mem.decode(in(34, 35), part(y, 34, 35));
  for (const auto& rows : cached_positions(mem)) REQUIRE(static_cast<long>(rows.size()) == c.budget());
}

TEST_CASE("chunked eviction: the reference check fails on a memory that evicts at other steps", "[eviction][chunk]") {
  // a test of the test: the memory run with chunk 2 against the reference's chunk 3 must disagree
  auto cc = make(Kind::h2o, false, 2, 2, 30, 500);
  const auto got = run_chunked(cc);
  auto other = cc;
  other.chunk = 3;
  bool differs = false;
  for (long b = 0; b < cc.c.B; ++b)
    for (long h = 0; h < cc.c.Hkv; ++h) {
      const auto ref = kvmem_ref::evict_decode(cc.c.head(b, h), other.policy(b, h));
      differs = differs || got.kept[b * cc.c.Hkv + h] != ref.kept;
    }
  REQUIRE(differs);
}
