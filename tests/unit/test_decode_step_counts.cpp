// The host work of every decode step, step by step: after a prefilled prompt of four chunks, 1,000 decode
// steps of every memory (KVM with a fixed and a power-law budget, OVQ with its plateau budget, KVM with H2O
// row eviction, EvictionMemory with each scorer, Trellis with and without its gate check) are counted with
// Kokkos Tools callbacks -- allocations, deallocations, deep copies (by view, space and direction), fences
// (by label) and kernel launches (by label) -- and each step must cause exactly the events its memory's
// decode() is meant to cause (the budget per memory is spelled out where it is computed below). So a new
// allocation, copy, fence or launch inside a decode step fails here, on the first step that has it.
//
// Inputs of all 1,000 steps are allocated and filled before counting starts; a step takes subviews of
// them, which Kokkos does not count (the first test case checks that). The callbacks are installed over
// whatever tool was attached and that set is put back when a count ends (Kokkos::Tools is always built in
// Kokkos >= 4; Kokkos::Tools::Experimental::get_callbacks / set_callbacks exist in 4.7 and 5.x alike).
#include <catch2/catch_test_macros.hpp>

#include <Kokkos_Random.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include <kvmem/kvmem.hpp>

namespace {

using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, mem>;
using view3 = Kokkos::View<float***, Kokkos::LayoutRight, mem>;

constexpr long kSteps = 1000;
constexpr int kBatch = 2, kKvHeads = 2, kGroup = 2, kQueryHeads = kKvHeads * kGroup, kHeadDim = 16, kChunk = 16;
constexpr long kPrompt = 4 * kChunk;

// ---- counting ----

/// Events of a decode step (or of a stretch of them). The fence Kokkos inserts before each kernel launch
/// only because a tool is attached ("Kokkos Profile Tool Fence") is an artifact of counting and is kept
/// apart (Log::tool_fences).
struct Counts {
  long allocations = 0, deallocations = 0, copies = 0, fences = 0, kernels = 0;
  bool operator==(const Counts&) const = default;
  Counts operator-(const Counts& o) const {
    return {allocations - o.allocations, deallocations - o.deallocations, copies - o.copies, fences - o.fences,
            kernels - o.kernels};
  }
  Counts operator+(const Counts& o) const {
    return {allocations + o.allocations, deallocations + o.deallocations, copies + o.copies, fences + o.fences,
            kernels + o.kernels};
  }
};

std::string to_string(const Counts& c) {
  return std::to_string(c.allocations) + " allocations, " + std::to_string(c.deallocations) + " deallocations, " +
         std::to_string(c.copies) + " deep copies, " + std::to_string(c.fences) + " fences, " +
         std::to_string(c.kernels) + " kernel launches";
}

/// Events by label: "label (space)" for allocations, "src (space) -> dst (space)" for deep copies, the
/// fence's or kernel's name otherwise.
using Labels = std::map<std::string, long>;

struct Log {
  Counts n;
  long tool_fences = 0, empty_allocations = 0;
  Labels allocations, deallocations, copies, fences, kernels;
};
Log g_log;  // written by the callbacks while a Recorder is alive

std::string in_space(std::string_view label, std::string_view space) {
  return std::string(label) + " (" + std::string(space) + ")";
}
// A zero-byte allocation takes no memory and is kept apart (Log::empty_allocations): Kokkos' Cuda backend
// reports one ("Kokkos::CudaSpace::TeamScratchMemory", 0 bytes) at every team launch that asks for no
// level-1 scratch while its scratch pool is still empty (seen on an H200 with Kokkos 4.7.1).
void on_allocate(Kokkos_Profiling_SpaceHandle space, const char* label, const void*, std::uint64_t bytes) {
  if (bytes == 0) {
    ++g_log.empty_allocations;
    return;
  }
  ++g_log.n.allocations;
  ++g_log.allocations[in_space(label, space.name)];
}
void on_deallocate(Kokkos_Profiling_SpaceHandle space, const char* label, const void*, std::uint64_t bytes) {
  if (bytes == 0) {
    ++g_log.empty_allocations;
    return;
  }
  ++g_log.n.deallocations;
  ++g_log.deallocations[in_space(label, space.name)];
}
void on_deep_copy(Kokkos_Profiling_SpaceHandle dst_space, const char* dst, const void*,
                  Kokkos_Profiling_SpaceHandle src_space, const char* src, const void*, std::uint64_t) {
  ++g_log.n.copies;
  ++g_log.copies[in_space(src, src_space.name) + " -> " + in_space(dst, dst_space.name)];
}
void on_fence(const char* name, std::uint32_t, std::uint64_t*) {
  if (std::string_view(name).find("Kokkos Profile Tool Fence") != std::string_view::npos) {
    ++g_log.tool_fences;
    return;
  }
  ++g_log.n.fences;
  ++g_log.fences[name];
}
void on_kernel(const char* name, std::uint32_t, std::uint64_t*) {
  ++g_log.n.kernels;
  ++g_log.kernels[name];
}

/// Counts every event from construction to destruction into a fresh g_log; puts the callbacks that were
/// installed before (none, or a tool's) back at destruction, also when an assertion throws.
class Recorder {
 public:
  Recorder() : saved_(Kokkos::Tools::Experimental::get_callbacks()) {
    namespace tools = Kokkos::Tools::Experimental;
    g_log = Log{};
    tools::set_allocate_data_callback(on_allocate);
    tools::set_deallocate_data_callback(on_deallocate);
    tools::set_begin_deep_copy_callback(on_deep_copy);
    tools::set_begin_fence_callback(on_fence);
    tools::set_begin_parallel_for_callback(on_kernel);
    tools::set_begin_parallel_reduce_callback(on_kernel);
    tools::set_begin_parallel_scan_callback(on_kernel);
  }
  ~Recorder() { Kokkos::Tools::Experimental::set_callbacks(saved_); }
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

 private:
  Kokkos::Tools::Experimental::EventSet saved_;
};

std::string describe(const Log& e) {
  std::string s = to_string(e.n) + " (and " + std::to_string(e.tool_fences) + " tool fences, " +
                  std::to_string(e.empty_allocations) + " zero-byte allocation events)\n";
  auto list = [&](const char* kind, const Labels& m) {
    for (const auto& [label, n] : m) s += std::string("  ") + kind + " " + label + ": " + std::to_string(n) + "\n";
  };
  list("allocation", e.allocations);
  list("deallocation", e.deallocations);
  list("deep copy", e.copies);
  list("fence", e.fences);
  list("kernel", e.kernels);
  return s;
}

/// The events whose label starts with `prefix` (kvmem's own views and kernels all start with "kvmem::").
Labels starting_with(const Labels& m, std::string_view prefix) {
  Labels out;
  for (const auto& [label, n] : m)
    if (std::string_view(label).starts_with(prefix)) out[label] = n;
  return out;
}
/// The events labelled `label` (0 when there were none).
long count(const Labels& m, const std::string& label) {
  const auto it = m.find(label);
  return it == m.end() ? 0 : it->second;
}
long total(const Labels& m) {
  long n = 0;
  for (const auto& [label, count] : m) n += count;
  return n;
}

/// The fence events of one global Kokkos::fence(name): one per enabled backend that reports its fence
/// (1 in an OpenMP build, 2 in a Cuda build with Serial as its host space: seen on an H200). Counted once,
/// with the log of a Recorder that may be alive around it put back afterwards.
long events_per_global_fence() {
  static const long n = [] {
    const Log saved = g_log;
    long events = 0;
    {
      Recorder recorder;
      Kokkos::fence("kvmem test: one global fence");
      events = count(g_log.fences, "kvmem test: one global fence");
    }
    g_log = saved;
    return events;
  }();
  return n;
}

/// Runs decode steps [first, last) through `step(t)`, which decodes token t and returns the events that
/// step is allowed; fails naming the first step whose events differ and how many did.
template <class Step>
void require_every_step(long first, long last, Step&& step) {
  long wrong = 0;
  std::string first_wrong;
  for (long t = first; t < last; ++t) {
    const Counts before = g_log.n;
    const Counts allowed = step(t);
    const Counts seen = g_log.n - before;
    if (seen != allowed && wrong++ == 0)
      first_wrong = "decode step at position " + std::to_string(t) + ": allowed " + to_string(allowed) + "; seen " +
                    to_string(seen);
  }
  INFO(first_wrong << "\nall steps: " << describe(g_log));
  REQUIRE(wrong == 0);
  // The counting's own fences: one global fence before each kernel launch, none elsewhere (else the filter
  // in on_fence would hide a fence of the step).
  REQUIRE(g_log.tool_fences == events_per_global_fence() * g_log.n.kernels);
}

// ---- inputs ----

view4 random4(const std::string& name, long B, long H, long T, long C, std::uint64_t seed, float lo = -1.0f,
              float hi = 1.0f) {
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
/// Tokens [first, first + count) of a (sequence, head, token, channel) view: a subview, no allocation.
auto tokens(const view4& v, long first, long count) {
  return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count), Kokkos::ALL);
}
/// Tokens [first, first + count) of a (sequence, head, token) view.
auto gates(const view3& v, long first, long count) {
  return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count));
}

/// The prompt and the 1,000 decode tokens of every sequence for the attention memories: queries of
/// kQueryHeads heads (GQA group kGroup), keys, values and merge gates of kKvHeads kv-heads, and the output.
struct Stream {
  long T = kPrompt + kSteps;
  view4 q = random4("q", kBatch, kQueryHeads, T, kHeadDim, 1), k = random4("k", kBatch, kKvHeads, T, kHeadDim, 2),
        v = random4("v", kBatch, kKvHeads, T, kHeadDim, 3), y = view4("y", kBatch, kQueryHeads, T, kHeadDim);
  view3 gate = random3("gate", kBatch, kKvHeads, T, 4, -2.0f, 2.0f);
};

/// The same for Trellis (no GQA: H = kKvHeads heads; latent targets of kSlots slots, forget gates near 1,
/// small steps).
constexpr int kSlots = 8;
struct TrellisStream {
  long T = kPrompt + kSteps;
  view4 q = random4("trellis_q", kBatch, kKvHeads, T, kHeadDim, 11),
        k = random4("trellis_k", kBatch, kKvHeads, T, kHeadDim, 12),
        v = random4("trellis_v", kBatch, kKvHeads, T, kHeadDim, 13),
        alpha = random4("trellis_alpha", kBatch, kKvHeads, T, kSlots, 14),
        y = view4("trellis_y", kBatch, kKvHeads, T, kHeadDim);
  view3 beta1 = random3("beta1", kBatch, kKvHeads, T, 15, 0.9f, 1.0f),
        gamma1 = random3("gamma1", kBatch, kKvHeads, T, 16, 0.0f, 0.1f),
        beta2 = random3("beta2", kBatch, kKvHeads, T, 17, 0.9f, 1.0f),
        gamma2 = random3("gamma2", kBatch, kKvHeads, T, 18, 0.0f, 0.1f);
};

/// The label Kokkos gives the host mirror of a `mem` view labelled `label` (on a host backend the mirror
/// is the view itself): the source label of a memory's host-to-device plan upload.
std::string host_mirror_label(const std::string& label) {
  Kokkos::View<long*, mem> device(label, 1);
  return Kokkos::create_mirror_view(device).label();
}
/// "src (Host) -> dst (device space)": a host-to-device copy of a plan the host wrote into the mirror.
std::string upload(const std::string& label) {
  return in_space(host_mirror_label(label), Kokkos::HostSpace::name()) + " -> " + in_space(label, mem::name());
}

// ---- KVM and OVQ (kvmem::Memory) ----

kvmem::MemoryConfig memory_config(int window_chunks, int sinks) {
  kvmem::MemoryConfig c;
  c.head_dim = c.value_dim = kHeadDim;
  c.query_heads = kQueryHeads;
  c.kv_heads = kKvHeads;
  c.chunk = kChunk;
  c.window_chunks = window_chunks;
  c.rope_dims = 4;
  c.sinks = sinks;
  c.max_rows = 1 << 20;
  return c;
}

kvmem::LayerWeights<mem> unit_weights() {
  Kokkos::View<float*, mem> ones("ones", kHeadDim), zeros("zeros", kHeadDim), taus("taus", kQueryHeads);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  return {ones, zeros, taus, taus};
}

/// The state views a regrowth resizes: keys, values, read keys, read values, radius, counts, and the
/// row statistics under row eviction.
constexpr long state_views(bool row_eviction) { return row_eviction ? 7 : 6; }

/// What one regrowth of the state rows costs (state::StateRows::grow, capacity doubling), measured on
/// state rows of the test's shape. Per state view one Kokkos::resize: a new allocation, Kokkos' own launches
/// to zero it and to copy the live rows (their number and names are Kokkos', e.g. "Kokkos::View::
/// initialization [...]" and "Kokkos::ViewCopy-4D"), its global fence "Kokkos::resize(View)" (one event
/// per backend, events_per_global_fence), and the old allocation freed (with the fence the memory space
/// takes before a free, if any). No deep copy.
Counts regrowth_cost(bool row_eviction) {
  const long per_fence = events_per_global_fence();
  REQUIRE(per_fence >= 1);
  kvmem::state::StateRows<mem> rows;
  rows.allocate(kBatch, kKvHeads, kChunk, kHeadDim, kHeadDim);
  if (row_eviction) rows.allocate_stats();
  Recorder recorder;
  rows.grow(kChunk + 1);
  const Log e = g_log;
  INFO("one regrowth: " << describe(e));
  REQUIRE(rows.capacity() == 2 * kChunk);
  REQUIRE(e.n.allocations == state_views(row_eviction));
  REQUIRE(e.n.deallocations == state_views(row_eviction));
  REQUIRE(e.n.copies == 0);
  REQUIRE(count(e.fences, "Kokkos::resize(View)") == per_fence * state_views(row_eviction));
  REQUIRE(starting_with(e.kernels, "kvmem::").empty());
  return e.n;
}

/// Prefills four chunks, then decodes 1,000 tokens of a KVM or OVQ memory and checks every step against
/// its budget (memory.hpp, decode() -> run_step()):
///  - 1 deep copy host -> device of the step plan kvmem::step_plan (StepPlan::upload): each sequence's
///    position, window start, state rows read and block to fold, written on the host from its cursor;
///  - 1 fence kvmem::Memory::step: the API promises that y is written when decode() returns;
///  - 2 kernels, kvmem::window (the token's key, value and gate into the window ring) and kvmem::readout;
///  - on a step that folds a chunk into the state (once per kChunk tokens; the sequences are in lockstep,
///    so they fold on the same step in one launch): 1 kernel, kvmem::update (kernels::update_state: stage,
///    score, select, append, route, group and fold as passes of one team per (sequence, kv-head), and with
///    H2O row eviction the evict pass);
///  - with H2O row eviction: kvmem::row_attn on every step (the attention mass of the rows read; every
///    step reads rows, the prompt already filled the state and moved the window past it);
///  - on a fold step that needs more rows than allocated: one regrowth of the state (regrowth_cost), the
///    amortised doubling of a growing budget (at most log2(final / initial capacity) times).
/// Returns the number of regrowths.
template <class Memory>
long require_memory_steps(Memory& memory, const Stream& s) {
  constexpr bool row_eviction = Memory::row_policy_type::evicts;
  const Counts regrowth = regrowth_cost(row_eviction);
  const std::string plan_upload = upload("kvmem::step_plan");
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
  exec().fence();
  const long capacity_before = memory.rows().capacity(), covered_before = memory.cursor(0).covered;
  long folds = 0, regrowths = 0;
  bool lockstep = true, doubling = true;

  Recorder recorder;
  require_every_step(kPrompt, s.T, [&](long t) {
    const long covered = memory.cursor(0).covered, capacity = memory.rows().capacity();
    memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1));
    const bool fold = memory.cursor(0).covered != covered, grew = memory.rows().capacity() != capacity;
    for (long b = 0; b < kBatch; ++b)
      lockstep = lockstep && memory.cursor(b).covered == memory.cursor(0).covered &&
                 (!fold || memory.cursor(b).covered == covered + kChunk);
    doubling = doubling && (!grew || memory.rows().capacity() == 2 * capacity);
    folds += fold ? 1 : 0;
    regrowths += grew ? 1 : 0;
    Counts allowed{.copies = 1, .fences = 1, .kernels = 2};
    if (fold) allowed.kernels += 1;  // kvmem::update
    if (row_eviction) allowed.kernels += 1;  // kvmem::row_attn
    if (grew) allowed = allowed + regrowth;
    return allowed;
  });
  const Log e = g_log;
  INFO(describe(e) << "folds " << folds << ", regrowths " << regrowths << ", capacity " << capacity_before << " -> "
                   << memory.rows().capacity());
  // The schedule behind the budgets: one fold per chunk of decoded tokens, in lockstep; regrowths double.
  REQUIRE(lockstep);
  REQUIRE(folds == (memory.cursor(0).covered - covered_before) / kChunk);
  REQUIRE((folds == kSteps / kChunk || folds == kSteps / kChunk + 1));
  REQUIRE(doubling);
  REQUIRE(memory.rows().capacity() == (capacity_before << regrowths));

  // The same events by label: kvmem's own exactly, Kokkos' (inside Kokkos::resize) only as regrowths.
  REQUIRE(e.copies == Labels{{plan_upload, kSteps}});
  Labels kernels{{"kvmem::window", kSteps}, {"kvmem::readout", kSteps}};
  kernels["kvmem::update"] = folds;
  if (row_eviction) kernels["kvmem::row_attn"] = kSteps;
  REQUIRE(starting_with(e.kernels, "kvmem::") == kernels);
  REQUIRE(total(e.kernels) - total(kernels) == regrowths * regrowth.kernels);
  REQUIRE(count(e.fences, "kvmem::Memory::step") == kSteps);
  REQUIRE(total(e.fences) - kSteps == regrowths * regrowth.fences);
  Labels state;
  for (const char* v : {"kvmem::state_keys", "kvmem::state_values", "kvmem::state_read_keys",
                        "kvmem::state_read_values", "kvmem::state_radius", "kvmem::state_counts"})
    state[in_space(v, mem::name())] = regrowths;
  if (row_eviction) state[in_space("kvmem::state_stats", mem::name())] = regrowths;
  if (regrowths == 0) state.clear();
  REQUIRE(e.allocations == state);
  REQUIRE(e.deallocations == state);
  return regrowths;
}

// ---- eviction memories ----

/// Random mLSTM weights of the documented shapes (spec EVICTION.md §3); their values do not change the work.
kvmem::score::MLstmWeights<mem> random_mlstm_weights() {
  const long X = 2 * kHeadDim, h = kHeadDim / 2;
  auto make3 = [&](const std::string& name, std::uint64_t seed) {
    Kokkos::View<float***, Kokkos::LayoutRight, mem> v(name, kKvHeads, X, h);
    Kokkos::Random_XorShift64_Pool<exec> pool(seed);
    Kokkos::fill_random(v, pool, -0.1f, 0.1f);
    return v;
  };
  auto make2 = [&](const std::string& name, long cols, std::uint64_t seed) {
    Kokkos::View<float**, Kokkos::LayoutRight, mem> v(name, kKvHeads, cols);
    Kokkos::Random_XorShift64_Pool<exec> pool(seed);
    Kokkos::fill_random(v, pool, -0.1f, 0.1f);
    return v;
  };
  auto zeros = [&](const std::string& name) { return Kokkos::View<float*, mem>(name, kKvHeads); };
  kvmem::score::MLstmWeights<mem> w;
  w.w_q = make3("w_q", 21);
  w.w_k = make3("w_k", 22);
  w.w_v = make3("w_v", 23);
  w.w_i = make2("w_i", X, 24);
  w.w_f = make2("w_f", X, 25);
  w.w_s = make2("w_s", h, 26);
  w.b_i = zeros("b_i");
  w.b_f = zeros("b_f");
  w.b_s = zeros("b_s");
  w.theta = zeros("theta");
  return w;
}

/// Prefills four chunks into an eviction memory with `scorer` (sinks 2, window 16, top-k 24: the prompt
/// already evicts), then decodes 1,000 tokens, each step within its budget (eviction_memory.hpp, decode()
/// -> run()):
///  - 2 deep copies host -> device: kvmem::evict_first (each sequence's position, from the host's token
///    counter) and kvmem::evict_lengths (1 token per active sequence);
///  - 1 kernel kvmem::evict: the whole step (append, score, evict, readout) is one team kernel, whatever
///    the scorer (the mLSTM's update and the attention statistics run inside it);
///  - 1 fence kvmem::EvictionMemory::step (outputs written when decode() returns);
///  - no allocation: the B + 1 rows of every (sequence, kv-head) and the scorer's state are allocated at
///    construction.
template <class Scorer>
void require_eviction_steps(const Stream& s, const Scorer& scorer) {
  const kvmem::EvictionConfig cfg{.head_dim = kHeadDim, .value_dim = kHeadDim, .query_heads = kQueryHeads,
                                  .kv_heads = kKvHeads, .sinks = 2, .window = 16, .top_k = 24};
  kvmem::EvictionMemory<exec, Scorer> memory(cfg, kBatch, scorer);
  const std::string first_upload = upload("kvmem::evict_first"), lengths_upload = upload("kvmem::evict_lengths");
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.y, 0, kPrompt));
  exec().fence();
  Recorder recorder;
  require_every_step(kPrompt, s.T, [&](long t) {
    memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.y, t, 1));
    return Counts{.copies = 2, .fences = 1, .kernels = 1};
  });
  const Log e = g_log;
  INFO(Scorer::name << ": " << describe(e));
  REQUIRE(e.copies == Labels{{first_upload, kSteps}, {lengths_upload, kSteps}});
  REQUIRE(e.fences == Labels{{"kvmem::EvictionMemory::step", kSteps}});
  REQUIRE(e.kernels == Labels{{"kvmem::evict", kSteps}});
  REQUIRE(memory.tokens(0) == kPrompt + kSteps);
}

// ---- Trellis ----

/// Prefills four chunks into a Trellis memory, then decodes 1,000 tokens, each step within its budget
/// (trellis_memory.hpp, decode()):
///  - 1 deep copy host -> device of kvmem::trellis_lengths (1 token per active sequence);
///  - 1 kernel, kvmem::trellis (kernels::trellis_chunks with one token);
///  - 1 fence kvmem::TrellisMemory::step (outputs written when decode() returns);
///  - with check_gates (the default), kernels::trellis_first_bad_gate before them: the result scalar
///    kvmem::trellis_first_bad_gate set from the host (a copy host -> device), 1 kernel kvmem::tr_gates,
///    the result read back (a copy device -> host, the one read of a step) and its fence
///    kvmem::tr_gates read, so that a bad gate throws before the state changes;
///  - no allocation: the one-token scratch is left from the prefill (whose chunks need more).
void require_trellis_steps(bool check_gates) {
  const TrellisStream s;
  kvmem::TrellisConfig cfg{.slots = kSlots, .head_dim = kHeadDim, .value_dim = kHeadDim, .heads = kKvHeads};
  cfg.chunk = kChunk;
  cfg.check_gates = check_gates;
  kvmem::TrellisMemory<exec> memory(cfg, kBatch);
  const std::string lengths_upload = upload("kvmem::trellis_lengths");
  long scalar = 0;  // the check's host scalar is an unmanaged view over a local (no label)
  const Kokkos::View<long, Kokkos::HostSpace, Kokkos::MemoryUnmanaged> unmanaged(&scalar);
  const std::string host_scalar = in_space(unmanaged.label(), Kokkos::HostSpace::name());
  const std::string result = in_space("kvmem::trellis_first_bad_gate", mem::name());
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.alpha, 0, kPrompt),
                 gates(s.beta1, 0, kPrompt), gates(s.gamma1, 0, kPrompt), gates(s.beta2, 0, kPrompt),
                 gates(s.gamma2, 0, kPrompt), tokens(s.y, 0, kPrompt));
  exec().fence();
  Recorder recorder;
  require_every_step(kPrompt, s.T, [&](long t) {
    memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.alpha, t, 1), gates(s.beta1, t, 1),
                  gates(s.gamma1, t, 1), gates(s.beta2, t, 1), gates(s.gamma2, t, 1), tokens(s.y, t, 1));
    return check_gates ? Counts{.copies = 3, .fences = 2, .kernels = 2}
                       : Counts{.copies = 1, .fences = 1, .kernels = 1};
  });
  const Log e = g_log;
  INFO("check_gates = " << check_gates << ": " << describe(e));
  Labels copies{{lengths_upload, kSteps}}, fences{{"kvmem::TrellisMemory::step", kSteps}},
      kernels{{"kvmem::trellis", kSteps}};
  if (check_gates) {
    copies[host_scalar + " -> " + result] = kSteps;
    copies[result + " -> " + host_scalar] = kSteps;
    fences["kvmem::tr_gates read"] = kSteps;
    kernels["kvmem::tr_gates"] = kSteps;
  }
  REQUIRE(e.copies == copies);
  REQUIRE(e.fences == fences);
  REQUIRE(e.kernels == kernels);
  REQUIRE(memory.tokens(0) == kPrompt + kSteps);
}

}  // namespace

TEST_CASE("decode-step counts: taking the inputs of a step from the allocated stream counts nothing",
          "[decode-counts]") {
  const Stream s;
  using tokens_in = kvmem::KvmMemory<exec, kvmem::budget::Fixed>::tokens_in;
  using gates_in = kvmem::KvmMemory<exec, kvmem::budget::Fixed>::gates_in;
  using tokens_out = kvmem::KvmMemory<exec, kvmem::budget::Fixed>::tokens_out;
  Recorder recorder;
  long taken = 0;
  for (long t = kPrompt; t < s.T; ++t) {
    const tokens_in q = tokens(s.q, t, 1), k = tokens(s.k, t, 1), v = tokens(s.v, t, 1);
    const gates_in gate = gates(s.gate, t, 1);
    const tokens_out y = tokens(s.y, t, 1);
    taken += q.extent_int(2) + k.extent_int(2) + v.extent_int(2) + gate.extent_int(2) + y.extent_int(2);
  }
  INFO(describe(g_log));
  REQUIRE(taken == 5 * kSteps);
  REQUIRE(g_log.n == Counts{});
  REQUIRE(g_log.tool_fences == 0);
}

TEST_CASE("decode-step counts: KVM and OVQ memories, step by step", "[decode-counts]") {
  const Stream s;
  const auto w = unit_weights();
  SECTION("KVM, fixed budget: the state never regrows") {
    kvmem::KvmMemory<exec, kvmem::budget::Fixed> memory(memory_config(2, 1), {.min_rows = 32}, w, kBatch);
    const long regrowths = require_memory_steps(memory, s);
    REQUIRE(regrowths == 0);
  }
  SECTION("KVM, power-law budget: the state regrows by doubling") {
    kvmem::KvmMemory<exec, kvmem::budget::PowerLaw> memory(memory_config(2, 1), {.min_rows = 16, .growth_factor = 4.0},
                                                           w, kBatch);
    const long regrowths = require_memory_steps(memory, s);
    REQUIRE(regrowths >= 1);
  }
  SECTION("OVQ, plateau budget") {
    kvmem::OvqMemory<exec> memory(memory_config(1, 0), {.n = 48.0}, w, kBatch);
    require_memory_steps(memory, s);
  }
  SECTION("KVM with H2O row eviction: the row statistics regrow with the state") {
    kvmem::KvmMemoryWithRowEviction<exec, kvmem::budget::PowerLaw, kvmem::score::RowAccumulatedAttention> memory(
        memory_config(2, 1), {.min_rows = 16, .growth_factor = 4.0}, w, kBatch,
        kvmem::score::RowAccumulatedAttention{.max_rows = 40});
    require_memory_steps(memory, s);
  }
}

TEST_CASE("decode-step counts: eviction memories with every scorer, step by step", "[decode-counts]") {
  const Stream s;
  SECTION("None (StreamingLLM)") { require_eviction_steps(s, kvmem::score::None{}); }
  SECTION("KeyNorm") { require_eviction_steps(s, kvmem::score::KeyNorm{}); }
  SECTION("AccumulatedAttention (H2O)") { require_eviction_steps(s, kvmem::score::AccumulatedAttention{}); }
  SECTION("LastQueryAttention (TOVA)") { require_eviction_steps(s, kvmem::score::LastQueryAttention{}); }
  SECTION("MLstm (KVPOP)") { require_eviction_steps(s, kvmem::score::MLstm<mem>(random_mlstm_weights())); }
}

TEST_CASE("decode-step counts: Trellis, step by step", "[decode-counts]") {
  SECTION("with the gate check") { require_trellis_steps(true); }
  SECTION("without the gate check") { require_trellis_steps(false); }
}
