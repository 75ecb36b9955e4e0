// Requests that come and go (docs/design.md, "Requests that come and go"): every memory serves a batch of
// slots that requests enter and leave at any step, as a continuously batching engine drives it.
//  - Random schedules of arrivals (a free slot is taken), prompts in one prefill or in chunks (chunked
//    prefill) interleaved with the other slots' decode steps, and departures (reset_sequence frees the
//    slot, which a later request takes). Each request's outputs and its state when it leaves must equal,
//    bit for bit, a batch-of-one memory that reads its whole prompt in one prefill and then decodes.
//  - reset_sequence's refusals: a slot out of range, and a slot that decode_async still advances once the
//    device counts steps on its own (plan_on_device(), the GPU's path); both leave every state unchanged.
//  - The strict slot protocol's refusals (set_strict_slots): a prefill into a busy slot, an extend (a
//    chunk) of a slot that has not started, a decode step of an empty slot; none changes any state.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "decode_stream.hpp"

namespace {

using namespace kvmem_test;
using Catch::Matchers::ContainsSubstring;

/// One input tensor of a family: heads x channels per token (channels 0: a per-token gate, rank 3), with
/// uniform values in [lo, hi).
struct Spec {
  long heads, channels;
  float lo = -1.0f, hi = 1.0f;
};

/// Token inputs of a batch, [B, heads, T, max(channels, 1)] each (a gate as channel 0 of a rank-4 view).
using tview = Kokkos::View<float****, Kokkos::LayoutStride, mem>;
using Inputs = std::vector<tview>;

/// Tokens [first, first + n) of every sequence of x: a subview, no copy.
tview tokens_of(const tview& x, long first, long n) {
  return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + n), Kokkos::ALL);
}

Inputs allocate(const std::vector<Spec>& specs, long B, long T) {
  Inputs in;
  for (const auto& s : specs) in.emplace_back(view4("in", B, s.heads, T, std::max(s.channels, 1L)));
  return in;
}
Inputs random_inputs(const std::vector<Spec>& specs, long T, std::uint64_t seed) {
  Inputs in;
  for (const auto& s : specs) in.push_back(random4("in", 1, s.heads, T, std::max(s.channels, 1L), seed++, s.lo, s.hi));
  return in;
}
/// Tokens [first, first + n) of sequence b, as a view of one sequence.
auto span_of(const tview& x, long b, long first, long n) {
  return Kokkos::subview(x, Kokkos::pair<long, long>(b, b + 1), Kokkos::ALL, Kokkos::pair<long, long>(first, first + n),
                         Kokkos::ALL);
}
/// Copies n tokens of sequence fb from `from` (at token ft) into sequence tb of `to` (at token tt).
void copy_tokens(const tview& from, long fb, long ft, const tview& to, long tb, long tt, long n) {
  Kokkos::deep_copy(span_of(to, tb, tt, n), span_of(from, fb, ft, n));
}
/// The view a memory takes for input i: rank 4, or rank 3 for a gate.
auto rank3(const tview& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, 0); }

// ---- the families, each with the calls the schedule makes ----

/// A KVM/OVQ/proportional memory (kvmem::Memory): q, k, v, gate in; y [B, Hq, T, Dv].
template <class Memory, class Make>
struct MergingFamily {
  Make make;
  static constexpr long piece_multiple() { return 1; }  // a continued prefill runs through the decode step: any piece
  std::vector<Spec> specs() const {
    return {{kQueryHeads, kHeadDim}, {kKvHeads, kHeadDim}, {kKvHeads, kHeadDim}, {kKvHeads, 0, -2.0f, 2.0f}};
  }
  long output_heads() const { return kQueryHeads; }
  void prefill(Memory& m, const Inputs& in, const tview& y, std::span<const long> lengths) const {
    m.prefill(in[0], in[1], in[2], rank3(in[3]), y, lengths);
  }
  void decode(Memory& m, const Inputs& in, const tview& y, std::span<const unsigned char> active) const {
    m.decode(in[0], in[1], in[2], rank3(in[3]), y, active);
  }
  void extend(Memory& m, const Inputs& in, const tview& y, std::span<const long> lengths) const {
    m.extend(typename Memory::inputs{in[0], in[1], in[2], rank3(in[3])}, y, lengths);
  }
  /// The counts and live rows (sums, read caches, radius, counts) of sequence b.
  std::vector<double> state(const Memory& m, long b) const {
    const auto c = m.cursor(b);
    std::vector<double> out{double(c.tokens), double(c.covered), double(c.rows), double(c.granted)};
    const auto& r = m.rows();
    auto add4 = [&](const auto& x) {
      const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, x);
      for (long k = 0; k < kKvHeads; ++k)
        for (long i = 0; i < c.rows; ++i)
          for (long d = 0; d < static_cast<long>(h.extent(3)); ++d) out.push_back(kvmem::to_float(h(b, k, i, d)));
    };
    auto add3 = [&](const auto& x) {
      const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, x);
      for (long k = 0; k < kKvHeads; ++k)
        for (long i = 0; i < c.rows; ++i) out.push_back(h(b, k, i));
    };
    add4(r.keys), add4(r.values), add4(r.read_keys), add4(r.read_values), add3(r.radius), add3(r.counts);
    if (r.stats.data() != nullptr) add3(r.stats);
    return out;
  }
};

/// A fixed-budget eviction memory (kvmem::EvictionMemory): q, k, v in; y [B, Hq, T, Dv].
template <class Memory, class Make>
struct EvictionFamily {
  Make make;
  static constexpr long piece_multiple() { return 1; }  // the per-token state machine: any piece
  std::vector<Spec> specs() const { return {{kQueryHeads, kHeadDim}, {kKvHeads, kHeadDim}, {kKvHeads, kHeadDim}}; }
  long output_heads() const { return kQueryHeads; }
  void prefill(Memory& m, const Inputs& in, const tview& y, std::span<const long> lengths) const {
    m.prefill(in[0], in[1], in[2], y, lengths);
  }
  void decode(Memory& m, const Inputs& in, const tview& y, std::span<const unsigned char> active) const {
    m.decode(in[0], in[1], in[2], y, active);
  }
  void extend(Memory& m, const Inputs& in, const tview& y, std::span<const long> lengths) const {
    m.extend(typename Memory::inputs{in[0], in[1], in[2]}, y, lengths);
  }
  /// The token count and, per kv-head, the cached rows of sequence b in position order (mem.kept()): each
  /// row's position, the scorer's statistic, its key and value, and, for a merging eviction, its count of
  /// tokens (a merged row's key and value are then its tokens' count-weighted means: the merged sums).
  std::vector<double> state(const Memory& m, long b) const {
    const long K = m.config().budget() + 1;
    Kokkos::View<long***, Kokkos::LayoutRight, mem> positions("positions", m.batch(), kKvHeads, K);
    Kokkos::View<long**, Kokkos::LayoutRight, mem> rows("rows", m.batch(), kKvHeads);
    m.kept(positions, rows);
    const auto p = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, positions);
    const auto r = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, rows);
    const auto& cache = m.cache();
    auto host = [](const auto& x) { return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, x); };
    // One declaration per view: their types differ, and a declarator list must deduce one type (nvcc holds to it).
    const auto order = host(cache.order);
    const auto slot_positions = host(cache.positions);
    const auto stats = host(cache.stats);
    const auto keys = host(cache.keys);
    const auto values = host(cache.values);
    const auto counts = host(cache.counts);
    std::vector<double> out{double(m.tokens(b))};
    for (long h = 0; h < kKvHeads; ++h) {
      out.push_back(double(r(b, h)));
      for (long i = 0; i < r(b, h); ++i) {
        const int slot = order(b, h, i);
        out.push_back(double(p(b, h, i)));
        out.push_back(double(slot_positions(b, h, slot)));  // the slot kept() named
        out.push_back(stats(b, h, slot));
        for (long d = 0; d < static_cast<long>(keys.extent(3)); ++d) out.push_back(kvmem::to_float(keys(b, h, slot, d)));
        for (long d = 0; d < static_cast<long>(values.extent(3)); ++d)
          out.push_back(kvmem::to_float(values(b, h, slot, d)));
        if (counts.size() > 0) out.push_back(counts(b, h, slot));
      }
    }
    return out;
  }
};

/// The Trellis slot memory: q, k, v, alpha, beta1, gamma1, beta2, gamma2 in; y [B, H, T, Dv]. Its prefill is
/// chunkwise from the call's first token, so a prompt in pieces gives one prefill's bits when every piece
/// but the last is a multiple of the chunk (trellis_memory.hpp).
struct TrellisFamily {
  static constexpr long piece_multiple() { return 4; }
  kvmem::TrellisConfig config() const {
    kvmem::TrellisConfig cfg{.slots = kSlots, .head_dim = kHeadDim, .value_dim = kHeadDim, .heads = kKvHeads};
    cfg.chunk = piece_multiple();
    return cfg;
  }
  kvmem::TrellisMemory<exec> make(int batch) const { return kvmem::TrellisMemory<exec>(config(), batch); }
  std::vector<Spec> specs() const {
    return {{kKvHeads, kHeadDim},        {kKvHeads, kHeadDim},         {kKvHeads, kHeadDim},
            {kKvHeads, kSlots},          {kKvHeads, 0, 0.9f, 1.0f},    {kKvHeads, 0, 0.0f, 0.1f},
            {kKvHeads, 0, 0.9f, 1.0f},   {kKvHeads, 0, 0.0f, 0.1f}};
  }
  long output_heads() const { return kKvHeads; }
  void prefill(kvmem::TrellisMemory<exec>& m, const Inputs& in, const tview& y, std::span<const long> lengths) const {
    m.prefill(in[0], in[1], in[2], in[3], rank3(in[4]), rank3(in[5]), rank3(in[6]), rank3(in[7]), y, lengths);
  }
  void decode(kvmem::TrellisMemory<exec>& m, const Inputs& in, const tview& y,
              std::span<const unsigned char> active) const {
    m.decode(in[0], in[1], in[2], in[3], rank3(in[4]), rank3(in[5]), rank3(in[6]), rank3(in[7]), y, active);
  }
  void extend(kvmem::TrellisMemory<exec>& m, const Inputs& in, const tview& y, std::span<const long> lengths) const {
    m.extend({in[0], in[1], in[2], in[3], rank3(in[4]), rank3(in[5]), rank3(in[6]), rank3(in[7])}, y, lengths);
  }
  std::vector<double> state(const kvmem::TrellisMemory<exec>& m, long b) const {
    std::vector<double> out{double(m.tokens(b))};
    for (const auto* x : {&m.m1(), &m.m2()}) {
      const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, *x);
      for (long k = 0; k < static_cast<long>(h.extent(1)); ++k)
        for (long i = 0; i < static_cast<long>(h.extent(2)); ++i)
          for (long d = 0; d < static_cast<long>(h.extent(3)); ++d) out.push_back(h(b, k, i, d));
    }
    return out;
  }
};

// ---- the schedule ----

struct Request {
  long prompt, output;
  Inputs in;  // [1, heads, prompt + output, channels]
  view4 y;    // [1, output heads, prompt + output, Dv]: what the served run wrote
  std::vector<double> state;
};

/// Elements that differ in bits between two vectors of equal size (sizes differing: all of them).
long differing(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return static_cast<long>(std::max(a.size(), b.size()));
  long n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += same_bits(a[i], b[i]) ? 0 : 1;
  return n;
}

/// Serves `requests` random requests through a memory of `slots` slots under a random schedule (seed),
/// then runs each alone (one prefill of its prompt, then decode) and requires the same bits.
template <class Family>
void require_served_like_alone(const Family& family, unsigned seed, long slots = 4, long requests = 9) {
  std::mt19937 rng(seed);
  auto uniform = [&](long lo, long hi) { return std::uniform_int_distribution<long>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  const auto specs = family.specs();
  std::vector<Request> reqs(static_cast<std::size_t>(requests));
  for (long r = 0; r < requests; ++r) {
    auto& q = reqs[r];
    q.prompt = uniform(1, 90), q.output = uniform(1, 40);
    q.in = random_inputs(specs, q.prompt + q.output, 1000 * seed + 16 * r);
    q.y = view4("y", 1, family.output_heads(), q.prompt + q.output, kHeadDim);
  }
  // The served run. A slot holds a request (-1: free) and how many of its tokens the memory has seen.
  auto memory = family.make(static_cast<int>(slots));
  std::vector<long> holds(slots, -1), seen(slots, 0);
  long next = 0, finished = 0, prefills = 0, chunked = 0, reused = 0;
  std::vector<bool> used(slots, false);
  while (finished < requests) {
    for (long s = 0; s < slots && next < requests; ++s)
      if (holds[s] < 0 && coin(0.6)) {
        reused += used[s] ? 1 : 0;
        holds[s] = next++, seen[s] = 0, used[s] = true;
      }
    std::vector<long> piece(slots, 0);
    bool prefilling = false;
    for (long s = 0; s < slots; ++s)
      if (holds[s] >= 0 && seen[s] < reqs[holds[s]].prompt && coin(0.7)) {
        const long left = reqs[holds[s]].prompt - seen[s], m = Family::piece_multiple();
        piece[s] = left > m && coin(0.5) ? m * uniform(1, (left - 1) / m) : left;  // a chunk, or the rest
        chunked += piece[s] < left ? 1 : 0;
        prefilling = true;
      }
    if (prefilling) {  // a prefill step of the slots that take a piece; the others keep their state
      const long T = *std::max_element(piece.begin(), piece.end());
      auto in = allocate(specs, slots, T);
      view4 y("y", slots, family.output_heads(), T, kHeadDim);
      for (long s = 0; s < slots; ++s)
        for (std::size_t i = 0; i < in.size() && piece[s] > 0; ++i)
          copy_tokens(reqs[holds[s]].in[i], 0, seen[s], in[i], s, 0, piece[s]);
      family.prefill(memory, in, y, piece);
      for (long s = 0; s < slots; ++s)
        if (piece[s] > 0) copy_tokens(y, s, 0, reqs[holds[s]].y, 0, seen[s], piece[s]), seen[s] += piece[s];
      ++prefills;
      continue;
    }
    // A decode step of every slot past its prompt.
    std::vector<unsigned char> active(slots, 0);
    auto in = allocate(specs, slots, 1);
    view4 y("y", slots, family.output_heads(), 1, kHeadDim);
    bool any = false;
    for (long s = 0; s < slots; ++s)
      if (holds[s] >= 0 && seen[s] >= reqs[holds[s]].prompt) {
        active[s] = 1, any = true;
        for (std::size_t i = 0; i < in.size(); ++i) copy_tokens(reqs[holds[s]].in[i], 0, seen[s], in[i], s, 0, 1);
      }
    if (!any) continue;
    family.decode(memory, in, y, active);
    for (long s = 0; s < slots; ++s) {
      if (!active[s]) continue;
      auto& q = reqs[holds[s]];
      copy_tokens(y, s, 0, q.y, 0, seen[s]++, 1);
      if (seen[s] == q.prompt + q.output) {  // the request leaves: its state, then its slot is freed
        q.state = family.state(memory, s);
        memory.reset_sequence(s);
        holds[s] = -1, ++finished;
      }
    }
  }
  INFO("seed " << seed << ": " << prefills << " prefill steps, " << chunked << " chunks short of a prompt, " << reused
               << " slots reused");
  REQUIRE(chunked > 0);
  REQUIRE(reused > 0);
  // Each request alone.
  for (long r = 0; r < requests; ++r) {
    const auto& q = reqs[r];
    auto alone = family.make(1);
    view4 y("y_alone", 1, family.output_heads(), q.prompt + q.output, kHeadDim);
    auto slice = [&](long first, long n) {
      Inputs in;
      for (const auto& x : q.in) in.push_back(tokens_of(x, first, n));
      return in;
    };
    const std::vector<long> whole{q.prompt};
    family.prefill(alone, slice(0, q.prompt), tokens_of(y, 0, q.prompt), whole);
    const std::vector<unsigned char> on{1};
    for (long t = q.prompt; t < q.prompt + q.output; ++t) family.decode(alone, slice(t, 1), tokens_of(y, t, 1), on);
    INFO("request " << r << ": prompt " << q.prompt << ", output " << q.output);
    REQUIRE(differing_outputs(q.y, y, 0, q.prompt + q.output) == 0);
    REQUIRE(differing(q.state, family.state(alone, 0)) == 0);
  }
}

}  // namespace

// ---- the memories ----

namespace {

/// Elements of sequence 0's outputs y [:, :, 0, n) -- a prompt of n tokens that a memory of `family` took in
/// pieces, from inputs `in` -- whose bits differ from a batch-of-one memory's outputs for one prefill of the
/// whole prompt (docs/design.md, "Requests that come and go": a chunked prefill has one prefill's bits).
template <class Family>
long differing_from_one_prefill(const Family& family, const Inputs& in, const tview& y, long n) {
  auto alone = family.make(1);
  Inputs prompt;
  for (const auto& x : in) prompt.push_back(span_of(x, 0, 0, n));
  const view4 whole("y_whole", 1, family.output_heads(), n, kHeadDim), pieces("y_pieces", 1, family.output_heads(), n, kHeadDim);
  const std::vector<long> all{n};
  family.prefill(alone, prompt, whole, all);
  copy_tokens(y, 0, 0, pieces, 0, 0, n);
  return differing_outputs(pieces, whole, 0, n);
}

/// The strict slot protocol on a memory of two slots: with slot 0 holding a prompt and slot 1 free, a
/// prefill into slot 0, an extend of slot 1 and a decode step of slot 1 are each refused, naming the
/// sequence and its state, and leave both sequences' state bit for bit; then the calls that fit go through
/// (extend slot 0, whose prompt in two pieces gives one prefill's outputs, prefill slot 1, decode both; a
/// freed slot takes a prefill again).
template <class Family>
void require_strict_slots(const Family& family, unsigned seed) {
  const long P = 2 * family.piece_multiple(), C = family.piece_multiple(), T = P + C + 1;
  auto m = family.make(2);
  REQUIRE_FALSE(m.strict_slots());
  m.set_strict_slots(true);
  REQUIRE(m.strict_slots());
  Inputs in;
  for (const auto& s : family.specs())
    in.push_back(random4("in", 2, s.heads, T, std::max(s.channels, 1L), seed++, s.lo, s.hi));
  const tview y = view4("y", 2, family.output_heads(), T, kHeadDim);
  auto at = [&](long first, long n) {
    Inputs out;
    for (const auto& x : in) out.push_back(tokens_of(x, first, n));
    return out;
  };
  const std::vector<long> start_0{P, 0}, more_0{C, 0}, both{C, C}, start_1{0, P};
  const std::vector<unsigned char> step_both{1, 1};
  family.prefill(m, at(0, P), tokens_of(y, 0, P), start_0);
  const auto s0 = family.state(m, 0), s1 = family.state(m, 1);
  REQUIRE_THROWS_WITH(family.prefill(m, at(P, C), tokens_of(y, P, C), more_0),
                      ContainsSubstring("prefill: sequence 0 = busy (holds " + std::to_string(P) + " tokens)") &&
                          ContainsSubstring("extend()"));
  REQUIRE_THROWS_WITH(family.extend(m, at(P, C), tokens_of(y, P, C), both),
                      ContainsSubstring("extend: sequence 1 = empty (holds no token)"));
  REQUIRE_THROWS_WITH(family.decode(m, at(P, 1), tokens_of(y, P, 1), step_both),
                      ContainsSubstring("decode: sequence 1 = empty (holds no token)"));
  REQUIRE(differing(family.state(m, 0), s0) == 0);
  REQUIRE(differing(family.state(m, 1), s1) == 0);
  family.extend(m, at(P, C), tokens_of(y, P, C), more_0);
  REQUIRE(differing_from_one_prefill(family, in, y, P + C) == 0);
  // The test of the comparison: one output of the extend changed is one element that differs.
  Kokkos::deep_copy(Kokkos::subview(y, 0, 0, P + C - 1, 0), 7.0f);
  REQUIRE(differing_from_one_prefill(family, in, y, P + C) == 1);
  family.prefill(m, at(0, P), tokens_of(y, 0, P), start_1);
  family.decode(m, at(P + C, 1), tokens_of(y, P + C, 1), step_both);
  REQUIRE(m.tokens(0) == P + C + 1);
  REQUIRE(m.tokens(1) == P + 1);
  m.reset_sequence(0);
  family.prefill(m, at(0, P), tokens_of(y, 0, P), start_0);  // a freed slot takes a new request
  REQUIRE(m.tokens(0) == P);
}

template <class Memory, class Make>
MergingFamily<Memory, Make> merging(Make make) {
  return {make};
}
template <class Memory, class Make>
EvictionFamily<Memory, Make> evicting(Make make) {
  return {make};
}

kvmem::EvictionConfig eviction_config(bool merge) {
  kvmem::EvictionConfig c{.head_dim = kHeadDim, .value_dim = kHeadDim, .query_heads = kQueryHeads, .kv_heads = kKvHeads,
                          .sinks = 2, .window = 8, .top_k = 12};
  c.merge_evicted = merge;
  return c;
}

/// Small configs so that 90-token prompts fold, grow and evict: chunk 4.
kvmem::MemoryConfig small_config(int window_chunks, int sinks) {
  auto c = memory_config(window_chunks, sinks);
  c.chunk = 4;
  return c;
}

}  // namespace

TEST_CASE("every merging memory serves requests that come and go as each alone", "[lifecycle][kvm]") {
  const auto w = unit_weights();
  SECTION("KVM, power-law budget") {
    using M = kvmem::KvmMemory<exec, kvmem::budget::PowerLaw>;
    const auto family = merging<M>([&](int B) { return M(small_config(2, 1), {.min_rows = 4, .growth_factor = 2.0}, w, B); });
    for (unsigned seed : {1u, 2u}) require_served_like_alone(family, seed);
  }
  SECTION("OVQ, plateau budget") {
    using M = kvmem::OvqMemory<exec>;
    const auto family = merging<M>([&](int B) { return M(small_config(1, 0), {.n = 12.0}, w, B); });
    for (unsigned seed : {3u, 4u}) require_served_like_alone(family, seed);
  }
  SECTION("proportional merge, fixed budget") {
    using M = kvmem::ProportionalMemory<exec, kvmem::budget::Fixed>;
    const auto family = merging<M>([&](int B) { return M(small_config(2, 1), {.min_rows = 12}, w, B); });
    require_served_like_alone(family, 5);
  }
  SECTION("KVM with H2O over rows") {
    using M = KvmRowEviction;
    const auto family = merging<M>([&](int B) {
      return M(small_config(2, 1), {.min_rows = 4, .growth_factor = 2.0}, w, B,
               kvmem::score::RowAccumulatedAttention{.max_rows = 10});
    });
    require_served_like_alone(family, 6);
  }
}

TEST_CASE("every eviction memory serves requests that come and go as each alone", "[lifecycle][eviction]") {
  SECTION("StreamingLLM") {
    using M = kvmem::EvictionMemory<exec, kvmem::score::None>;
    require_served_like_alone(evicting<M>([](int B) { return M(eviction_config(false), B); }), 7);
  }
  SECTION("H2O, merging where it evicts") {
    using M = kvmem::EvictionMemory<exec, kvmem::score::AccumulatedAttention>;
    require_served_like_alone(evicting<M>([](int B) { return M(eviction_config(true), B); }), 8);
  }
  SECTION("KVPOP (the mLSTM scorer's state is per sequence)") {
    using M = kvmem::EvictionMemory<exec, kvmem::score::MLstm<mem>>;
    const auto weights = random_mlstm_weights();
    require_served_like_alone(
        evicting<M>([&](int B) { return M(eviction_config(false), B, kvmem::score::MLstm<mem>(weights)); }), 9);
  }
}

TEST_CASE("an eviction memory's compared state holds the merged rows' counts, keys and values",
          "[lifecycle][eviction][harness]") {
  // The test of EvictionFamily::state, which the tests above compare: a merged row's count, or one element of
  // its key or value, changed alone is one element of the state that differs.
  using M = kvmem::EvictionMemory<exec, kvmem::score::AccumulatedAttention>;
  const auto family = evicting<M>([](int B) { return M(eviction_config(true), B); });
  auto m = family.make(1);
  const long T = 40;  // past the budget of 22 rows: evicted rows merge
  Inputs in;
  for (const auto& spec : family.specs())
    in.push_back(random4("in", 1, spec.heads, T, std::max(spec.channels, 1L), 30 + in.size(), spec.lo, spec.hi));
  const tview y = view4("y", 1, family.output_heads(), T, kHeadDim);
  const std::vector<long> all{T};
  family.prefill(m, in, y, all);
  const auto before = family.state(m, 0);
  const auto& cache = m.cache();
  const auto counts = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, cache.counts);
  const auto order = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, cache.order);
  int merged = -1;  // the slot of kv-head 0's first merged row
  for (long i = 0; i < m.config().budget() && merged < 0; ++i)
    if (counts(0, 0, order(0, 0, i)) > 1.0f) merged = order(0, 0, i);
  REQUIRE(merged >= 0);
  // Adds 1 to element `at...` of the cache view x, returns how many elements of the state differ, undoes it.
  auto differing_after_change = [&](const auto& x, auto... at) {
    const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, x);
    const auto old = h(at...);
    h(at...) = old + 1;
    Kokkos::deep_copy(x, h);
    const long n = differing(family.state(m, 0), before);
    h(at...) = old;
    Kokkos::deep_copy(x, h);
    return n;
  };
  CHECK(differing_after_change(cache.counts, 0, 0, merged) == 1);
  CHECK(differing_after_change(cache.keys, 0, 0, merged, 3) == 1);
  CHECK(differing_after_change(cache.values, 0, 0, merged, 5) == 1);
  CHECK(differing(family.state(m, 0), before) == 0);
}

TEST_CASE("Trellis serves requests that come and go as each alone", "[lifecycle][trellis]") {
  for (unsigned seed : {10u, 11u}) require_served_like_alone(TrellisFamily{}, seed);
}

TEST_CASE("reset_sequence refuses a slot out of range or still advanced by decode_async, changing nothing",
          "[lifecycle][errors]") {
  const auto w = unit_weights();
  const Stream s;
  auto memory = kvm_power_law(w);
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
  for (long b : {-1L, long{kBatch}})
    REQUIRE_THROWS_WITH(memory.reset_sequence(b),
                        ContainsSubstring("reset_sequence: b = " + std::to_string(b)) && ContainsSubstring("[0, batch = 2)"));
  memory.plan_on_device();  // the device counts steps on its own, as on a GPU
  memory.reserve(kPrompt + 8);
  memory.decode_async(tokens(s.q, kPrompt, 1), tokens(s.k, kPrompt, 1), tokens(s.v, kPrompt, 1),
                      gates(s.gate, kPrompt, 1), tokens(s.y, kPrompt, 1));
  REQUIRE_THROWS_WITH(memory.reset_sequence(1), ContainsSubstring("reset_sequence: sequence 1") &&
                                                    ContainsSubstring("set_active() without it"));
  memory.sync();
  REQUIRE(memory.cursor(1).tokens == kPrompt + 1);  // unchanged by the refusal
  const std::vector<unsigned char> only_first{1, 0};
  memory.set_active(only_first);
  memory.reset_sequence(1);
  REQUIRE(memory.cursor(1).tokens == 0);
  REQUIRE(memory.cursor(0).tokens == kPrompt + 1);

  using Evict = kvmem::EvictionMemory<exec, kvmem::score::KeyNorm>;
  Evict evict(eviction_config(false), kBatch);
  REQUIRE_THROWS_WITH(evict.reset_sequence(kBatch), ContainsSubstring("reset_sequence: b = 2"));
  kvmem::TrellisMemory<exec> trellis(TrellisFamily{}.config(), kBatch);
  REQUIRE_THROWS_WITH(trellis.reset_sequence(-1), ContainsSubstring("reset_sequence: b = -1"));
}

TEST_CASE("the strict slot protocol refuses a prefill into a busy slot, a chunk or a step of an empty one",
          "[lifecycle][errors]") {
  const auto w = unit_weights();
  SECTION("KVM") {
    using M = kvmem::KvmMemory<exec, kvmem::budget::PowerLaw>;
    require_strict_slots(merging<M>([&](int B) { return M(small_config(2, 1), {.min_rows = 4, .growth_factor = 2.0}, w, B); }), 20);
  }
  SECTION("OVQ") {
    using M = kvmem::OvqMemory<exec>;
    require_strict_slots(merging<M>([&](int B) { return M(small_config(1, 0), {.n = 12.0}, w, B); }), 21);
  }
  SECTION("H2O, merging where it evicts") {
    using M = kvmem::EvictionMemory<exec, kvmem::score::AccumulatedAttention>;
    require_strict_slots(evicting<M>([](int B) { return M(eviction_config(true), B); }), 22);
  }
  SECTION("Trellis") { require_strict_slots(TrellisFamily{}, 23); }
}
