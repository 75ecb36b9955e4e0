// kvmem_bench_decode: decode step time of every memory (KVM fixed 256 rows and power-law 16 sqrt(N), KVM
// with H2O row eviction, OVQ, Trellis, fixed-budget eviction with each scorer; bench/memories.hpp) at a
// position P, against an exact-attention decode step over a full KV cache of P tokens, in one process.
//
//   kvmem_bench_decode [--grid=standard|quick|gpu] [--steps=512] [Google Benchmark flags]
//
// A memory's state at position P is built by prefilling P tokens (not timed); then 3 windows of `steps`
// decode steps (a multiple of the chunk, so each window holds the same number of block folds, one every
// 256 tokens in KVM) are timed step by step, each step a Google Benchmark iteration; the counters report the
// fastest window's mean step. The exact baseline's KV cache is filled with random keys and values
// (building it costs nothing), then each step appends a token (not timed: PyTorch's step in
// bench/torch_sdpa.py is the attention call alone) and reads all P + 1 keys (windows of 16).
//
// Names: decode/<memory>/pos:<P>/D:<head_dim>/G:<GQA group>/B:<batch>/Hkv:<kv-heads>/threads:<threads>.

#include "memories.hpp"

#include <utility>

namespace {

using namespace kvbench;

long g_steps = 512;
/// Windows of steps timed per benchmark (the fastest window is reported).
constexpr int kWindows = 3;

struct Key {
  static std::string of(const Shape& s, long pos) { return "pos:" + std::to_string(pos) + "/" + s.key(); }
};

std::map<std::string, double>& exact_step_seconds() {
  static std::map<std::string, double> m;
  return m;
}
/// Step time at the first position measured per (memory, shape), for the ratio against position.
std::map<std::string, std::pair<long, double>>& first_position() {
  static std::map<std::string, std::pair<long, double>> m;
  return m;
}

void set_counters(benchmark::State& st, const std::string& memory, const Shape& s, long pos, const Work& w,
                  long step_count, double step_sec, double readout_sec, double held) {
  using benchmark::Counter;
  const double steps = double(step_count);
  const double flops = w.flops(s) / steps;
  const double bytes = w.bytes_read(s) / steps;
  st.counters["step_us"] = step_sec * 1e6;
  st.counters["tokens/s"] = Counter(double(s.B), Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = Counter(flops / 1e9, Counter::kIsIterationInvariantRate);
  st.counters["bytes_read"] = bytes;
  st.counters["GB/s"] = bytes / step_sec / 1e9;
  st.counters["frac_copy_bw"] = bytes / step_sec / ceilings().copy(s.threads);
  if (readout_sec > 0) {
    st.counters["readout_share"] = readout_sec / step_sec;
    st.counters["readout_frac_copy_bw"] = bytes / readout_sec / ceilings().copy(s.threads);
  }
  st.counters["bytes_held"] = held;
  st.counters["held_vs_kv_cache"] = held / kv_cache_bytes(s, pos);
  const auto e = exact_step_seconds().find(Key::of(s, pos));
  if (e != exact_step_seconds().end()) st.counters["speedup_vs_exact"] = e->second / step_sec;
  auto [it, fresh] = first_position().try_emplace(memory + "/" + s.key(), pos, step_sec);
  if (!fresh) {
    st.counters["vs_first_pos"] = step_sec / it->second.second;
    st.counters["first_pos"] = double(it->second.first);
  }
}

/// Step times of `windows` consecutive windows of `steps` steps; the fastest window's mean is reported
/// (time slices lost to other jobs on a shared machine only ever add time).
struct Windows {
  long steps;
  std::vector<double> sum;
  Windows(long steps_per_window, int windows) : steps(steps_per_window), sum(windows, 0.0) {}
  void add(long step, double sec) { sum[step / steps] += sec; }
  [[nodiscard]] int best() const { return int(std::min_element(sum.begin(), sum.end()) - sum.begin()); }
  [[nodiscard]] double step_seconds() const { return sum[best()] / steps; }
  [[nodiscard]] double mean_step_seconds() const {
    double t = 0;
    for (double x : sum) t += x;
    return t / (steps * double(sum.size()));
  }
};

/// Exact decode steps at position `pos`: `name` "exact" (DecodeSplits::automatic: split-KV where the step
/// has fewer teams than threads) or "exact-unsplit" (DecodeSplits::never: one team per kv-head, the schedule
/// before split-KV decode), in the same process.
void bm_exact(benchmark::State& st, Shape s, long pos, long steps, const std::string& name = "exact",
              kvmem::kernels::DecodeSplits splits = kvmem::kernels::DecodeSplits::automatic) {
  const exec_t exec = make_exec(s.threads);
  const long total_steps = kWindows * steps;
  Inputs in(s, total_steps);
  KvCache cache{view4(Kokkos::view_alloc(Kokkos::WithoutInitializing, "cache_k"), s.B, s.Hkv, pos + total_steps, s.D),
                view4(Kokkos::view_alloc(Kokkos::WithoutInitializing, "cache_v"), s.B, s.Hkv, pos + total_steps, s.D),
                {}, {}};
  Kokkos::Random_XorShift64_Pool<exec_t> pool(777);
  fill_uniform(cache.k, pool, -1.0f, 1.0f);
  fill_uniform(cache.v, pool, -1.0f, 1.0f);
  Kokkos::fence();
  Windows win(steps, kWindows);
  long i = 0;
  KernelClock::reset();
  for (auto _ : st) {
    // The token's append is not timed: PyTorch's step (bench/torch_sdpa.py) times the attention call alone.
    st.PauseTiming();
    append_token(exec, cache, token(in.k, i), token(in.v, i), pos + i);
    exec.fence();
    st.ResumeTiming();
    const auto t0 = clock_t_::now();
    exact_decode_attention(exec, cache, token(in.q, i), token(in.y, i), pos + i, in.tau.data(), splits);
    exec.fence();
    win.add(i, seconds_since(t0));
    ++i;
  }
  Work w;
  for (long j = win.best() * steps; j < (win.best() + 1) * steps; ++j) w += attention_work(s.D, s.D, s.G, double(pos + j + 1));
  const double sec = win.step_seconds();
  if (name == "exact") exact_step_seconds()[Key::of(s, pos)] = sec;
  const double kernel_sec = KernelClock::seconds({"kvmem::exact_causal_attention", "kvmem::exact_decode"});
  set_counters(st, name, s, pos, w, steps, sec, kernel_sec / i * sec / win.mean_step_seconds(), kv_cache_bytes(s, pos));
  st.counters["mean_step_us"] = win.mean_step_seconds() * 1e6;
}

/// Decode steps of the memory `make` builds (memories.hpp), from the state a prefill of `pos` tokens
/// leaves (not timed).
template <class Make>
void bm_memory(benchmark::State& st, const std::string& memory, Shape s, long pos, Make make) {
  const exec_t exec = make_exec(s.threads);
  auto mem = make(s, exec);
  {  // build the state at `pos` by prefill (not timed)
    Inputs prompt(s, pos);
    mem.prepare(prompt);
    mem.prefill(prompt);
    mem.model.prefill(pos);
  }
  Inputs in(s, kWindows * g_steps, 4321);
  mem.prepare(in);
  Windows win(g_steps, kWindows);
  long i = 0;
  KernelClock::reset();
  for (auto _ : st) {
    const auto t0 = clock_t_::now();
    mem.decode(in, i);
    win.add(i, seconds_since(t0));
    ++i;
  }
  std::vector<Work> work(kWindows);
  for (long j = 0; j < i; ++j) work[j / g_steps] += mem.model.step();
  const double sec = win.step_seconds(), scale = sec / win.mean_step_seconds();
  KernelClock::report(running_benchmark(), i);
  set_counters(st, memory, s, pos, work[win.best()], g_steps, sec,
               KernelClock::seconds(mem.readout_kernels()) / i * scale, double(mem.held_bytes()));
  st.counters["state_rows"] = double(mem.rows());
  if (!mem.update_kernels().empty())
    st.counters["update_share"] = KernelClock::seconds(mem.update_kernels()) / i * scale / sec;
  st.counters["mean_step_us"] = win.mean_step_seconds() * 1e6;
  check_model(st, mem);
}

void add(const std::string& memory, const Shape& s, long pos, long steps, std::function<void(benchmark::State&)> fn) {
  register_benchmark("decode/" + memory + "/" + Key::of(s, pos), fn)
      ->UseRealTime()
      ->Iterations(kWindows * steps)
      ->Unit(benchmark::kMicrosecond);
}

/// Exact attention, then the memories, at position `pos` of one shape: the `series` bits (memories.hpp).
void add_position(Shape s, long pos, unsigned series) {
  if (s.threads == 0) s.threads = all_threads();
  // Exact decode costs the same at every step (no folds): shorter windows suffice.
  const long exact_steps = std::min<long>(g_steps, 16);
  if (series & kExact)
    add("exact", s, pos, exact_steps, [s, pos, exact_steps](benchmark::State& st) { bm_exact(st, s, pos, exact_steps); });
  if (series & kExactUnsplit)
    add("exact-unsplit", s, pos, exact_steps, [s, pos, exact_steps](benchmark::State& st) {
      bm_exact(st, s, pos, exact_steps, "exact-unsplit", kvmem::kernels::DecodeSplits::never);
    });
  memory_series(
      [&](const std::string& name, auto make) {
        add(name, s, pos, g_steps, [name, s, pos, make](benchmark::State& st) { bm_memory(st, name, s, pos, make); });
      },
      series, s);
}

void register_grid(const std::string& grid) {
  const int all = all_threads();
  constexpr unsigned others = kKvmH2oRows | kOvq | kTrellis;
  if (grid == "quick") {
    for (long pos : {4096L, 16384L})
      add_position({0, 64, 1, 1, 2, all}, pos, kExact | kKvmFixed | kKvmPowerLaw | others | kEvictAll);
    add_position({0, 64, 4, 2, 2, all}, 4096, kExact | kKvmFixed | others | kEvictAll);  // GQA and a batch
    add_position({0, 64, 1, 1, 2, 1}, 4096, kExact | kKvmFixed);
    return;
  }
  if (grid == "gpu") {  // scripts/gpu-check: the engines' shape (Hq = 32, Hkv = 8, D = 128, B = 8) on one GPU
    // At 16K also every other memory with GQA (Trellis has none), for the per-kernel profile of one
    // decode step of each (issue 42).
    for (long pos : {4096L, 16384L, 65536L, 131072L, 262144L}) {
      unsigned series = kExact | kExactUnsplit | kKvmFixed | (pos <= 16384 ? kEvictH2o : 0u);
      if (pos == 16384) series |= kKvmPowerLaw | kKvmH2oRows | kOvq;
      add_position({0, 128, 4, 8, 8, all}, pos, series);
    }
    return;
  }
  // standard (bench/README.md).
  // 1. step time against position, 2 kv-heads, G = 1, B = 1, D = 128 (fixed-256 up to 256K, power-law
  //    up to 64K: prefilling its state further would take minutes; the other memories up to 16K and
  //    eviction with H2O also at 64K: building their state takes seconds per 16K tokens, eviction's
  //    prefill being a per-token state machine).
  for (long pos : {4096L, 16384L, 65536L, 262144L}) {
    unsigned series = kExact | kKvmFixed | (pos <= 65536 ? kKvmPowerLaw : 0u);
    if (pos <= 16384) series |= others | kEvictAll;
    else if (pos <= 65536) series |= kEvictH2o;
    add_position({0, 128, 1, 1, 2, all}, pos, series);
  }
  // 2. the shape (8 kv-heads) at position 4K, D = 128: (G, B) in {(1, 1), (4, 1), (1, 8)}
  //    (the power-law memory with B = 1 only: prefilling B = 8 of it takes half a minute; the other
  //    memories, eviction with the H2O scorer, with G = B = 1, OVQ also with G = 4: building the state
  //    of the others with G = 4 takes 20 to 25 s each here).
  for (auto [G, B] : {std::pair{1, 1}, std::pair{4, 1}, std::pair{1, 8}}) {
    unsigned series = kExact | kKvmFixed;
    if (B == 1) series |= kKvmPowerLaw | (G == 1 ? others | kEvictH2o : kOvq);
    add_position({0, 128, G, B, 8, all}, 4096, series);
  }
  // 3. one thread against all threads.
  if (all > 1)
    for (int threads : {1, all}) add_position({0, 128, 1, 1, 4, threads}, 4096, kExact | kKvmFixed);
  // 4. split-KV decode: one kv-head, fewer teams than threads, so `exact` runs its keys split over the threads;
  //    exact-unsplit is the one-team schedule in the same process.
  if (all > 1)
    for (long pos : {4096L, 16384L, 65536L, 262144L}) add_position({0, 128, 1, 1, 1, all}, pos, kExact | kExactUnsplit);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string grid = kvbench::take_flag(argc, argv, "grid", "standard");
  g_steps = std::stol(kvbench::take_flag(argc, argv, "steps", "512"));
  return kvbench::benchmark_main(argc, argv, grid, /*ceilings=*/true, register_grid,
                                 {{"decode_steps_per_benchmark", std::to_string(g_steps)}});
}
