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
#include <catch2/generators/catch_generators.hpp>

#include <Kokkos_Random.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include <kvmem/kvmem.hpp>

#include "decode_stream.hpp"

namespace {

using namespace kvmem_test;


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


// ---- KVM and OVQ (kvmem::Memory) ----


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

/// What one growth of a fold table costs (kernels::FoldTable::cover, doubling): the new table's allocation
/// (and its host mirror's on a GPU), its copy to the device (none on a host backend), and the old table
/// (and mirror) freed with whatever fence the memory space takes before a free. No kernel.
Counts fold_table_growth_cost() {
  kvmem::kernels::FoldTable<mem> table;
  const kvmem::MemoryConfig cfg = memory_config(2, 1);
  table.cover(exec(), cfg, kvmem::budget::Fixed{.min_rows = 32}, true, 1);
  Recorder recorder;
  table.cover(exec(), cfg, kvmem::budget::Fixed{.min_rows = 32}, true, table.folds + 1);
  const Log e = g_log;
  INFO("one fold-table growth: " << describe(e));
  REQUIRE(e.n.allocations == (device_plans ? 2 : 1));
  REQUIRE(e.n.deallocations == e.n.allocations);
  REQUIRE(e.n.copies == (device_plans ? 1 : 0));
  REQUIRE(e.n.kernels == 0);
  return e.n;
}

/// Prefills four chunks, then decodes 1,000 tokens of a KVM or OVQ memory and checks every step against
/// its budget (memory.hpp, decode() -> run_step()):
///  - no deep copy: the host plans the step in place (kernels::plan_decode_token on the cursors, into the
///    step plan the kernels read) on a host backend; on a GPU the host plans only the launch bounds, and
///    1 kernel kvmem::plan works the same plan out on the device from the device's cursors;
///  - 1 fence kvmem::Memory::step: the API promises that y is written when decode() returns;
///  - 1 kernel, kvmem::readout, whose one team per (sequence, kv-head) also writes the token's key, value
///    and gate into the window ring (kernels::readout_writes_window), and kvmem::window (the token into the
///    window ring) only on a step whose lazy fold (KVM) runs before the readout;
///  - on a step that folds a chunk into the state (once per kChunk tokens; the sequences are in lockstep,
///    so they fold on the same step in one launch): 1 kernel, kvmem::update (kernels::update_state: stage,
///    score, select, append, route, group and fold as passes of one team per (sequence, kv-head), and with
///    H2O row eviction the evict pass);
///  - with H2O row eviction: kvmem::row_attn on every step (the attention mass of the rows read; every
///    step reads rows, the prompt already filled the state and moved the window past it);
///  - on a fold step that needs more rows than allocated: one regrowth of the state (regrowth_cost), the
///    amortised doubling of a growing budget (at most log2(final / initial capacity) times);
///  - on a fold step whose block the fold table does not hold yet: one growth of the table
///    (fold_table_growth_cost), doubling.
/// Returns the number of regrowths.
template <class Memory>
long require_memory_steps(Memory& memory, const Stream& s) {
  constexpr bool row_eviction = Memory::row_policy_type::evicts;
  constexpr bool lazy = !Memory::merge_type::commit_eagerly;  // KVM folds before its readout, OVQ after
  const Counts regrowth = regrowth_cost(row_eviction), table_growth = fold_table_growth_cost();
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
  exec().fence();
  const long capacity_before = memory.rows().capacity(), covered_before = memory.cursor(0).covered;
  long folds = 0, regrowths = 0, table_growths = 0;
  bool lockstep = true, doubling = true;

  Recorder recorder;
  require_every_step(kPrompt, s.T, [&](long t) {
    const long covered = memory.cursor(0).covered, capacity = memory.rows().capacity();
    const long table = memory.fold_table().folds;
    memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1));
    const bool fold = memory.cursor(0).covered != covered, grew = memory.rows().capacity() != capacity;
    const bool table_grew = memory.fold_table().folds != table;
    for (long b = 0; b < kBatch; ++b)
      lockstep = lockstep && memory.cursor(b).covered == memory.cursor(0).covered &&
                 (!fold || memory.cursor(b).covered == covered + kChunk);
    doubling = doubling && (!grew || memory.rows().capacity() == 2 * capacity);
    folds += fold ? 1 : 0;
    regrowths += grew ? 1 : 0;
    table_growths += table_grew ? 1 : 0;
    Counts allowed{.fences = 1, .kernels = device_plans ? 2 : 1};
    if (fold) allowed.kernels += lazy ? 2 : 1;  // kvmem::update, and kvmem::window before a lazy fold
    if (row_eviction) allowed.kernels += 1;  // kvmem::row_attn
    if (grew) allowed = allowed + regrowth;
    if (table_grew) allowed = allowed + table_growth;
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

  // The table doubles: a few growths in 1,000 steps of 16-token chunks (16 -> 32 -> 64 -> 128 blocks).
  REQUIRE(table_growths >= 1);
  REQUIRE(table_growths <= 4);
  // The same events by label: kvmem's own exactly, Kokkos' (inside Kokkos::resize) only as regrowths.
  REQUIRE(total(e.copies) == table_growths * table_growth.copies);
  Labels kernels{{"kvmem::readout", kSteps}};  // the readout writes the window but before a lazy fold
  if (lazy && folds > 0) kernels["kvmem::window"] = folds;
  kernels["kvmem::update"] = folds;
  if (row_eviction) kernels["kvmem::row_attn"] = kSteps;
  if (device_plans) kernels["kvmem::plan"] = kSteps;
  REQUIRE(starting_with(e.kernels, "kvmem::") == kernels);
  REQUIRE(total(e.kernels) - total(kernels) == regrowths * regrowth.kernels);
  REQUIRE(count(e.fences, "kvmem::Memory::step") == kSteps);
  REQUIRE(total(e.fences) - kSteps == regrowths * regrowth.fences + table_growths * table_growth.fences);
  Labels state;
  for (const char* v : {"kvmem::state_keys", "kvmem::state_values", "kvmem::state_read_keys",
                        "kvmem::state_read_values", "kvmem::state_radius", "kvmem::state_counts"})
    state[in_space(v, mem::name())] = regrowths;
  if (row_eviction) state[in_space("kvmem::state_stats", mem::name())] = regrowths;
  if (regrowths == 0) state.clear();
  const Labels tables = starting_with(e.allocations, "kvmem::fold_table");
  REQUIRE(total(tables) == table_growths * table_growth.allocations);
  for (const auto& [label, n] : tables) state[label] = n;
  REQUIRE(e.allocations == state);
  REQUIRE(total(e.deallocations) == total(state));
  return regrowths;
}

/// The same stream through decode_async after reserve(): launches only, every step. No allocation, no
/// copy, no fence. On a host backend the kernels of decode() (kvmem::update on a fold step only); on a GPU
/// the same kernels on every step, so that one captured step replays them all: kvmem::plan,
/// kvmem::window before a lazy fold's kvmem::update (its teams return at once where no block folds),
/// kvmem::readout (which writes the window itself where no lazy fold precedes it) and, with
/// H2O row eviction, kvmem::row_attn. After the last step sync() brings the cursors back (on a GPU: one
/// fence and two copies), and every sequence has seen every token. `on_device`: the memory plans as a GPU
/// does (plan_on_device()), so a CPU machine counts the GPU's launches.
template <class Memory>
void require_memory_async_steps(Memory& memory, const Stream& s, bool on_device) {
  const bool device = device_plans || on_device;
  constexpr bool row_eviction = Memory::row_policy_type::evicts;
  constexpr bool lazy = !Memory::merge_type::commit_eagerly;  // KVM folds before its readout, OVQ after
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
  memory.reserve(s.T);
  if (on_device) memory.plan_on_device();
  exec().fence();
  {
    Recorder recorder;
    require_every_step(kPrompt, s.T, [&](long t) {
      const long covered = device ? 0 : memory.cursor(0).covered;
      memory.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1),
                          tokens(s.y, t, 1));
      const bool fold = !device && memory.cursor(0).covered != covered;
      Counts allowed{.kernels = 1};  // kvmem::readout, which writes the window too
      if (device || fold) allowed.kernels += lazy ? 2 : 1;  // kvmem::update, and kvmem::window before a lazy one
      if (device) allowed.kernels += 1;  // kvmem::plan
      if (row_eviction) allowed.kernels += 1;  // kvmem::row_attn
      return allowed;
    });
    INFO(describe(g_log));
    REQUIRE(g_log.copies.empty());
    REQUIRE(g_log.fences.empty());
    REQUIRE(g_log.allocations.empty());
  }
  memory.sync();
  for (long b = 0; b < kBatch; ++b) REQUIRE(memory.cursor(b).tokens == s.T);
}

// ---- eviction memories ----


/// An eviction memory with `scorer` (sinks 2, window 16, top-k 24) that has prefilled the stream's first
/// four chunks (the prompt already evicts).
template <class Scorer>
kvmem::EvictionMemory<exec, Scorer> prefilled_eviction(const Stream& s, const Scorer& scorer) {
  const kvmem::EvictionConfig cfg{.head_dim = kHeadDim, .value_dim = kHeadDim, .query_heads = kQueryHeads,
                                  .kv_heads = kKvHeads, .sinks = 2, .window = 16, .top_k = 24};
  kvmem::EvictionMemory<exec, Scorer> memory(cfg, kBatch, scorer);
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.y, 0, kPrompt));
  exec().fence();
  return memory;
}

/// Prefills four chunks into an eviction memory with `scorer` (sinks 2, window 16, top-k 24: the prompt
/// already evicts), then decodes 1,000 tokens, each step within its budget (eviction_memory.hpp, decode()
/// -> run()):
///  - no deep copy: each sequence's position is its token count kvmem::evict_first, which the step
///    advances where it lives (on a GPU with 1 kernel kvmem::advance), and the active set kvmem::evict_active
///    was sent once, when it was set;
///  - 1 kernel kvmem::evict: the whole step (append, score, evict, readout) is one team kernel, whatever
///    the scorer (the mLSTM's update and the attention statistics run inside it);
///  - 1 fence kvmem::EvictionMemory::step (outputs written when decode() returns);
///  - no allocation: the B + 1 rows of every (sequence, kv-head) and the scorer's state are allocated at
///    construction.
/// With `async`, the same steps through decode_async: the same kernels and nothing else (no fence); sync()
/// then gives the token counts. `on_device`: counted as a GPU counts (plan_on_device()).
template <class Scorer>
void require_eviction_steps(const Stream& s, const Scorer& scorer, bool async = false, bool on_device = false) {
  const bool device = device_plans || on_device;
  auto memory = prefilled_eviction(s, scorer);
  if (on_device) memory.plan_on_device();
  {
    Recorder recorder;
    require_every_step(kPrompt, s.T, [&](long t) {
      if (async)
        memory.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.y, t, 1));
      else
        memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.y, t, 1));
      return Counts{.fences = async ? 0 : 1, .kernels = device ? 2 : 1};
    });
    const Log e = g_log;
    INFO(Scorer::name << ": " << describe(e));
    REQUIRE(e.copies.empty());
    Labels fences{{"kvmem::EvictionMemory::step", kSteps}}, kernels{{"kvmem::evict", kSteps}};
    if (async) fences.clear();
    if (device) kernels["kvmem::advance"] = kSteps;
    REQUIRE(e.fences == fences);
    REQUIRE(e.kernels == kernels);
  }
  memory.sync();
  REQUIRE(memory.tokens(0) == kPrompt + kSteps);
  REQUIRE(memory.tokens(kBatch - 1) == kPrompt + kSteps);
}

// ---- Trellis ----

/// Prefills four chunks into a Trellis memory, then decodes 1,000 tokens, each step within its budget
/// (trellis_memory.hpp, decode()):
///  - no deep copy of the active set kvmem::trellis_active (sent once, when it was set), and on a GPU 1
///    kernel kvmem::advance for the token counts the device keeps;
///  - 1 kernel, kvmem::trellis (kernels::trellis_chunks with one token);
///  - 1 fence kvmem::TrellisMemory::step (outputs written when decode() returns);
///  - with check_gates (the default), kernels::trellis_first_bad_gate before them: the result scalar
///    kvmem::trellis_first_bad_gate set from the host (a copy host -> device), 1 kernel kvmem::tr_gates,
///    the result read back (a copy device -> host, the one read of a step) and its fence
///    kvmem::tr_gates read, so that a bad gate throws before the state changes;
///  - no allocation: the one-token scratch is allocated at construction (a prefill's chunks may grow it).
/// With `async` (and no gate check), the same steps through decode_async: no fence; sync() then gives the
/// token counts. `on_device`: counted as a GPU counts (plan_on_device()).
void require_trellis_steps(bool check_gates, bool async = false, bool on_device = false) {
  const bool device = device_plans || on_device;
  const TrellisStream s;
  kvmem::TrellisConfig cfg{.slots = kSlots, .head_dim = kHeadDim, .value_dim = kHeadDim, .heads = kKvHeads};
  cfg.chunk = kChunk;
  cfg.check_gates = check_gates;
  kvmem::TrellisMemory<exec> memory(cfg, kBatch);
  long scalar = 0;  // the check's host scalar is an unmanaged view over a local (no label)
  const Kokkos::View<long, Kokkos::HostSpace, Kokkos::MemoryUnmanaged> unmanaged(&scalar);
  const std::string host_scalar = in_space(unmanaged.label(), Kokkos::HostSpace::name());
  const std::string result = in_space("kvmem::trellis_first_bad_gate", mem::name());
  memory.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.alpha, 0, kPrompt),
                 gates(s.beta1, 0, kPrompt), gates(s.gamma1, 0, kPrompt), gates(s.beta2, 0, kPrompt),
                 gates(s.gamma2, 0, kPrompt), tokens(s.y, 0, kPrompt));
  if (on_device) memory.plan_on_device();
  exec().fence();
  Recorder recorder;
  require_every_step(kPrompt, s.T, [&](long t) {
    if (async)
      memory.decode_async(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.alpha, t, 1),
                          gates(s.beta1, t, 1), gates(s.gamma1, t, 1), gates(s.beta2, t, 1), gates(s.gamma2, t, 1),
                          tokens(s.y, t, 1));
    else
      memory.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.alpha, t, 1), gates(s.beta1, t, 1),
                    gates(s.gamma1, t, 1), gates(s.beta2, t, 1), gates(s.gamma2, t, 1), tokens(s.y, t, 1));
    const long advance = device ? 1 : 0;
    return check_gates ? Counts{.copies = 2, .fences = 2, .kernels = 2 + advance}
                       : Counts{.fences = async ? 0 : 1, .kernels = 1 + advance};
  });
  const Log e = g_log;
  INFO("check_gates = " << check_gates << ": " << describe(e));
  Labels copies, fences{{"kvmem::TrellisMemory::step", kSteps}}, kernels{{"kvmem::trellis", kSteps}};
  if (async) fences.clear();
  if (device) kernels["kvmem::advance"] = kSteps;
  if (check_gates) {
    copies[host_scalar + " -> " + result] = kSteps;
    copies[result + " -> " + host_scalar] = kSteps;
    fences["kvmem::tr_gates read"] = kSteps;
    kernels["kvmem::tr_gates"] = kSteps;
  }
  REQUIRE(e.copies == copies);
  REQUIRE(e.fences == fences);
  REQUIRE(e.kernels == kernels);
  memory.sync();
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
    auto memory = kvm_power_law(w);
    REQUIRE(require_memory_steps(memory, s) >= 1);
  }
  SECTION("OVQ, plateau budget") {
    auto memory = ovq_plateau(w);
    require_memory_steps(memory, s);
  }
  SECTION("KVM with H2O row eviction: the row statistics regrow with the state") {
    auto memory = kvm_row_eviction(w);
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

TEST_CASE("decode-step counts: decode_async launches only, for every memory", "[decode-counts]") {
  const Stream s;
  const auto w = unit_weights();
  // As the backend plans, and as a GPU plans (plan_on_device(): the same launches every step).
  const bool on_device = GENERATE(false, true);
  INFO((on_device ? "planned as on a GPU (plan_on_device)" : "planned as the backend plans"));
  SECTION("KVM, power-law budget") {
    auto memory = kvm_power_law(w);
    require_memory_async_steps(memory, s, on_device);
  }
  SECTION("OVQ, plateau budget") {
    auto memory = ovq_plateau(w);
    require_memory_async_steps(memory, s, on_device);
  }
  SECTION("KVM with H2O row eviction") {
    auto memory = kvm_row_eviction(w);
    require_memory_async_steps(memory, s, on_device);
  }
  SECTION("eviction, H2O") { require_eviction_steps(s, kvmem::score::AccumulatedAttention{}, true, on_device); }
  SECTION("eviction, KVPOP") {
    require_eviction_steps(s, kvmem::score::MLstm<mem>(random_mlstm_weights()), true, on_device);
  }
  SECTION("Trellis (without the gate check: with it decode_async throws)") {
    require_trellis_steps(false, true, on_device);
  }
}
