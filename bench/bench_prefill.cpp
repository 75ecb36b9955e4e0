// kvmem_bench_prefill: prefill of every memory (KVM fixed 256 rows and power-law 16 sqrt(N), KVM with H2O
// row eviction, OVQ, Trellis, fixed-budget eviction with each scorer; bench/memories.hpp) against exact
// causal attention and the naive float64 reference of the tests, in one process.
//
//   kvmem_bench_prefill [--grid=standard|quick|full|gpu] [Google Benchmark flags, e.g.
//                       --benchmark_out=prefill.json --benchmark_min_time=0.2s --benchmark_filter=...]
//
// Benchmarks are named prefill/<memory>/T:<tokens>/D:<head_dim>/G:<GQA group>/B:<batch>/Hkv:<kv-heads>/
// threads:<OpenMP threads>. For each shape exact attention runs first; the memories after it report
// speedup_vs_exact against that time. Counters are defined in bench/README.md.

#include "memories.hpp"

#include <utility>

#include "reference/kvm_reference.hpp"

namespace {

using namespace kvbench;

std::map<std::string, double>& kvm_fixed_seconds() {
  static std::map<std::string, double> m;
  return m;
}

/// Times of the iterations of one benchmark: the fastest is reported (time slices lost to other jobs on
/// a shared machine only ever add time); per-kernel totals over all iterations are scaled to it.
struct Timer {
  double best = 1e300, total = 0;
  long count = 0;
  void add(double t) {
    best = std::min(best, t);
    total += t;
    ++count;
  }
  [[nodiscard]] double scaled(double kernel_total) const { return kernel_total / count * (best / (total / count)); }
};

void set_counters(benchmark::State& st, const Shape& s, double readout_flops, double update_flops, double sec,
                  double readout_sec, double held) {
  using benchmark::Counter;
  const double flops = readout_flops + update_flops;
  const double sgemm = ceilings().sgemm(s.threads);
  st.counters["tokens/s"] = Counter(double(s.B) * s.T, Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = Counter(flops / 1e9, Counter::kIsIterationInvariantRate);
  st.counters["GFLOP"] = flops / 1e9;
  st.counters["update_GFLOP"] = update_flops / 1e9;
  st.counters["frac_sgemm"] = flops / sec / sgemm;
  if (readout_sec > 0) {
    st.counters["readout_GFLOP/s"] = readout_flops / readout_sec / 1e9;
    st.counters["readout_frac_sgemm"] = readout_flops / readout_sec / sgemm;
    st.counters["readout_share"] = readout_sec / sec;
  }
  st.counters["bytes_held"] = held;
  st.counters["held_vs_kv_cache"] = held / kv_cache_bytes(s, s.T);
  const auto it = exact_seconds().find(s.key());
  if (it != exact_seconds().end()) st.counters["speedup_vs_exact"] = it->second / sec;
  st.counters["seconds"] = sec;
}

void bm_exact(benchmark::State& st, Shape s) {
  const exec_t exec = make_exec(s.threads);
  Inputs in(s, s.T);
  const Work w = exact_prefill_work(s, s.T);
  Timer timer;
  KernelClock::reset();
  for (auto _ : st) {
    const auto t0 = clock_t_::now();
    kvmem::kernels::exact_causal_attention(exec, in.q, in.k, in.v, in.y, in.tau.data());
    exec.fence();
    timer.add(seconds_since(t0));
  }
  const double sec = timer.best;
  exact_seconds()[s.key()] = sec;
  set_counters(st, s, w.readout_flops(s), 0.0, sec, timer.scaled(KernelClock::seconds({"kvmem::exact_causal_attention"})),
               kv_cache_bytes(s, s.T));
}

/// Prefill of the memory `make` builds (memories.hpp) into an empty memory, repeated; `record`: its time
/// is the one the reference is compared with.
template <class Make>
void bm_memory(benchmark::State& st, Shape s, Make make, bool record) {
  const exec_t exec = make_exec(s.threads);
  auto mem = make(s, exec);
  Inputs in(s, s.T);
  mem.prepare(in);
  Timer timer;
  KernelClock::reset();
  for (auto _ : st) {
    const auto t0 = clock_t_::now();
    mem.reset();
    mem.prefill(in);
    timer.add(seconds_since(t0));
  }
  const double sec = timer.best;
  KernelClock::report(running_benchmark(), timer.count);
  if (record) kvm_fixed_seconds()[s.key()] = sec;
  const Work w = mem.model.prefill(s.T);
  set_counters(st, s, w.readout_flops(s), w.update_flops(s), sec, timer.scaled(KernelClock::seconds(mem.readout_kernels())),
               double(mem.held_bytes()));
  if (!mem.update_kernels().empty())
    st.counters["update_share"] = timer.scaled(KernelClock::seconds(mem.update_kernels())) / sec;
  st.counters["state_rows"] = double(mem.rows());
  check_model(st, mem);
}

/// The naive float64 reference of the tests (tests/reference/kvm_reference.hpp), fixed 256 rows, one
/// sequence, one thread.
void bm_reference(benchmark::State& st, Shape s) {
  Inputs in(s, s.T);
  auto q = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), in.q);
  auto k = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), in.k);
  auto v = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), in.v);
  auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), in.gate);
  kvmem_ref::KvmSequence seq;
  seq.T = s.T, seq.D = s.D, seq.Dv = s.D, seq.Hq = s.Hq(), seq.Hkv = s.Hkv;
  seq.q.assign(q.data(), q.data() + q.size());
  seq.k.assign(k.data(), k.data() + k.size());
  seq.v.assign(v.data(), v.data() + v.size());
  seq.gate.assign(g.data(), g.data() + g.size());
  seq.ln_weight.assign(s.D, 1.0);
  seq.ln_bias.assign(s.D, 0.0);
  seq.tau_state.assign(s.Hq(), 1.0);
  seq.tau_bswa.assign(s.Hq(), 1.0);
  const auto cfg = memory_config(s);
  kvmem_ref::KvmParams p;
  p.chunk = cfg.chunk, p.window_chunks = cfg.window_chunks, p.rope_dims = cfg.rope_dims, p.sinks = cfg.sinks;
  p.schedule = kvmem_ref::Schedule::fixed, p.min_len = 256, p.max_chunks = cfg.max_rows / cfg.chunk;
  const Work w = MergingModel<kvmem::merge::WinnerTakeAll, kvmem::budget::Fixed, kvmem::score::KeepRows>(cfg, fixed256(), {})
                     .prefill(s.T);
  Timer timer;
  double held = 0;
  for (auto _ : st) {
    const auto t0 = clock_t_::now();
    auto r = kvmem_ref::kvm_prefill(seq, p);
    benchmark::DoNotOptimize(r.y.data());
    timer.add(seconds_since(t0));
    held = double(r.rows + std::min(s.T, cfg.window())) * s.Hkv * (2 * s.D + 1) * sizeof(double);
  }
  const double sec = timer.best;
  set_counters(st, s, w.readout_flops(s), w.update_flops(s), sec, 0.0, held);
  const auto it = kvm_fixed_seconds().find(s.key());
  if (it != kvm_fixed_seconds().end()) st.counters["slowdown_vs_kvmem"] = sec / it->second;
}

void add(const std::string& memory, const Shape& s, std::function<void(benchmark::State&)> fn) {
  register_benchmark("prefill/" + memory + "/" + s.key(), fn)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

/// Exact attention, then the memories, then the reference, for one shape: the `series` bits
/// (memories.hpp).
void add_shape(Shape s, unsigned series) {
  if (s.threads == 0) s.threads = all_threads();
  if (series & kExact) add("exact", s, [s](benchmark::State& st) { bm_exact(st, s); });
  memory_series(
      [&](const std::string& name, auto make) {
        add(name, s, [s, make, record = name == "kvm-fixed256"](benchmark::State& st) { bm_memory(st, s, make, record); });
      },
      series, s);
  if (series & kReference) add("reference-fixed256", s, [s](benchmark::State& st) { bm_reference(st, s); });
}

void register_grid(const std::string& grid) {
  const int all = all_threads();
  constexpr unsigned kvm = kExact | kKvmFixed | kKvmPowerLaw, others = kKvmH2oRows | kOvq | kTrellis;
  if (grid == "quick") {  // a smoke test: under a minute
    for (long T : {1024L, 4096L}) add_shape({T, 64, 1, 1, 1, all}, kvm | others | kEvictAll | (T == 1024 ? kReference : 0u));
    add_shape({1024, 64, 4, 2, 2, all}, kvm | others | kEvictAll);  // GQA and a batch
    add_shape({4096, 64, 1, 1, 1, 1}, kExact | kKvmFixed);
    return;
  }
  if (grid == "gpu") {  // scripts/gpu-check: the engines' shape (Hq = 32, Hkv = 8, D = 128, B = 8) on one GPU
    for (long T : {4096L, 16384L, 65536L, 131072L})
      add_shape({T, 128, 4, 8, 8, all}, kKvmFixed | (T <= 16384 ? kExact | kKvmPowerLaw | kOvq | kEvictH2o : 0u));
    return;
  }
  if (grid == "full") {  // the whole grid; exact attention at 64K takes hours on 2 cores
    for (int D : {64, 128})
      for (int G : {1, 4})
        for (int B : {1, 8})
          for (long T : {1024L, 4096L, 16384L, 65536L}) add_shape({T, D, G, B, 8, all}, kvm | others | kEvictAll);
    return;
  }
  // standard (bench/README.md).
  // 1. scaling in T with one kv-head, G = 1, B = 1: every memory against exact attention. With D = 128,
  //    exact attention and the power-law memory stop at T = 16K (at 64K they take 40 to 80 s each here);
  //    the other memories run with D = 64, eviction with scorers other than H2O up to T = 16K (its
  //    prefill is a per-token state machine, one thread per (sequence, kv-head): seconds at 64K).
  for (int D : {64, 128})
    for (long T : {1024L, 4096L, 16384L, 65536L}) {
      unsigned series = kKvmFixed;
      if (D == 64 || T <= 16384) series |= kExact | kKvmPowerLaw;
      if (D == 64) series |= others | kEvictH2o | (T <= 16384 ? kEvictOthers : 0u) | (T == 1024 ? kReference : 0u);
      add_shape({T, D, 1, 1, 1, all}, series);
    }
  // 2. the shape (8 kv-heads) at T = 4K: D in {64, 128} x (G, B) in {(1, 1), (4, 1), (1, 8)};
  //    the power-law memory with B = 1 only (B = 8 takes 15 to 35 s); the other memories with D = 128
  //    and G = B = 1 (eviction with the H2O scorer), OVQ also with G = 4 (with G = 4, KVM with H2O row
  //    eviction and H2O eviction take 10 to 25 s each here: their attention statistics cost G times).
  for (int D : {64, 128})
    for (auto [G, B] : {std::pair{1, 1}, std::pair{4, 1}, std::pair{1, 8}}) {
      unsigned series = kExact | kKvmFixed | (B == 1 ? kKvmPowerLaw : 0u);
      if (D == 128 && B == 1) series |= G == 1 ? others | kEvictH2o : kOvq;
      add_shape({4096, D, G, B, 8, all}, series);
    }
  // 3. one thread against all threads.
  if (all > 1)
    for (int threads : {1, all}) add_shape({8192, 64, 1, 1, 2, threads}, kExact | kKvmFixed);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string grid = kvbench::take_flag(argc, argv, "grid", "standard");
  return kvbench::benchmark_main(argc, argv, grid, /*ceilings=*/true, register_grid);
}
