/// \file main.cpp
/// kvmem-soak: long decode streams through a memory, checked at every token (docs/reliability.md).
///
///   kvmem-soak [--memory NAME[,NAME...]|all] [--tokens N] [--every K] [--seed S] [--spike-every P]
///              [--json FILE] [--no-kokkos-tools] [--list]
///
/// One sequence, one kv-head and one query head (head_dim = value_dim = 64), decoded token by token on
/// Kokkos::DefaultExecutionSpace from a seeded Gaussian stream (every P-th token a spike: key and value x100,
/// gate pre-activation +8). Checked at every token: y finite; state rows and held_bytes() within the
/// schedule's bound. At every K-th token (checkpoint): state rows equal to what the schedule says
/// (state::final_rows for KVM), every live state row (keys, values, radius, read caches) finite, and the
/// process's resident memory (VmRSS), Kokkos allocations and host heap allocations since the last
/// checkpoint. After the first checkpoint (warm-up) RSS may grow only by what the memory itself allocated
/// (the state doubling its capacity under a growing budget), and Kokkos may allocate only state rows.
/// Exit status 0 when every check of every memory passed, 1 otherwise, 2 for bad arguments.
///
/// Adding a memory: one entry in soak_cases() below (a name, a factory, the rows the schedule promises
/// after n tokens and their upper bound).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <kvmem/kvmem.hpp>

// ---- host heap allocation counter (every operator new of the process, Kokkos' library included) ----
namespace {
std::atomic<long> g_heap_allocations{0};
}
void* operator new(std::size_t n) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (std::max<std::size_t>(n, 1) + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

// ---- Kokkos allocation counter (Kokkos Tools callback) ----
long g_kokkos_allocations = 0, g_kokkos_other_allocations = 0;
void on_kokkos_allocate(Kokkos_Profiling_SpaceHandle, const char* label, const void*, std::uint64_t) {
  ++g_kokkos_allocations;
  if (std::strncmp(label, "kvmem::state_", 13) != 0) ++g_kokkos_other_allocations;  // not a state capacity doubling
}

/// Resident set size of this process, bytes (VmRSS of /proc/self/status).
long rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6) * 1024;
  return -1;
}

struct Options {
  std::vector<std::string> memories;
  long tokens = 1000000, every = 50000, spike_every = 10007;
  unsigned seed = 1;
  bool kokkos_tools = true;
  std::string json;
};

struct Checkpoint {
  long tokens, rows, expected_rows, held_bytes, allocated_bytes, rss, kokkos_allocations, heap_allocations;
  double seconds;
};

struct Result {
  std::string name;
  long tokens = 0, nonfinite_outputs = 0, first_nonfinite = -1, bound_violations = 0, first_bound_violation = -1;
  long row_mismatches = 0, nonfinite_state = 0, max_rows = 0, max_held = 0, max_bound = 0;
  long rss_drift = 0, other_kokkos_allocations = 0;
  double seconds = 0, heap_allocations_per_token = 0;
  std::vector<Checkpoint> checkpoints;
  [[nodiscard]] bool passed() const {
    return nonfinite_outputs == 0 && bound_violations == 0 && row_mismatches == 0 && nonfinite_state == 0 &&
           rss_drift <= (1L << 20) && other_kokkos_allocations == 0;
  }
};

/// A memory under soak: its factory and the schedule's promises.
struct SoakCase {
  std::string name, description;
  std::function<Result(const Options&)> run;
};

constexpr int kDim = 64;

kvmem::MemoryConfig soak_config(long max_rows) {
  kvmem::MemoryConfig cfg;
  cfg.head_dim = kDim;
  cfg.value_dim = kDim;
  cfg.query_heads = 1;
  cfg.kv_heads = 1;
  cfg.chunk = 256;
  cfg.window_chunks = 2;
  cfg.rope_dims = 32;
  cfg.sinks = 1;
  cfg.max_rows = max_rows;
  return cfg;
}

template <class Space>
kvmem::LayerWeights<Space> soak_weights(unsigned seed) {
  Kokkos::View<float*, Space> lw("ln_weight", kDim), lb("ln_bias", kDim), ts("tau_state", 1), tb("tau_bswa", 1);
  auto hw = Kokkos::create_mirror_view(lw), hb = Kokkos::create_mirror_view(lb);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (int c = 0; c < kDim; ++c) {
    hw(c) = 1.0f + 0.2f * normal(rng);
    hb(c) = 0.1f * normal(rng);
  }
  Kokkos::deep_copy(lw, hw);
  Kokkos::deep_copy(lb, hb);
  Kokkos::deep_copy(ts, 1.0f);
  Kokkos::deep_copy(tb, 1.0f);
  return {lw, lb, ts, tb};
}

/// Counts non-finite entries among rows [0, rows) of the state of sequence 0 (all kv-heads).
template <class Memory>
long nonfinite_state(const Memory& mem, long rows) {
  const auto& st = mem.rows();
  long bad = 0;
  auto scan4 = [&](const auto& view) {
    const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
    for (std::size_t kv = 0; kv < h.extent(1); ++kv)
      for (long i = 0; i < rows; ++i)
        for (std::size_t c = 0; c < h.extent(3); ++c) bad += std::isfinite(h(0, kv, i, c)) ? 0 : 1;
  };
  scan4(st.keys);
  scan4(st.values);
  scan4(st.read_keys);
  scan4(st.read_values);
  const auto r = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.radius);
  for (std::size_t kv = 0; kv < r.extent(1); ++kv)
    for (long i = 0; i < rows; ++i) bad += std::isfinite(r(0, kv, i)) ? 0 : 1;
  return bad;
}

/// Decodes o.tokens tokens through `mem`. expected(n): the rows after n tokens; bound(n): their upper bound.
template <class Memory>
Result soak(Memory& mem, const std::string& name, const Options& o, const std::function<long(long)>& expected,
            const std::function<long(long)>& bound) {
  using space = typename Memory::memory_space;
  using view4 = Kokkos::View<float****, Kokkos::LayoutRight, space>;
  using view3 = Kokkos::View<float***, Kokkos::LayoutRight, space>;
  const auto& cfg = mem.config();
  const int Hq = cfg.query_heads, Hkv = cfg.kv_heads, D = cfg.head_dim, Dv = cfg.value_dim;
  view4 q("q", 1, Hq, 1, D), k("k", 1, Hkv, 1, D), v("v", 1, Hkv, 1, Dv), y("y", 1, Hq, 1, Dv);
  view3 gate("gate", 1, Hkv, 1);
  auto hq = Kokkos::create_mirror_view(q), hk = Kokkos::create_mirror_view(k), hv = Kokkos::create_mirror_view(v);
  auto hg = Kokkos::create_mirror_view(gate);
  auto hy = Kokkos::create_mirror_view(y);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  const long L = cfg.window(), unit = static_cast<long>(D + Dv + 1) * static_cast<long>(sizeof(float)) * Hkv;

  Result r;
  r.name = name;
  const auto start = std::chrono::steady_clock::now();
  long rss_warm = -1, allocated_warm = 0, heap_warm = 0, heap_last = g_heap_allocations.load(), kokkos_last = g_kokkos_allocations;
  long other_warm = 0;
  std::printf("%-14s %9s %7s %7s %12s %12s %10s %8s %10s %8s\n", name.c_str(), "tokens", "rows", "expect", "held B",
              "allocated B", "RSS MiB", "kokkos+", "heap+/tok", "seconds");
  for (long n = 1; n <= o.tokens; ++n) {
    const bool spike = o.spike_every > 0 && n % o.spike_every == 0;
    const float scale = spike ? 100.0f : 1.0f;
    for (int h = 0; h < Hq; ++h)
      for (int c = 0; c < D; ++c) hq(0, h, 0, c) = normal(rng);
    for (int h = 0; h < Hkv; ++h) {
      for (int c = 0; c < D; ++c) hk(0, h, 0, c) = scale * normal(rng);
      for (int c = 0; c < Dv; ++c) hv(0, h, 0, c) = scale * normal(rng);
      hg(0, h, 0) = spike ? 8.0f : uniform(rng);
    }
    Kokkos::deep_copy(q, hq);
    Kokkos::deep_copy(k, hk);
    Kokkos::deep_copy(v, hv);
    Kokkos::deep_copy(gate, hg);
    mem.decode(q, k, v, gate, y);
    Kokkos::deep_copy(hy, y);
    for (int h = 0; h < Hq; ++h)
      for (int c = 0; c < Dv; ++c)
        if (!std::isfinite(hy(0, h, 0, c))) {
          if (r.first_nonfinite < 0) r.first_nonfinite = n;
          ++r.nonfinite_outputs;
        }
    const long rows = mem.cursor(0).rows, held = mem.held_bytes(), rows_bound = bound(n);
    const long held_bound = (rows_bound + L) * unit;
    r.max_rows = std::max(r.max_rows, rows);
    r.max_held = std::max(r.max_held, held);
    r.max_bound = std::max(r.max_bound, held_bound);
    if (rows > rows_bound || held > held_bound) {
      if (r.first_bound_violation < 0) r.first_bound_violation = n;
      ++r.bound_violations;
    }
    if (n % o.every == 0 || n == o.tokens) {
      Checkpoint c{};
      c.tokens = n;
      c.rows = rows;
      c.expected_rows = expected(n);
      c.held_bytes = held;
      c.allocated_bytes = mem.allocated_bytes();
      c.rss = rss_bytes();
      const long heap_now = g_heap_allocations.load();
      c.kokkos_allocations = g_kokkos_allocations - kokkos_last;
      c.heap_allocations = heap_now - heap_last;
      kokkos_last = g_kokkos_allocations;
      c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (c.rows != c.expected_rows) ++r.row_mismatches;
      r.nonfinite_state += nonfinite_state(mem, rows);
      heap_last = g_heap_allocations.load();  // the checks above allocate; not counted against decode
      if (rss_warm < 0) {  // the first checkpoint ends the warm-up
        rss_warm = c.rss;
        allocated_warm = c.allocated_bytes;
        heap_warm = heap_last;
        other_warm = g_kokkos_other_allocations;
      } else {
        r.rss_drift = std::max(r.rss_drift, (c.rss - rss_warm) - (c.allocated_bytes - allocated_warm));
      }
      std::printf("%-14s %9ld %7ld %7ld %12ld %12ld %10.1f %8ld %10.2f %8.1f%s\n", "", c.tokens, c.rows,
                  c.expected_rows, c.held_bytes, c.allocated_bytes, c.rss / 1048576.0, c.kokkos_allocations,
                  static_cast<double>(c.heap_allocations) / o.every, c.seconds,
                  c.rows != c.expected_rows ? "  ROWS MISMATCH" : "");
      std::fflush(stdout);
      r.checkpoints.push_back(c);
    }
  }
  r.tokens = o.tokens;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.other_kokkos_allocations = g_kokkos_other_allocations - other_warm;
  const long counted = r.checkpoints.size() > 1 ? o.tokens - r.checkpoints.front().tokens : 0;
  long heap_after_warm = 0;
  for (std::size_t i = 1; i < r.checkpoints.size(); ++i) heap_after_warm += r.checkpoints[i].heap_allocations;
  (void)heap_warm;
  r.heap_allocations_per_token = counted ? static_cast<double>(heap_after_warm) / counted : 0.0;
  return r;
}

std::vector<SoakCase> soak_cases() {
  using exec = Kokkos::DefaultExecutionSpace;
  using space = exec::memory_space;
  std::vector<SoakCase> cases;
  // KVM, fixed budget of 256 rows (= one chunk; kvm-paper "fixed-256").
  cases.push_back({"kvm-fixed256", "KVM, budget::Fixed{256}, max_rows 256", [](const Options& o) {
                     const auto cfg = soak_config(256);
                     const kvmem::budget::Fixed budget{256};
                     kvmem::KvmMemory<exec, kvmem::budget::Fixed> mem(cfg, budget, soak_weights<space>(o.seed), 1);
                     return soak(
                         mem, "kvm-fixed256", o, [&](long n) { return kvmem::state::final_rows(cfg, budget, n); },
                         [&](long n) { return std::min(n, 256L); });
                   }});
  // KVM, power-law budget 16 * sqrt(ctx) (kvm-paper "16 sqrt(N)"), no cap below the budget.
  cases.push_back({"kvm-sqrt16", "KVM, budget::PowerLaw{256, 16, 0.5}, max_rows 2^40", [](const Options& o) {
                     const auto cfg = soak_config(1L << 40);
                     const kvmem::budget::PowerLaw budget{256, 16.0, 0.5, 1};
                     kvmem::KvmMemory<exec, kvmem::budget::PowerLaw> mem(cfg, budget, soak_weights<space>(o.seed), 1);
                     // ctx of an update is L + its first token < L + n; rows never exceed the budget there.
                     const long L = cfg.window(), C = cfg.chunk;
                     return soak(
                         mem, "kvm-sqrt16", o, [&](long n) { return kvmem::state::final_rows(cfg, budget, n); },
                         [&, L, C](long n) { return std::max(std::min(n, C), budget.rows(L + n)); });
                   }});
  return cases;
}

void write_json(const std::string& path, const std::vector<Result>& results, const Options& o) {
  std::ofstream out(path);
  out << "{\n  \"backend\": \"" << Kokkos::DefaultExecutionSpace::name() << "\", \"threads\": "
      << Kokkos::DefaultExecutionSpace().concurrency() << ", \"seed\": " << o.seed << ", \"spike_every\": " << o.spike_every
      << ",\n  \"memories\": [\n";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    out << "    {\"name\": \"" << r.name << "\", \"tokens\": " << r.tokens << ", \"passed\": " << (r.passed() ? "true" : "false")
        << ", \"seconds\": " << r.seconds << ", \"nonfinite_outputs\": " << r.nonfinite_outputs
        << ", \"bound_violations\": " << r.bound_violations << ", \"row_mismatches\": " << r.row_mismatches
        << ", \"nonfinite_state\": " << r.nonfinite_state << ", \"max_rows\": " << r.max_rows
        << ", \"max_held_bytes\": " << r.max_held << ", \"max_held_bound\": " << r.max_bound
        << ", \"rss_drift_bytes\": " << r.rss_drift << ", \"other_kokkos_allocations\": " << r.other_kokkos_allocations
        << ", \"heap_allocations_per_token\": " << r.heap_allocations_per_token << ",\n     \"checkpoints\": [";
    for (std::size_t j = 0; j < r.checkpoints.size(); ++j) {
      const auto& c = r.checkpoints[j];
      out << (j ? ", " : "") << "[" << c.tokens << ", " << c.rows << ", " << c.expected_rows << ", " << c.held_bytes << ", "
          << c.allocated_bytes << ", " << c.rss << ", " << c.kokkos_allocations << ", " << c.heap_allocations << ", "
          << c.seconds << "]";
    }
    out << "]}" << (i + 1 < results.size() ? "," : "") << "\n";
  }
  out << "  ],\n  \"checkpoint_fields\": [\"tokens\", \"rows\", \"expected_rows\", \"held_bytes\", \"allocated_bytes\", "
         "\"rss_bytes\", \"kokkos_allocations\", \"heap_allocations\", \"seconds\"]\n}\n";
}

int usage(const char* why) {
  std::fprintf(stderr,
               "kvmem-soak: %s\nusage: kvmem-soak [--memory NAME[,NAME...]|all] [--tokens N] [--every K] [--seed S]\n"
               "                  [--spike-every P] [--json FILE] [--no-kokkos-tools] [--list]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const auto cases = soak_cases();
  std::string memories = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) std::exit(usage(("missing value of " + a).c_str()));
      return argv[++i];
    };
    auto number = [&](long lo) {
      const std::string s = value();
      char* end = nullptr;
      const long x = std::strtol(s.c_str(), &end, 10);
      if (*end != '\0' || x < lo) std::exit(usage((a + " = " + s + ": must be an integer >= " + std::to_string(lo)).c_str()));
      return x;
    };
    if (a == "--memory") memories = value();
    else if (a == "--tokens") o.tokens = number(1);
    else if (a == "--every") o.every = number(1);
    else if (a == "--seed") o.seed = static_cast<unsigned>(number(0));
    else if (a == "--spike-every") o.spike_every = number(0);
    else if (a == "--json") o.json = value();
    else if (a == "--no-kokkos-tools") o.kokkos_tools = false;
    else if (a == "--list") {
      for (const auto& c : cases) std::printf("%-14s %s\n", c.name.c_str(), c.description.c_str());
      return 0;
    } else return usage(("unknown argument " + a).c_str());
  }
  std::stringstream list(memories);
  for (std::string m; std::getline(list, m, ',');) {
    if (m == "all")
      for (const auto& c : cases) o.memories.push_back(c.name);
    else if (std::none_of(cases.begin(), cases.end(), [&](const SoakCase& c) { return c.name == m; }))
      return usage(("unknown memory " + m + " (--list)").c_str());
    else
      o.memories.push_back(m);
  }

  Kokkos::ScopeGuard guard(argc, argv);
  // Counting Kokkos allocations registers a Kokkos Tools callback, which makes Kokkos build profiling
  // names (host allocations of its own); --no-kokkos-tools measures the host heap without it.
  if (o.kokkos_tools) Kokkos::Tools::Experimental::set_allocate_data_callback(on_kokkos_allocate);
  std::printf("kvmem-soak  backend=%s (%d threads)  tokens=%ld  checkpoint every %ld  seed=%u  spike every %ld\n",
              Kokkos::DefaultExecutionSpace::name(), Kokkos::DefaultExecutionSpace().concurrency(), o.tokens, o.every,
              o.seed, o.spike_every);
  std::vector<Result> results;
  bool ok = true;
  for (const auto& name : o.memories) {
    const auto& c = *std::find_if(cases.begin(), cases.end(), [&](const SoakCase& s) { return s.name == name; });
    results.push_back(c.run(o));
    const auto& r = results.back();
    ok = ok && r.passed();
    std::printf("%s: %s  %ld tokens in %.1f s  non-finite outputs %ld (first at %ld)  bound violations %ld (first at %ld)\n"
                "  row mismatches at checkpoints %ld  non-finite state entries %ld  max rows %ld  max held %ld B (bound %ld B)\n"
                "  RSS growth after warm-up beyond the memory's own allocations %ld B  Kokkos allocations after warm-up "
                "other than state rows %ld  host heap allocations per token %.2f\n",
                r.name.c_str(), r.passed() ? "PASS" : "FAIL", r.tokens, r.seconds, r.nonfinite_outputs, r.first_nonfinite,
                r.bound_violations, r.first_bound_violation, r.row_mismatches, r.nonfinite_state, r.max_rows, r.max_held,
                r.max_bound, r.rss_drift, r.other_kokkos_allocations, r.heap_allocations_per_token);
    std::fflush(stdout);
  }
  if (!o.json.empty()) write_json(o.json, results, o);
  return ok ? 0 : 1;
}
