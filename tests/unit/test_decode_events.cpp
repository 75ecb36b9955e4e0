// What a decode step does besides launching kernels, counted with Kokkos Tools callbacks over 1,000 decode
// steps of every memory: allocations, deep copies and fences (docs/cuda.md "A decode step today"). A decode
// step may only do what is documented there -- one host-to-device copy of its step plan (or of the active
// sequences), the one fence the API promises, the amortised regrowth of a growing state, and Trellis' gate
// check read-back -- so any new allocation, copy or fence inside a step fails here. This is the guard of
// the plan-once work: each documented event that goes away lowers a number below.
#include <catch2/catch_test_macros.hpp>

#include <Kokkos_Random.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include <kvmem/kvmem.hpp>

namespace {

using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, mem>;
using view3 = Kokkos::View<float***, Kokkos::LayoutRight, mem>;

constexpr long kSteps = 1000, kPrompt = 64;
constexpr int kBatch = 2, kHq = 4, kHkv = 2, kD = 16;

/// Events seen while counting, by kind and label.
struct Events {
  long allocations = 0, deallocations = 0, deep_copies = 0, fences = 0, kernels = 0;
  std::map<std::string, long> copies_by_label, fences_by_label;
};
Events g_events;
bool g_counting = false;

void on_allocate(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t) {
  if (g_counting) ++g_events.allocations;
}
void on_deallocate(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t) {
  if (g_counting) ++g_events.deallocations;
}
void on_deep_copy(Kokkos_Profiling_SpaceHandle dst_space, const char* dst, const void*, Kokkos_Profiling_SpaceHandle src_space,
                  const char* src, const void*, std::uint64_t) {
  if (!g_counting) return;
  ++g_events.deep_copies;
  ++g_events.copies_by_label[std::string(src) + " (" + src_space.name + ") -> " + dst + " (" + dst_space.name + ")"];
}
void on_fence(const char* name, std::uint32_t, std::uint64_t*) {
  // With a tool attached, Kokkos fences after every kernel to time it: an artifact of counting, not a
  // fence of the step.
  if (!g_counting || std::string_view(name).find("Kokkos Profile Tool Fence") != std::string_view::npos) return;
  ++g_events.fences;
  ++g_events.fences_by_label[name];
}
void on_kernel(const char*, std::uint32_t, std::uint64_t*) {
  if (g_counting) ++g_events.kernels;
}

/// Counts events from construction to stop(); the callbacks are removed again at destruction.
struct Counting {
  Counting() {
    namespace tools = Kokkos::Tools::Experimental;
    g_events = Events{};
    tools::set_allocate_data_callback(on_allocate);
    tools::set_deallocate_data_callback(on_deallocate);
    tools::set_begin_deep_copy_callback(on_deep_copy);
    tools::set_begin_fence_callback(on_fence);
    tools::set_begin_parallel_for_callback(on_kernel);
    tools::set_begin_parallel_reduce_callback(on_kernel);
    tools::set_begin_parallel_scan_callback(on_kernel);
    g_counting = true;
  }
  Events stop() {
    g_counting = false;
    return g_events;
  }
  ~Counting() {
    namespace tools = Kokkos::Tools::Experimental;
    g_counting = false;
    tools::set_allocate_data_callback(nullptr);
    tools::set_deallocate_data_callback(nullptr);
    tools::set_begin_deep_copy_callback(nullptr);
    tools::set_begin_fence_callback(nullptr);
    tools::set_begin_parallel_for_callback(nullptr);
    tools::set_begin_parallel_reduce_callback(nullptr);
    tools::set_begin_parallel_scan_callback(nullptr);
  }
};

/// Prints what was counted, so a failure names the event that is new.
std::string describe(const Events& e) {
  std::string s = "allocations " + std::to_string(e.allocations) + ", deallocations " + std::to_string(e.deallocations) +
                  ", deep copies " + std::to_string(e.deep_copies) + ", fences " + std::to_string(e.fences) +
                  ", kernel launches " + std::to_string(e.kernels) + "\n";
  for (const auto& [label, n] : e.copies_by_label) s += "  copy  " + label + ": " + std::to_string(n) + "\n";
  for (const auto& [label, n] : e.fences_by_label) s += "  fence " + label + ": " + std::to_string(n) + "\n";
  return s;
}

view4 random4(const std::string& name, long B, long H, long T, long C, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  view4 v(name, B, H, T, C);
  Kokkos::Random_XorShift64_Pool<exec> pool(seed);
  Kokkos::fill_random(v, pool, lo, hi);
  return v;
}
view3 random3(const std::string& name, long B, long H, long T, std::uint64_t seed, float lo, float hi) {
  view3 v(name, B, H, T);
  Kokkos::Random_XorShift64_Pool<exec> pool(seed);
  Kokkos::fill_random(v, pool, lo, hi);
  return v;
}
auto tokens(const view4& v, long first, long count) {
  return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count), Kokkos::ALL);
}
auto gates(const view3& v, long first, long count) {
  return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count));
}

/// The prompt and the 1,000 decode tokens of every sequence, allocated and filled before counting starts.
struct Stream {
  long T = kPrompt + kSteps;
  view4 q = random4("q", kBatch, kHq, T, kD, 1), k = random4("k", kBatch, kHkv, T, kD, 2),
        v = random4("v", kBatch, kHkv, T, kD, 3), y = view4("y", kBatch, kHq, T, kD);
  view3 gate = random3("gate", kBatch, kHkv, T, 4, -2.0f, 2.0f);
};

kvmem::MemoryConfig memory_config(int window_chunks, int sinks) {
  kvmem::MemoryConfig c;
  c.head_dim = c.value_dim = kD;
  c.query_heads = kHq;
  c.kv_heads = kHkv;
  c.chunk = 16;
  c.window_chunks = window_chunks;
  c.rope_dims = 4;
  c.sinks = sinks;
  c.max_rows = 1 << 20;
  return c;
}

kvmem::LayerWeights<mem> unit_weights() {
  Kokkos::View<float*, mem> ones("ones", kD), zeros("zeros", kD), taus("taus", kHq);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  return {ones, zeros, taus, taus};
}

/// Prefills the prompt (not counted), then counts 1,000 decode steps of a KVM/OVQ memory. Returns the events
/// and, through `regrowths`, how often the state rows' capacity grew during them.
template <class Memory>
Events count_memory(Memory& memory, const Stream& s, long& regrowths, long& capacity_before) {
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
  exec().fence();
  long capacity = memory.rows().capacity();
  capacity_before = capacity;
  regrowths = 0;
  Counting counting;
  for (long t = kPrompt; t < s.T; ++t) {
    memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1));
    if (memory.rows().capacity() != capacity) {
      ++regrowths;
      capacity = memory.rows().capacity();
    }
  }
  return counting.stop();
}

/// The events of `steps` decode steps of a Memory whose state rows grew `regrowths` times: the step plan's
/// host-to-device copy and the API's fence per step; per regrowth the resize of every state view (state
/// keys, values, read keys, read values, radius, counts, plus the row statistics under row eviction):
/// one allocation, one copy of the live rows and one deallocation each.
/// The fences that Kokkos::resize issues for each resized view (one before its copy, one before the old
/// allocation is freed; the second one's label names the memory space).
long resize_fences(const Events& e) {
  long n = 0;
  for (const auto& [label, count] : e.fences_by_label)
    if (label == "Kokkos::resize(View)" || label.find("impl_deallocate") != std::string::npos) n += count;
  return n;
}

/// The events of `steps` decode steps of a Memory whose state rows grew `regrowths` times: per step the step
/// plan's host-to-device copy (kernels::StepPlan::upload) and the fence the API promises
/// (kvmem::Memory::step); per regrowth (state::StateRows::grow, doubling) a Kokkos::resize of each of the
/// `state_views` state views: one allocation, one deallocation, two fences each.
void require_memory_events(const Events& e, long steps, long regrowths, long state_views) {
  INFO(describe(e) << "regrowths " << regrowths);
  REQUIRE(e.deep_copies == steps);
  REQUIRE(e.copies_by_label.size() == 1);
  REQUIRE(e.copies_by_label.begin()->first.starts_with("kvmem::step_plan"));
  REQUIRE(e.fences_by_label.at("kvmem::Memory::step") == steps);
  REQUIRE(e.allocations == regrowths * state_views);
  REQUIRE(e.deallocations == regrowths * state_views);
  REQUIRE(resize_fences(e) == 2 * regrowths * state_views);
  REQUIRE(e.fences == steps + resize_fences(e));
}

/// Doublings from `before` to `after` rows of capacity (grow() doubles unless one fold needs more).
long doublings(long before, long after) {
  long n = 0;
  for (long c = before; c < after; c *= 2) ++n;
  return n;
}

}  // namespace

TEST_CASE("decode steps of KVM and OVQ do only the documented host work", "[decode-counts]") {
  const Stream s;
  const auto w = unit_weights();
  long regrowths = 0, before = 0;
  SECTION("KVM, fixed budget: no allocation at all") {
    kvmem::KvmMemory<exec, kvmem::budget::Fixed> m(memory_config(2, 1), {.min_rows = 32}, w, kBatch);
    const auto e = count_memory(m, s, regrowths, before);
    REQUIRE(regrowths == 0);
    require_memory_events(e, kSteps, 0, 6);
  }
  SECTION("KVM, power-law budget: the state regrows by doubling") {
    kvmem::KvmMemory<exec, kvmem::budget::PowerLaw> m(memory_config(2, 1), {.min_rows = 16, .growth_factor = 4.0}, w,
                                                      kBatch);
    const auto e = count_memory(m, s, regrowths, before);
    REQUIRE(regrowths >= 1);
    REQUIRE(regrowths == doublings(before, m.rows().capacity()));
    require_memory_events(e, kSteps, regrowths, 6);
  }
  SECTION("OVQ, plateau budget") {
    kvmem::OvqMemory<exec> m(memory_config(1, 0), {.n = 48.0}, w, kBatch);
    const auto e = count_memory(m, s, regrowths, before);
    REQUIRE(regrowths == doublings(before, m.rows().capacity()));
    require_memory_events(e, kSteps, regrowths, 6);
  }
  SECTION("KVM with H2O row eviction: the row statistics regrow too") {
    kvmem::KvmMemoryWithRowEviction<exec, kvmem::budget::PowerLaw, kvmem::score::RowAccumulatedAttention> m(
        memory_config(2, 1), {.min_rows = 16, .growth_factor = 4.0}, w, kBatch,
        kvmem::score::RowAccumulatedAttention{.max_rows = 40});
    const auto e = count_memory(m, s, regrowths, before);
    REQUIRE(regrowths == doublings(before, m.rows().capacity()));
    require_memory_events(e, kSteps, regrowths, 7);
  }
}

namespace {
/// Prefills the prompt, then counts 1,000 decode steps of an eviction memory with `scorer`: per step the
/// copies of the sequences' first positions and token counts to the device and the API's fence, nothing else
/// (the cache's B + 1 row slots are allocated at construction).
template <class Scorer>
void require_eviction_events(const Stream& s, const Scorer& scorer) {
  const kvmem::EvictionConfig cfg{.head_dim = kD, .value_dim = kD, .query_heads = kHq, .kv_heads = kHkv,
                                  .sinks = 2, .window = 16, .top_k = 24};
  kvmem::EvictionMemory<exec, Scorer> m(cfg, kBatch, scorer);
  m.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.y, 0, kPrompt));
  exec().fence();
  Counting counting;
  for (long t = kPrompt; t < s.T; ++t)
    m.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.y, t, 1));
  const auto e = counting.stop();
  INFO(Scorer::name << ": " << describe(e));
  REQUIRE(e.allocations == 0);
  REQUIRE(e.deallocations == 0);
  REQUIRE(e.deep_copies == 2 * kSteps);
  REQUIRE(e.copies_by_label.size() == 2);
  REQUIRE(e.fences == kSteps);
  REQUIRE(e.fences_by_label.at("kvmem::EvictionMemory::step") == kSteps);
  REQUIRE(e.kernels == kSteps);  // one kernel per step: the whole step is one team kernel
}

/// Random mLSTM weights of the documented shapes (spec EVICTION.md §3); their values do not change the work.
kvmem::score::MLstmWeights<mem> random_mlstm_weights() {
  const long X = 2 * kD, h = kD / 2;
  auto make3 = [&](const std::string& name, std::uint64_t seed) {  // Kokkos 4.7 takes no const char* label
    Kokkos::View<float***, Kokkos::LayoutRight, mem> v(name, kHkv, X, h);
    Kokkos::Random_XorShift64_Pool<exec> pool(seed);
    Kokkos::fill_random(v, pool, -0.1f, 0.1f);
    return v;
  };
  auto make2 = [&](const std::string& name, long cols, std::uint64_t seed) {
    Kokkos::View<float**, Kokkos::LayoutRight, mem> v(name, kHkv, cols);
    Kokkos::Random_XorShift64_Pool<exec> pool(seed);
    Kokkos::fill_random(v, pool, -0.1f, 0.1f);
    return v;
  };
  auto zeros = [&](const std::string& name) { return Kokkos::View<float*, mem>(name, kHkv); };
  kvmem::score::MLstmWeights<mem> w;
  w.w_q = make3("w_q", 11);
  w.w_k = make3("w_k", 12);
  w.w_v = make3("w_v", 13);
  w.w_i = make2("w_i", X, 14);
  w.w_f = make2("w_f", X, 15);
  w.w_s = make2("w_s", h, 16);
  w.b_i = zeros("b_i");
  w.b_f = zeros("b_f");
  w.b_s = zeros("b_s");
  w.theta = zeros("theta");
  return w;
}
}  // namespace

TEST_CASE("decode steps of eviction memories do only the documented host work", "[decode-counts]") {
  const Stream s;
  require_eviction_events(s, kvmem::score::None{});
  require_eviction_events(s, kvmem::score::KeyNorm{});
  require_eviction_events(s, kvmem::score::AccumulatedAttention{});
  require_eviction_events(s, kvmem::score::LastQueryAttention{});
  require_eviction_events(s, kvmem::score::MLstm<mem>(random_mlstm_weights()));
}

TEST_CASE("decode steps of Trellis do only the documented host work", "[decode-counts]") {
  const Stream s;  // Trellis has no GQA: its H heads take the first H query heads and H kv-heads' worth of keys
  const int H = kHkv, m_slots = 8;
  const view4 alpha = random4("alpha", kBatch, H, s.T, m_slots, 5);
  const view3 beta = random3("beta", kBatch, H, s.T, 6, 0.9f, 1.0f), gamma = random3("gamma", kBatch, H, s.T, 7, 0.0f, 0.1f);
  const auto q = Kokkos::subview(s.q, Kokkos::ALL, Kokkos::pair<int, int>(0, H), Kokkos::ALL, Kokkos::ALL);
  const auto y = Kokkos::subview(s.y, Kokkos::ALL, Kokkos::pair<int, int>(0, H), Kokkos::ALL, Kokkos::ALL);
  for (bool check_gates : {true, false}) {
    INFO("check_gates = " << check_gates);
    kvmem::TrellisConfig cfg{.slots = m_slots, .head_dim = kD, .value_dim = kD, .heads = H};
    cfg.check_gates = check_gates;
    kvmem::TrellisMemory<exec> m(cfg, kBatch);
    auto step = [&](long first, long count, auto&& call) {
      auto tok = [&](const auto& v) {
        return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count), Kokkos::ALL);
      };
      call(tok(q), tok(s.k), tok(s.v), tok(alpha), gates(beta, first, count), gates(gamma, first, count), tok(y));
    };
    step(0, kPrompt, [&](auto... a) {
      auto t = std::make_tuple(a...);
      m.prefill(std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), std::get<5>(t),
                std::get<4>(t), std::get<5>(t), std::get<6>(t));
    });
    exec().fence();
    Counting counting;
    for (long t = kPrompt; t < s.T; ++t)
      step(t, 1, [&](auto... a) {
        auto u = std::make_tuple(a...);
        m.decode(std::get<0>(u), std::get<1>(u), std::get<2>(u), std::get<3>(u), std::get<4>(u), std::get<5>(u),
                 std::get<4>(u), std::get<5>(u), std::get<6>(u));
      });
    const auto e = counting.stop();
    INFO(describe(e));
    REQUIRE(e.allocations == 0);
    REQUIRE(e.deallocations == 0);
    // Per step: the active sequences' token counts to the device; with the gate check also the check's
    // result scalar to the device and back (the one device-to-host read of a step), then its fence.
    REQUIRE(e.deep_copies == (check_gates ? 3 : 1) * kSteps);
    REQUIRE(e.fences == (check_gates ? 2 : 1) * kSteps);
    REQUIRE(e.fences_by_label.at("kvmem::TrellisMemory::step") == kSteps);
    if (check_gates) REQUIRE(e.fences_by_label.at("kvmem::tr_gates read") == kSteps);
  }
}
