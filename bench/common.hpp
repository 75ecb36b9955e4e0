#pragma once
// Shared pieces of the kvmem benchmarks: random inputs, the machine's ceilings (OpenBLAS sgemm rate and
// copy bandwidth), the work model that turns a run into FLOPs and bytes, an exact-attention decode step
// over a full KV cache, and the execution-space instances for 1 thread and all threads.
//
// Every count here is derived from the same host-side schedule the memory itself follows
// (kvmem::state::window_begin / plan_update), so the FLOPs and bytes are those of the kernels that ran.
// The formulas are written out in bench/README.md.

#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>
#include <benchmark/benchmark.h>
#if KVMEM_BENCH_CBLAS
#include <cblas.h>
#endif
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <kvmem/kernels/readout/exact_attention.hpp>
#include <kvmem/kvmem.hpp>

namespace kvbench {

using exec_t = Kokkos::DefaultExecutionSpace;
using space_t = exec_t::memory_space;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, space_t>;
using view3 = Kokkos::View<float***, Kokkos::LayoutRight, space_t>;
using view1 = Kokkos::View<float*, space_t>;
using clock_t_ = std::chrono::steady_clock;

inline double seconds_since(clock_t_::time_point t0) {
  return std::chrono::duration<double>(clock_t_::now() - t0).count();
}

// ---------------------------------------------------------------------------------------------------
// Threads: "1" is a Kokkos::OpenMP(1) instance (the Debian Kokkos has no Serial backend), "all" is the
// default instance (every OpenMP thread of the process).

inline int all_threads() { return exec_t().concurrency(); }

/// The one-thread instance, made on first use and released by release_execs() before Kokkos::finalize.
inline std::optional<exec_t>& one_thread_exec() {
  static std::optional<exec_t> one;
  return one;
}

inline exec_t make_exec([[maybe_unused]] int threads) {  // one instance on a GPU: threads do not apply
#ifdef KOKKOS_ENABLE_OPENMP
  if constexpr (std::is_same_v<exec_t, Kokkos::OpenMP>) {
    if (threads == 1 && all_threads() > 1) {
      if (!one_thread_exec()) one_thread_exec().emplace(1);
      return *one_thread_exec();
    }
  }
#endif
  return exec_t();
}

inline void release_execs() { one_thread_exec().reset(); }

// ---------------------------------------------------------------------------------------------------
// Shapes and inputs.

struct Shape {
  long T = 1024;   // tokens per sequence
  int D = 64;      // head_dim = value_dim
  int G = 1;       // GQA group: query heads per kv-head
  int B = 1;       // batch
  int Hkv = 8;     // kv-heads
  int threads = 0; // OpenMP threads (0 = all)
  [[nodiscard]] int Hq() const { return G * Hkv; }
  [[nodiscard]] std::string key() const {
    return (T > 0 ? "T:" + std::to_string(T) + "/" : std::string()) + "D:" + std::to_string(D) + "/G:" + std::to_string(G) +
           "/B:" + std::to_string(B) + "/Hkv:" + std::to_string(Hkv) + "/threads:" + std::to_string(threads);
  }
};

/// The memory every benchmark uses: chunk 256, a window of 2 chunks (512 tokens), half the key channels
/// rotary (zeroed before the memory LayerNorm), one sink, rows capped at 16384.
inline kvmem::MemoryConfig memory_config(const Shape& s) {
  kvmem::MemoryConfig c;
  c.head_dim = s.D;
  c.value_dim = s.D;
  c.query_heads = s.Hq();
  c.kv_heads = s.Hkv;
  c.chunk = 256;
  c.window_chunks = 2;
  c.rope_dims = s.D / 2;
  c.sinks = 1;
  c.max_rows = 16384;
  return c;
}

inline kvmem::budget::Fixed fixed256() { return kvmem::budget::Fixed{256}; }
inline kvmem::budget::PowerLaw power_law() { return kvmem::budget::PowerLaw{256, 16.0, 0.5, 1}; }

/// Unit layer weights: LayerNorm weight 1 and bias 0 [D], temperatures (KVM) or beta (OVQ) 1 [Hq].
inline kvmem::LayerWeights<space_t> unit_weights(const Shape& s) {
  view1 ln_w("ln_weight", s.D), ln_b("ln_bias", s.D), tau_s("tau_state", s.Hq()), tau_w("tau_window", s.Hq());
  Kokkos::deep_copy(ln_w, 1.0f);
  Kokkos::deep_copy(tau_s, 1.0f);
  Kokkos::deep_copy(tau_w, 1.0f);
  return {ln_w, ln_b, tau_s, tau_w};
}

/// Uniform values in [lo, hi) through the view's elements taken as one flat range. Kokkos::fill_random
/// parallelizes over the first extent only, in blocks of 128 indices: with B (1 to 8) first, one thread
/// fills the whole tensor, minutes for the gigabytes of the GPU grid's 64K and 128K shapes (their rows did
/// not finish on an H200). The views here are contiguous (LayoutRight), so the flat range is every element.
template <class View>
void fill_uniform(const View& view, Kokkos::Random_XorShift64_Pool<exec_t>& pool, float lo, float hi) {
  static_assert(std::is_same_v<typename View::array_layout, Kokkos::LayoutRight>);
  Kokkos::View<float*, space_t, Kokkos::MemoryTraits<Kokkos::Unmanaged>> flat(view.data(), view.span());
  Kokkos::fill_random(flat, pool, lo, hi);
}

/// Random q, k, v (uniform [-1, 1)), gate pre-activations (uniform [-2, 2)), y, and unit layer weights,
/// for `tokens` tokens of every sequence; add_trellis() adds the Trellis memory's inputs.
struct Inputs {
  view4 q, k, v, y;
  view3 gate;
  kvmem::LayerWeights<space_t> weights;
  kvmem::LayerWeights<space_t>::vector tau;  // tau_window, the exact baseline's temperatures
  // Trellis only: latent targets alpha [B, Hkv, T, m], forget gates beta1, beta2 and step sizes gamma1,
  // gamma2 [B, Hkv, T].
  view4 alpha;
  view3 beta1, gamma1, beta2, gamma2;

  Inputs(const Shape& s, long tokens, unsigned seed = 12345) {
    q = view4(Kokkos::view_alloc(Kokkos::WithoutInitializing, "q"), s.B, s.Hq(), tokens, s.D);
    k = view4(Kokkos::view_alloc(Kokkos::WithoutInitializing, "k"), s.B, s.Hkv, tokens, s.D);
    v = view4(Kokkos::view_alloc(Kokkos::WithoutInitializing, "v"), s.B, s.Hkv, tokens, s.D);
    y = view4("y", s.B, s.Hq(), tokens, s.D);
    gate = view3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "gate"), s.B, s.Hkv, tokens);
    Kokkos::Random_XorShift64_Pool<exec_t> pool(seed);
    fill_uniform(q, pool, -1.0f, 1.0f);
    fill_uniform(k, pool, -1.0f, 1.0f);
    fill_uniform(v, pool, -1.0f, 1.0f);
    fill_uniform(gate, pool, -2.0f, 2.0f);
    weights = unit_weights(s);
    tau = weights.tau_window;
    Kokkos::fence();
  }

  /// The Trellis inputs for `slots` slots: alpha uniform [-1, 1), beta uniform [0.9, 1), gamma uniform
  /// [0, 0.1) (in range, so the memory's gate check can be off).
  void add_trellis(int slots, unsigned seed = 999) {
    const long B = long(k.extent(0)), H = long(k.extent(1)), T = long(k.extent(2));
    auto gates = [&](const char* name) { return view3(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(name)), B, H, T); };
    alpha = view4(Kokkos::view_alloc(Kokkos::WithoutInitializing, "alpha"), B, H, T, slots);
    beta1 = gates("beta1"), gamma1 = gates("gamma1"), beta2 = gates("beta2"), gamma2 = gates("gamma2");
    Kokkos::Random_XorShift64_Pool<exec_t> pool(seed);
    fill_uniform(alpha, pool, -1.0f, 1.0f);
    for (const auto& beta : {beta1, beta2}) fill_uniform(beta, pool, 0.9f, 1.0f);
    for (const auto& gamma : {gamma1, gamma2}) fill_uniform(gamma, pool, 0.0f, 0.1f);
    Kokkos::fence();
  }
};

/// Token t of a [B, H, T, C] or [B, H, T] input (any element type), as a view of one token.
template <class V>
auto token(const V& x, long t) {
  if constexpr (V::rank() == 3)
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(t, t + 1));
  else
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(t, t + 1), Kokkos::ALL);
}

/// Bytes of a full float32 KV cache of `tokens` tokens (what exact attention holds).
inline double kv_cache_bytes(const Shape& s, long tokens) {
  return double(s.B) * s.Hkv * double(tokens) * (2.0 * s.D) * sizeof(float);
}

// ---------------------------------------------------------------------------------------------------
// Work model: what a run computes and reads, per (sequence, kv-head), counted by each memory's model
// (bench/memories.hpp) from the same host-side schedule the memory follows, never measured. FLOPs count
// 2 per multiply-add of the dot products and matrix-vector products (q.k, p.v, scores, gradients);
// exponentials, LayerNorms, normalizations, read-cache refreshes and comparisons are not counted (O(D)
// per token or per row, not per pair). The formulas are written out in bench/README.md.

struct Work {
  double readout = 0;    // FLOPs of the readout, the G query heads of the kv-head together
  double update = 0;     // FLOPs outside the readout: merge, gradient steps, eviction scorer, row statistics
  double rows_read = 0;  // key/value rows (D + Dv floats each) the readout reads: state rows and window keys

  Work& operator+=(const Work& o) {
    readout += o.readout, update += o.update, rows_read += o.rows_read;
    return *this;
  }
  [[nodiscard]] double readout_flops(const Shape& s) const { return readout * s.Hkv * s.B; }
  [[nodiscard]] double update_flops(const Shape& s) const { return update * s.Hkv * s.B; }
  [[nodiscard]] double flops(const Shape& s) const { return readout_flops(s) + update_flops(s); }
  /// Bytes of the rows read, float32: the G query heads of a group read each row once.
  [[nodiscard]] double bytes_read(const Shape& s) const { return rows_read * (2.0 * s.D) * sizeof(float) * s.Hkv * s.B; }
};

/// Readout work of `queries` queries that read `pairs` (query, key) pairs in all: 2 (D + Dv) FLOPs per
/// pair and query head of the group (q.k and p.v).
inline Work attention_work(int D, int Dv, int G, double pairs) {
  Work w;
  w.readout = pairs * G * 2.0 * (D + Dv);
  w.rows_read = pairs;
  return w;
}

/// Exact causal attention over T tokens: T (T + 1) / 2 pairs per query head.
inline Work exact_prefill_work(const Shape& s, long T) {
  return attention_work(s.D, s.D, s.G, double(T) * (T + 1) / 2);
}

// ---------------------------------------------------------------------------------------------------
// Exact attention decode: one new token per sequence appended to a full KV cache, then its query read
// against every cached key by the library's exact attention at first_position = pos (the query blocks of
// the memories' decode readout: a kv-head's G query heads share one pass over its keys). Row `pos` of
// exact_causal_attention over the prompt, bit for bit.

/// A full KV cache of element type S (float32, or a storage type of kvmem/dtype.hpp).
template <class S>
struct KvCacheOf {
  Kokkos::View<S****, Kokkos::LayoutRight, space_t> k, v;  // [B, Hkv, capacity, D]
  mutable kvmem::kernels::DecodeSplitWork<space_t> work;   // split-KV decode's partials, kept between steps
  mutable kvmem::kernels::FlashInferWork<space_t, S> tensor_cores;  // the tensor-core path's buffers, likewise
};
using KvCache = KvCacheOf<float>;

/// Writes one token per sequence and kv-head (k1, v1 [B, Hkv, 1, D]) at position `pos` of the cache.
template <class S, class KV>
void append_token(const exec_t& exec, const KvCacheOf<S>& cache, const KV& k1, const KV& v1, long pos) {
  const long B = static_cast<long>(k1.extent(0)), Hkv = static_cast<long>(cache.k.extent(1));
  const int D = static_cast<int>(cache.k.extent(3)), Dv = static_cast<int>(cache.v.extent(3));
  const auto ck = cache.k, cv = cache.v;
  Kokkos::parallel_for(
      "bench::kv_append", Kokkos::RangePolicy<exec_t>(exec, 0, B * Hkv), KOKKOS_LAMBDA(long i) {
        const long b = i / Hkv, h = i % Hkv;
        for (int c = 0; c < D; ++c) ck(b, h, pos, c) = k1(b, h, 0, c);
        for (int c = 0; c < Dv; ++c) cv(b, h, pos, c) = v1(b, h, 0, c);
      });
}

/// The query of position `pos` (q1 [B, Hq, 1, D]) against the cache's positions [0, pos], into y1: the
/// attention call of an exact decode step, what bench/torch_sdpa.py times of PyTorch's.
/// `splits` schedules the step's key splits (kernels::DecodeSplits: split-KV where it has fewer teams than
/// threads, by default).
template <class S, class Q, class Y>
void exact_decode_attention(const exec_t& exec, const KvCacheOf<S>& cache, const Q& q1, const Y& y1, long pos,
                            const float* tau,
                            kvmem::kernels::DecodeSplits splits = kvmem::kernels::DecodeSplits::automatic) {
  kvmem::kernels::exact_causal_attention(exec, q1, cache.k, cache.v, y1, tau, pos, splits, cache.work,
                                         cache.tensor_cores, kvmem::kernels::ReadoutPath::automatic);
}

/// A whole exact decode step: append_token, then exact_decode_attention.
template <class S, class Q, class KV, class Y>
void exact_decode_step(const exec_t& exec, const KvCacheOf<S>& cache, const Q& q1, const KV& k1, const KV& v1,
                       const Y& y1, long pos, const float* tau) {
  append_token(exec, cache, k1, v1, pos);
  exact_decode_attention(exec, cache, q1, y1, pos, tau);
}

// ---------------------------------------------------------------------------------------------------
// Ceilings, measured once per run: OpenBLAS sgemm FLOP/s and a large copy's bandwidth, each on 1 thread
// and on all threads.

struct Ceilings {
  std::map<int, double> sgemm_flops;    // threads -> FLOP/s
  std::map<int, double> copy_bytes;     // threads -> bytes/s (bytes read + bytes written)
  [[nodiscard]] double sgemm(int threads) const { return sgemm_flops.at(threads); }
  [[nodiscard]] double copy(int threads) const { return copy_bytes.at(threads); }
};

inline Ceilings& ceilings() {
  static Ceilings c;
  return c;
}

/// Best of `reps` runs of C = A B with M = N = K = n (2 n^3 FLOPs); NaN where the benchmarks were built
/// without OpenBLAS (a GPU machine without it: the CPU's sgemm is no ceiling of a GPU kernel anyway).
inline double measure_sgemm([[maybe_unused]] int threads, [[maybe_unused]] long n = 2048,
                            [[maybe_unused]] int reps = 4) {
#if !KVMEM_BENCH_CBLAS
  return std::numeric_limits<double>::quiet_NaN();
#else
  openblas_set_num_threads(threads);
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (long i = 0; i < n * n; ++i) {
    a[i] = float((i * 7) % 13) / 13.0f - 0.5f;
    b[i] = float((i * 5) % 11) / 11.0f - 0.5f;
  }
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // the first run is a warm-up
    const auto t0 = clock_t_::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double t = seconds_since(t0);
    if (r > 0) best = std::min(best, t);
  }
  benchmark::DoNotOptimize(c.data());
  return 2.0 * double(n) * n * n / best;
#endif
}

/// Best of `reps` copies of a 256 MiB float array with a Kokkos parallel_for; bytes = 2 x 256 MiB
/// (read + write; the hardware also reads the destination lines it allocates, which is not counted).
inline double measure_copy(int threads, long floats = 64L << 20, int reps = 5) {
  const exec_t exec = make_exec(threads);
  view1 src(Kokkos::view_alloc(Kokkos::WithoutInitializing, "copy_src"), floats);
  view1 dst(Kokkos::view_alloc(Kokkos::WithoutInitializing, "copy_dst"), floats);
  Kokkos::parallel_for("bench::first_touch", Kokkos::RangePolicy<exec_t>(exec, 0, floats), KOKKOS_LAMBDA(long i) {
    src(i) = float(i & 1023);
    dst(i) = 0.0f;
  });
  exec.fence();
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = clock_t_::now();
    Kokkos::parallel_for("bench::copy", Kokkos::RangePolicy<exec_t>(exec, 0, floats),
                         KOKKOS_LAMBDA(long i) { dst(i) = src(i); });
    exec.fence();
    const double t = seconds_since(t0);
    if (r > 0) best = std::min(best, t);
  }
  return 2.0 * double(floats) * sizeof(float) / best;
}

/// Measures the ceilings on 1 thread and on all threads, prints them and records them in the JSON context.
inline void measure_ceilings() {
  auto& c = ceilings();
  const int all = all_threads();
  for (int t : {1, all}) {
    if (c.sgemm_flops.count(t)) continue;
    c.sgemm_flops[t] = measure_sgemm(t);
    c.copy_bytes[t] = measure_copy(t);
    const std::string th = std::to_string(t);
    benchmark::AddCustomContext("ceiling_sgemm_gflops_threads_" + th, std::to_string(c.sgemm_flops[t] / 1e9));
    benchmark::AddCustomContext("ceiling_copy_gbytes_per_s_threads_" + th, std::to_string(c.copy_bytes[t] / 1e9));
    std::fprintf(stderr, "[ceiling] threads=%d  OpenBLAS sgemm %.1f GFLOP/s  copy %.1f GB/s\n", t,
                 c.sgemm_flops[t] / 1e9, c.copy_bytes[t] / 1e9);
  }
#if KVMEM_BENCH_CBLAS
  openblas_set_num_threads(all);
#endif
  benchmark::AddCustomContext("kokkos_threads", std::to_string(all));
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  benchmark::AddCustomContext("OMP_WAIT_POLICY", wait_policy ? wait_policy : "(unset)");
  benchmark::AddCustomContext("nice", std::to_string(getpriority(PRIO_PROCESS, 0)));
}

/// Wall time per Kokkos kernel name, from the Kokkos Tools parallel_for callbacks. The OpenMP backend
/// runs a parallel_for to completion before it returns, so begin..end is the kernel's time. Used to
/// split a prefill into readout and update time (e.g. the readout's own GFLOP/s).
struct KernelClock {
  static std::map<std::string, double>& totals() {
    static std::map<std::string, double> t;
    return t;
  }
  static std::vector<std::pair<std::string, clock_t_::time_point>>& open() {
    static std::vector<std::pair<std::string, clock_t_::time_point>> o;
    return o;
  }
  static void begin(const char* name, const uint32_t, uint64_t* id) {
    *id = open().size();
    open().emplace_back(name, clock_t_::now());
  }
  static void end(uint64_t id) {
    auto& o = open();
    if (id >= o.size()) return;
    totals()[o[id].first] += seconds_since(o[id].second);
    o.resize(id);
  }
  static void install() {
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(&begin);
    Kokkos::Tools::Experimental::set_end_parallel_for_callback(&end);
  }
  static void reset() { totals().clear(); }
  /// With KVMEM_BENCH_KERNELS=1 in the environment, prints seconds per kernel name per iteration.
  static void report(const std::string& what, long iterations) {
    const char* e = std::getenv("KVMEM_BENCH_KERNELS");
    if (!e || std::string(e) != "1") return;
    std::fprintf(stderr, "[kernels] %s\n", what.c_str());
    for (const auto& [name, t] : totals())
      std::fprintf(stderr, "[kernels]   %-40s %10.3f ms\n", name.c_str(), 1e3 * t / iterations);
  }
  /// Seconds spent in kernels whose name starts with one of `prefixes`.
  static double seconds(const std::vector<std::string>& prefixes) {
    double s = 0;
    for (const auto& [name, t] : totals())
      for (const auto& prefix : prefixes)
        if (name.rfind(prefix, 0) == 0) {
          s += t;
          break;
        }
    return s;
  }
};

/// The name of the benchmark whose body runs now (register_benchmark sets it): Google Benchmark's own
/// State::name() needs 1.8, and Debian 12, where a GPU run's tree may be built, has 1.7.1.
inline std::string& running_benchmark() {
  static std::string name;
  return name;
}

/// benchmark::RegisterBenchmark for Google Benchmark 1.7 and later (the name passed as a C string, which it
/// copies: 1.7 has no std::string overload), with running_benchmark() set to `name` while `body` runs.
template <class Body>
benchmark::internal::Benchmark* register_benchmark(const std::string& name, Body body) {
  return benchmark::RegisterBenchmark(name.c_str(), [name, body](benchmark::State& st) {
    running_benchmark() = name;
    body(st);
  });
}

/// Time of exact attention per shape key, recorded by the exact benchmark for the memories that follow
/// it in the same run (registration order = run order).
inline std::map<std::string, double>& exact_seconds() {
  static std::map<std::string, double> m;
  return m;
}

/// Strips `--name=value` from argv (before benchmark::Initialize sees it); returns value or `fallback`.
inline std::string take_flag(int& argc, char** argv, const std::string& name, const std::string& fallback) {
  std::string value = fallback;
  const std::string prefix = "--" + name + "=";
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(prefix, 0) == 0) value = a.substr(prefix.size());
    else argv[out++] = argv[i];
  }
  argc = out;
  return value;
}

/// The main() of a benchmark program around Kokkos and Google Benchmark: `register_grid(grid)` registers
/// the benchmarks of `grid` (after the machine's ceilings are measured and the kernel clock installed, when
/// `ceilings` is set) and Google Benchmark runs them; `context` pairs go to its JSON context. Returns the
/// exit status: 1 for an argument Google Benchmark does not know.
template <class Register>
int benchmark_main(int argc, char** argv, const std::string& grid, bool ceilings, Register register_grid,
                   const std::map<std::string, std::string>& context = {}) {
  Kokkos::initialize(argc, argv);
  int status = 0;
  {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
      status = 1;
    } else {
      if (ceilings) {
        KernelClock::install();
        measure_ceilings();
      }
      benchmark::AddCustomContext("kvmem_grid", grid);
      for (const auto& [key, value] : context) benchmark::AddCustomContext(key, value);
      register_grid(grid);
      benchmark::RunSpecifiedBenchmarks();
      benchmark::Shutdown();
    }
    release_execs();
  }
  Kokkos::finalize();
  return status;
}

}  // namespace kvbench
