// Launch-only decoding (decode_async) and the decode plan the device works out for it:
//  - kernels::plan_decode (the kernel a GPU runs every step) against the host's plan_decode_token, step by
//    step, for every kind of merge policy, with sequences going inactive and back, and its refusals;
//  - decode_async against decode() for every memory: the same outputs, bit for bit, and the same counts,
//    while the active set changes (set_active);
//  - a step past reserve()'s horizon is refused and reported by sync() (where the device plans: a GPU).
// Both run twice: as the backend plans, and as a GPU plans (plan_on_device(): the device's own counts, the
// planning kernel with fixed launch bounds, sync() reading back), so a CPU machine runs the GPU's path of
// decode_async; what it cannot check is CUDA itself and the copies of views that a host backend still
// shares with their mirrors (the step plan, the fold table, the refusal record; docs/cuda.md).
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <array>
#include <limits>
#include <string>
#include <vector>

#include "decode_stream.hpp"

namespace {

using namespace kvmem_test;
using kvmem::state::SequenceCursor;
using Catch::Matchers::ContainsSubstring;

// ---- the plan ----

/// Which sequences take a token at decode step t: sequence 1 pauses every third step, sequence 2 for a
/// stretch that spans folds.
std::array<unsigned char, 3> active_at(long t) {
  return {1, static_cast<unsigned char>(t % 3 != 1), static_cast<unsigned char>(t < 70 || t >= 150)};
}

bool same(const SequenceCursor& a, const SequenceCursor& b) {
  return a.tokens == b.tokens && a.covered == b.covered && a.rows == b.rows && a.granted == b.granted;
}

/// Plans `steps` decode steps of 3 sequences from empty cursors twice, on the host with plan_decode_token
/// and with the kernel plan_decode over device views, and requires the same plan rows and cursors after
/// every step.
template <class Budget>
void require_device_plan(const kvmem::MemoryConfig& cfg, const Budget& budget, const kvmem::kernels::DecodeShape& shape,
                         long steps) {
  constexpr long B = 3;
  kvmem::kernels::FoldTable<mem> table;
  table.cover(exec(), cfg, budget, shape.verbatim, steps / cfg.chunk + 2);
  Kokkos::View<SequenceCursor*, mem> cursors("cursors", B);
  Kokkos::View<long*, mem> active("active", B);
  Kokkos::View<long**, Kokkos::LayoutRight, mem> plan("plan", B, kvmem::kernels::plan_fields);
  Kokkos::View<long[2], mem> error("error");
  auto cursors_h = Kokkos::create_mirror_view(cursors);
  auto active_h = Kokkos::create_mirror_view(active);
  std::vector<SequenceCursor> host(B);
  Kokkos::View<long**, Kokkos::LayoutRight, Kokkos::HostSpace> rows("rows", B, kvmem::kernels::plan_fields);
  long folds = 0, refusals = 0;
  for (long t = 0; t < steps; ++t) {
    const auto on = active_at(t);
    for (long b = 0; b < B; ++b) active_h(b) = on[b];
    Kokkos::deep_copy(active, active_h);
    kvmem::kernels::plan_decode(exec(), shape, cursors, table.device, table.folds, std::numeric_limits<long>::max(),
                                std::numeric_limits<long>::max(), active, plan, error);
    const auto plan_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, plan);
    Kokkos::deep_copy(cursors_h, cursors);
    for (long b = 0; b < B; ++b) {
      for (int f = 0; f < kvmem::kernels::plan_fields; ++f) rows(b, f) = 0;
      if (on[b]) {
        const long block = kvmem::kernels::plan_decode_token(shape, host[b], table.host, table.folds,
                                                             kvmem::kernels::PlanRow<decltype(rows)>{rows, b});
        REQUIRE(block >= 0);
        folds += block == cfg.chunk ? 1 : 0;
      }
      for (int f = 0; f < kvmem::kernels::plan_fields; ++f) {
        INFO("step " << t << ", sequence " << b << ", field " << f);
        REQUIRE(plan_h(b, f) == rows(b, f));
      }
      REQUIRE(same(cursors_h(b), host[b]));
    }
    refusals += Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, error)(0);
  }
  REQUIRE(refusals == 0);
  REQUIRE(folds >= steps / cfg.chunk);  // the stream really folds (three sequences, some paused)
}

// ---- memories ----

/// Which of kBatch = 2 sequences take decode step t: sequence 1 pauses for a stretch that spans a fold.
std::array<unsigned char, kBatch> batch_active_at(long t) { return {1, static_cast<unsigned char>(t < 200 || t >= 260)}; }

/// Runs `steps` decode steps of two equal memories, one through decode(active) and one through set_active()
/// (when the set changes) and decode_async(), and requires the same y and, after sync(), the same
/// `counts`(memory, b) for every sequence.
/// With `on_device` the decode_async memory plans and counts as a GPU does (plan_on_device()), on any
/// backend; the decode() memory plans on the host where the backend does.
template <class Make, class Step, class Async, class Counts>
void require_async_matches(const Make& make, long prompt, long last, const view4& y_sync, const view4& y_async,
                           const Step& step, const Async& async_step, const Counts& counts, bool on_device) {
  auto sync = make(y_sync), async = make(y_async);
  if (on_device) async.plan_on_device();
  std::array<unsigned char, kBatch> was{1, 1};
  for (long t = prompt; t < last; ++t) {
    const auto on = batch_active_at(t);
    step(sync, t, std::span<const unsigned char>(on));
    if (on != was) async.set_active(std::span<const unsigned char>(on));
    was = on;
    async_step(async, t);
  }
  exec().fence();
  async.sync();
  REQUIRE(differing_outputs(y_sync, y_async, prompt, last) == 0);
  for (long b = 0; b < kBatch; ++b) REQUIRE(counts(sync, b) == counts(async, b));
}

/// The token count of sequence b (an eviction or Trellis memory).
constexpr auto token_count = [](const auto& memory, long b) { return memory.tokens(b); };

/// `construct`(weights) builds the memory (decode_stream.hpp: kvm_power_law, ovq_plateau, kvm_row_eviction).
template <class Construct>
void require_memory_async(const Construct& construct, bool on_device) {
  using Memory = decltype(construct(unit_weights()));
  const Stream s;
  const auto w = unit_weights();
  view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
  auto make = [&](const view4& y) {
    Memory m = construct(w);
    m.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
              tokens(y, 0, kPrompt));
    m.reserve(s.T);
    return m;
  };
  std::array<SequenceCursor, kBatch> want{};
  require_async_matches(
      make, kPrompt, s.T, s.y, y2,
      [&](Memory& m, long t, std::span<const unsigned char> on) {
        m.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1), on);
        for (long b = 0; b < kBatch; ++b) want[b] = m.cursor(b);
      },
      [&](Memory& m, long t) {
        m.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(y2, t, 1));
      },
      [](const Memory& m, long b) {
        const SequenceCursor& c = m.cursor(b);
        return std::array<long, 4>{c.tokens, c.covered, c.rows, c.granted};
      },
      on_device);
  REQUIRE(want[1].tokens < want[0].tokens);  // the pause happened
  REQUIRE(want[0].covered > kPrompt + 8 * kChunk);
}

template <class Scorer>
void require_eviction_async(const Scorer& scorer, bool on_device) {
  const Stream s;
  const kvmem::EvictionConfig cfg{.head_dim = kHeadDim, .value_dim = kHeadDim, .query_heads = kQueryHeads,
                                  .kv_heads = kKvHeads, .sinks = 2, .window = 16, .top_k = 24};
  using Memory = kvmem::EvictionMemory<exec, Scorer>;
  view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
  auto make = [&](const view4& y) {
    Memory m(cfg, kBatch, scorer);
    m.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(y, 0, kPrompt));
    return m;
  };
  require_async_matches(
      make, kPrompt, s.T, s.y, y2,
      [&](Memory& m, long t, std::span<const unsigned char> on) {
        m.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.y, t, 1), on);
      },
      [&](Memory& m, long t) { m.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(y2, t, 1)); },
      token_count, on_device);
}

void require_trellis_async(bool on_device) {
  const TrellisStream s;
  kvmem::TrellisConfig cfg{.slots = kSlots, .head_dim = kHeadDim, .value_dim = kHeadDim, .heads = kKvHeads};
  cfg.chunk = kChunk;
  cfg.check_gates = false;
  using Memory = kvmem::TrellisMemory<exec>;
  view4 y2("y2", kBatch, kKvHeads, s.T, kHeadDim);
  auto make = [&](const view4& y) {
    Memory m(cfg, kBatch);
    m.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.alpha, 0, kPrompt),
              gates(s.beta1, 0, kPrompt), gates(s.gamma1, 0, kPrompt), gates(s.beta2, 0, kPrompt),
              gates(s.gamma2, 0, kPrompt), tokens(y, 0, kPrompt));
    return m;
  };
  auto in = [&](long t) {
    return std::make_tuple(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.alpha, t, 1),
                           gates(s.beta1, t, 1), gates(s.gamma1, t, 1), gates(s.beta2, t, 1), gates(s.gamma2, t, 1));
  };
  {  // the gate check reads the device: decode_async refuses it, before launching anything
    kvmem::TrellisConfig checked = cfg;
    checked.check_gates = true;
    Memory m(checked, kBatch);
    REQUIRE_THROWS_AS(std::apply([&](const auto&... x) { m.decode_async(x..., tokens(y2, kPrompt, 1)); }, in(kPrompt)),
                      kvmem::invalid_argument);
    REQUIRE(m.tokens(0) == 0);
  }
  require_async_matches(
      make, kPrompt, s.T, s.y, y2,
      [&](Memory& m, long t, std::span<const unsigned char> on) {
        std::apply([&](const auto&... x) { m.decode(x..., tokens(s.y, t, 1), on); }, in(t));
      },
      [&](Memory& m, long t) { std::apply([&](const auto&... x) { m.decode_async(x..., tokens(y2, t, 1)); }, in(t)); },
      token_count, on_device);
}

/// A memory planned on the host (as a CPU backend plans) and one that plans as a GPU does from before its
/// prefill (plan_on_device()), fed the same stream through prefill, decode() and decode_async mixed, then
/// reset() and a second prompt decoded with decode(): the same y bit for bit and the same counts in each
/// phase. `step`(memory, t, async, y) runs token t; `counts`(memory, b) names a sequence's counts.
template <class Make, class Prefill, class Step, class Counts>
void require_device_planning_matches(const Make& make, const Prefill& prefill, const Step& step, const Counts& counts,
                                     long T, const view4& y_host, const view4& y_device) {
  auto host = make();
  auto device = make();
  device.plan_on_device();
  auto phase = [&](long prompt, long last, bool mix) {
    prefill(host, prompt, y_host);
    prefill(device, prompt, y_device);
    for (long t = prompt; t < last; ++t) {
      step(host, t, false, y_host);
      step(device, t, mix && t % 3 != 0, y_device);  // two steps of three launch-only
    }
    exec().fence();
    device.sync();
    REQUIRE(differing_outputs(y_host, y_device, 0, last) == 0);
    for (long b = 0; b < kBatch; ++b) REQUIRE(counts(host, b) == counts(device, b));
  };
  phase(kPrompt, T, true);
  host.reset();
  device.reset();
  phase(kPrompt / 2, kPrompt + 3 * kChunk, false);
}

}  // namespace

TEST_CASE("plan_on_device: prefill, decode(), decode_async and reset() give the host-planned memory's bits",
          "[decode-async]") {
  const auto w = unit_weights();
  SECTION("KVM, power-law budget") {
    const Stream s;
    view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
    using Memory = decltype(kvm_power_law(w));
    require_device_planning_matches(
        [&] { return kvm_power_law(w); },
        [&](Memory& m, long n, const view4& y) {
          m.prefill(tokens(s.q, 0, n), tokens(s.k, 0, n), tokens(s.v, 0, n), gates(s.gate, 0, n), tokens(y, 0, n));
          m.reserve(s.T);
        },
        [&](Memory& m, long t, bool async, const view4& y) {
          if (async)
            m.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(y, t, 1));
          else
            m.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(y, t, 1));
        },
        [](const Memory& m, long b) {
          const SequenceCursor& c = m.cursor(b);
          return std::array<long, 4>{c.tokens, c.covered, c.rows, c.granted};
        },
        s.T, s.y, y2);
  }
  SECTION("eviction, TOVA") {
    const Stream s;
    view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
    const kvmem::EvictionConfig cfg{.head_dim = kHeadDim, .value_dim = kHeadDim, .query_heads = kQueryHeads,
                                    .kv_heads = kKvHeads, .sinks = 2, .window = 16, .top_k = 24};
    using Memory = kvmem::EvictionMemory<exec, kvmem::score::LastQueryAttention>;
    require_device_planning_matches(
        [&] { return Memory(cfg, kBatch, kvmem::score::LastQueryAttention{}); },
        [&](Memory& m, long n, const view4& y) {
          m.prefill(tokens(s.q, 0, n), tokens(s.k, 0, n), tokens(s.v, 0, n), tokens(y, 0, n));
        },
        [&](Memory& m, long t, bool async, const view4& y) {
          if (async)
            m.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(y, t, 1));
          else
            m.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(y, t, 1));
        },
        token_count, s.T, s.y, y2);
  }
}

TEST_CASE("decode plan: the device's plan_decode gives the host's plan and cursors, step by step", "[decode-async]") {
  kvmem::MemoryConfig cfg = memory_config(2, 1);
  SECTION("KVM: a verbatim first chunk, lazy folds") {
    require_device_plan(cfg, kGrowing, kvmem::kernels::DecodeShape::of<kvmem::merge::WinnerTakeAll>(cfg, -1), 600);
  }
  SECTION("KVM with row eviction: rows capped at 40") {
    require_device_plan(cfg, kGrowing, kvmem::kernels::DecodeShape::of<kvmem::merge::WinnerTakeAll>(cfg, 40), 600);
  }
  SECTION("OVQ: eager folds from an empty state, one window chunk") {
    cfg = memory_config(1, 0);
    require_device_plan(cfg, kvmem::budget::Plateau{.n = 48.0}, kvmem::kernels::DecodeShape::of<kvmem::merge::KMeansCount>(cfg, -1),
                        600);
  }
}

TEST_CASE("decode plan: a step past the horizon, the fold table or the capacity is refused, and says so",
          "[decode-async]") {
  const kvmem::MemoryConfig cfg = memory_config(2, 1);
  const auto shape = kvmem::kernels::DecodeShape::of<kvmem::merge::WinnerTakeAll>(cfg, -1);
  kvmem::kernels::FoldTable<mem> table;
  table.cover(exec(), cfg, kvmem::budget::Fixed{.min_rows = 64}, true, 1);
  Kokkos::View<SequenceCursor*, mem> cursors("cursors", 1);
  Kokkos::View<long*, mem> active("active", 1);
  Kokkos::View<long**, Kokkos::LayoutRight, mem> plan("plan", 1, kvmem::kernels::plan_fields);
  Kokkos::View<long[2], mem> error("error");
  Kokkos::deep_copy(active, 1L);
  auto run = [&](long steps, long capacity, long horizon) {
    for (long t = 0; t < steps; ++t)
      kvmem::kernels::plan_decode(exec(), shape, cursors, table.device, table.folds, capacity, horizon, active, plan, error);
    const auto e = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, error);
    const auto c = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, cursors);
    const auto p = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, plan);
    long row = 0;
    for (int f = 0; f < kvmem::kernels::plan_fields; ++f) row += p(0, f) != 0 ? 1 : 0;
    return std::make_tuple(e(0), e(1), c(0), row);
  };
  SECTION("the horizon") {
    const auto [refusal, position, cursor, row] = run(100, 1 << 20, 90);
    REQUIRE(refusal == kvmem::kernels::past_horizon);
    REQUIRE(position == 91);
    REQUIRE(cursor.tokens == 90);  // tokens 0..89 were planned, the rest kept the cursor
    REQUIRE(row == 0);             // and wrote no work
  }
  SECTION("the capacity") {
    // KVM's first chunk becomes rows verbatim (16), the first fold appends up to the budget: more than 20.
    const auto [refusal, position, cursor, row] = run(200, 20, std::numeric_limits<long>::max());
    REQUIRE(refusal == kvmem::kernels::past_table);
    REQUIRE(cursor.rows <= 20);
    REQUIRE(position == cursor.tokens + 1);
    REQUIRE(row == 0);
  }
  SECTION("the fold table") {
    const long steps = (table.folds + cfg.window_chunks + 2) * cfg.chunk;
    const auto [refusal, position, cursor, row] = run(steps, 1 << 20, std::numeric_limits<long>::max());
    REQUIRE(refusal == kvmem::kernels::past_table);
    REQUIRE(cursor.covered == table.folds * cfg.chunk);
    REQUIRE(row == 0);
  }
}

TEST_CASE("decode_async gives decode()'s outputs bit for bit while the active set changes", "[decode-async]") {
  // Each memory twice: as the backend plans (the host, on a CPU), and as a GPU plans (plan_on_device(): the
  // device's own counts, the planning kernel, fixed launch bounds, counts read back by sync()).
  const bool on_device = GENERATE(false, true);
  INFO((on_device ? "planned as on a GPU (plan_on_device)" : "planned as the backend plans"));
  SECTION("KVM, power-law budget") { require_memory_async(kvm_power_law, on_device); }
  SECTION("OVQ, plateau budget") { require_memory_async(ovq_plateau, on_device); }
  SECTION("KVM with H2O row eviction") { require_memory_async(kvm_row_eviction, on_device); }
  SECTION("eviction, TOVA") { require_eviction_async(kvmem::score::LastQueryAttention{}, on_device); }
  SECTION("eviction, KVPOP") { require_eviction_async(kvmem::score::MLstm<mem>(random_mlstm_weights()), on_device); }
  SECTION("Trellis") { require_trellis_async(on_device); }
}

TEST_CASE("decode_async: a step past reserve() is refused on the device and reported by sync()", "[decode-async]") {
  const Stream s;
  kvmem::KvmMemory<exec, kvmem::budget::Fixed> memory(memory_config(2, 1), {.min_rows = 32}, unit_weights(), kBatch);
  const bool on_device = GENERATE(false, true);  // plan_on_device(): as a GPU plans, on any backend
  if (on_device) memory.plan_on_device();
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
  REQUIRE_THROWS_AS(memory.reserve(0), kvmem::invalid_argument);
  memory.reserve(kPrompt + 10);
  for (long t = kPrompt; t < kPrompt + 20; ++t)
    memory.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1));
  if (device_plans || on_device) {
    // The device refused tokens 10..19 of each sequence: sync() says so, and the counts stop at the horizon.
    REQUIRE_THROWS_AS(memory.cursor(0), kvmem::invalid_argument);
    const std::string horizon = std::to_string(kPrompt + 10);
    REQUIRE_THROWS_WITH(memory.sync(), ContainsSubstring("decode_async position = " + horizon) &&
                                           ContainsSubstring("passed reserve(tokens = " + horizon + ")"));
    REQUIRE(memory.cursor(0).tokens == kPrompt + 10);
    REQUIRE(memory.cursor(1).tokens == kPrompt + 10);
    // The refusal is reported once; the memory goes on from the horizon after reserving further.
    memory.sync();
    memory.reserve(kPrompt + 20);
    memory.decode_async(tokens(s.q, kPrompt + 10, 1), tokens(s.k, kPrompt + 10, 1), tokens(s.v, kPrompt + 10, 1),
                        gates(s.gate, kPrompt + 10, 1), tokens(s.y, kPrompt + 10, 1));
    memory.sync();
    REQUIRE(memory.cursor(0).tokens == kPrompt + 11);
  } else {
    // On a host backend the host plans each step itself: the horizon only sizes what reserve() allocates.
    memory.sync();
    REQUIRE(memory.cursor(0).tokens == kPrompt + 20);
  }
}
