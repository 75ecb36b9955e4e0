// kvmem_bench_dtype: the storage types against each other in one process (issue 17): a decode step at
// position P (4096) and a prefill of T (2048) tokens of exact attention, KVM fixed-256 and H2O eviction (budget 256), with
// tokens held in float32, bfloat16 and float16, on the engines' shape B = 8, Hkv = 8, D = 128 (G = 1; the gpu
// grid: G = 4, position and T 16K). Where the build runs 16-bit readouts on tensor cores (kvmem::flashinfer),
// kvm-fixed256-portable is KVM with the portable readout, in the same process.
//
//   kvmem_bench_dtype [--grid=standard|quick|gpu] [--steps=64] [--batch=8] [--position=P] [Google Benchmark
//                     flags, e.g. --benchmark_out=dtype.json --benchmark_out_format=json]
//
// --batch sets B (sequences) and --position the decode position (default: the grid's), e.g. --batch=128
// --position=1024 --benchmark_filter=decode/kvm for a KVM state (740 MB in float32) larger than a server's
// last-level cache, the case where a decode step streams its state from memory.
//
// Names: dtype/<decode|prefill>/<memory>/<F32|BF16|F16>/<pos:P | T:T>/D:.../threads:N. Every memory's
// float32 row runs first; the 16-bit rows report vs_f32 = their time / the float32 time (decode: the mean
// step; prefill: the fastest repetition) and held_vs_f32 = their bytes held / the float32 bytes held. A
// memory's state at position P is built by a prefill of P tokens (not timed). The 16-bit inputs are the
// float32 inputs rounded (kvmem::from_float), so each row computes the same attention.

#include "memories.hpp"

#include <kvmem/dtype.hpp>
#include <kvmem/memory_concept.hpp>

#include <cstdio>

namespace {

using namespace kvbench;

long g_steps = 64;
long g_batch = 8;      // B of the shape (--batch)
long g_position = 0;   // decode position (--position; 0: the grid's)

template <class S>
using tokens4 = Kokkos::View<S****, Kokkos::LayoutRight, space_t>;
template <class S>
using tokens3 = Kokkos::View<S***, Kokkos::LayoutRight, space_t>;

/// A rank-3 or rank-4 view of S like View.
template <class S, class View>
using stored_view = Kokkos::View<std::conditional_t<View::rank() == 4, S****, S***>, Kokkos::LayoutRight, space_t>;

/// `from` rounded to the storage type S, a new view of the same extents (the return type spelled out: nvcc's
/// extended lambdas need a parent without a deduced one).
template <class S, class View>
stored_view<S, View> stored_as(const View& from) {
  stored_view<S, View> to(Kokkos::view_alloc(Kokkos::WithoutInitializing, from.label()), from.layout());
  const float* src = from.data();
  S* dst = to.data();
  Kokkos::parallel_for("bench::to_storage", Kokkos::RangePolicy<exec_t>(0, long(from.span())),
                       KOKKOS_LAMBDA(long i) { dst[i] = kvmem::from_float<S>(src[i]); });
  Kokkos::fence();
  return to;
}

/// The benchmark's random inputs (common.hpp Inputs) in the storage type S.
template <class S>
struct TypedInputs {
  tokens4<S> q, k, v, y;
  tokens3<S> gate;
  kvmem::LayerWeights<space_t> weights;
  explicit TypedInputs(const Inputs& in)
      : q(stored_as<S>(in.q)), k(stored_as<S>(in.k)), v(stored_as<S>(in.v)), y(stored_as<S>(in.y)),
        gate(stored_as<S>(in.gate)), weights(in.weights) {}
};

/// Float32 time and bytes held of each (phase, memory, shape): the 16-bit rows' reference.
std::map<std::string, std::pair<double, double>>& f32_rows() {
  static std::map<std::string, std::pair<double, double>> m;
  return m;
}

template <class S>
void set_counters(benchmark::State& st, const std::string& row, double sec, double held) {
  st.counters["seconds"] = sec;
  st.counters["bytes_held"] = held;
  if constexpr (std::is_same_v<S, float>) {
    f32_rows()[row] = {sec, held};
  } else {
    const auto it = f32_rows().find(row);
    if (it != f32_rows().end()) {
      st.counters["vs_f32"] = sec / it->second.first;
      st.counters["held_vs_f32"] = held / it->second.second;
    }
  }
}

/// The three memories of the comparison over storage type S: run(decode?) builds, fills and times one.
template <class S>
struct Exact {
  static constexpr const char* name = "exact";
  tokens4<S> ck, cv;  // the full KV cache, [B, Hkv, capacity, D]
  kvmem::kernels::DecodeSplitWork<space_t> split_work;  // split-KV decode's partials, kept between steps
  kvmem::kernels::FlashInferWork<space_t, S> tensor_cores;  // the tensor-core path's buffers, likewise
  Exact(const Shape& s, long capacity, const exec_t&)
      : ck(Kokkos::view_alloc(Kokkos::WithoutInitializing, "cache_k"), s.B, s.Hkv, capacity, s.D),
        cv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "cache_v"), s.B, s.Hkv, capacity, s.D) {}
  void prefill(const exec_t& exec, const TypedInputs<S>& in) {
    kvmem::kernels::exact_causal_attention(exec, in.q, in.k, in.v, in.y, in.weights.tau_window.data(), 0,
                                           kvmem::kernels::DecodeSplits::automatic, split_work, tensor_cores,
                                           kvmem::kernels::ReadoutPath::automatic);
  }
  /// Fills the cache's first `pos` tokens from `in` (rounded random tokens), as a prefill would leave it.
  void build(const exec_t& exec, const TypedInputs<S>& in, long pos) {
    using range = std::pair<long, long>;
    Kokkos::deep_copy(exec, Kokkos::subview(ck, Kokkos::ALL, Kokkos::ALL, range(0, pos), Kokkos::ALL), in.k);
    Kokkos::deep_copy(exec, Kokkos::subview(cv, Kokkos::ALL, Kokkos::ALL, range(0, pos), Kokkos::ALL), in.v);
  }
  void decode(const exec_t& exec, const TypedInputs<S>& in, long i, long pos) {
    const KvCacheOf<S> cache{ck, cv, split_work, tensor_cores};
    exact_decode_step(exec, cache, token(in.q, i), token(in.k, i), token(in.v, i), token(in.y, i), pos + i,
                      in.weights.tau_window.data());
    split_work = cache.work;  // the buffers it grew, for the next step
    tensor_cores = cache.tensor_cores;
  }
  [[nodiscard]] double held(const Shape& s, long tokens) const { return kv_cache_bytes(s, tokens) * sizeof(S) / sizeof(float); }
};

/// A kvmem memory M of storage type S driven through the one memory contract (kvmem::AttentionMemory):
/// Family (KvmFixed, EvictH2o) gives the memory and `inputs_of`, the typed inputs as M::inputs.
template <class S, kvmem::AttentionMemory M, class Family>
struct ContractRow {
  M mem;
  void prefill(const exec_t&, const TypedInputs<S>& in) {
    mem.reset();
    mem.prefill(Family::inputs_of(in), in.y);
  }
  void build(const exec_t& exec, const TypedInputs<S>& in, long) { prefill(exec, in); }
  void decode(const exec_t&, const TypedInputs<S>& in, long i, long) {
    mem.decode(Family::inputs_of(in).token(i), token(in.y, i));
  }
  [[nodiscard]] double held(const Shape&, long) const { return double(mem.held_bytes()); }
};

template <class S>
using KvmFixedMemory = kvmem::KvmMemory<exec_t, kvmem::budget::Fixed, S>;
template <class S>
struct KvmFixed : ContractRow<S, KvmFixedMemory<S>, KvmFixed<S>> {
  using M = KvmFixedMemory<S>;
  static constexpr const char* name = "kvm-fixed256";
  KvmFixed(const Shape& s, long, const exec_t& exec)
      : ContractRow<S, M, KvmFixed>{M(memory_config(s), fixed256(), unit_weights(s), s.B, exec)} {}
  static typename M::inputs inputs_of(const TypedInputs<S>& in) { return {in.q, in.k, in.v, in.gate}; }
};

/// KVM fixed-256 with the portable readout asked for (Memory::set_readout_path): beside kvm-fixed256, whose
/// 16-bit rows run the readout on tensor cores where the build has it (kvmem::flashinfer on a GPU), the
/// tensor cores' gain in the same process. Registered only where that path is built.
template <class S>
struct KvmFixedPortable : ContractRow<S, KvmFixedMemory<S>, KvmFixedPortable<S>> {
  using M = KvmFixedMemory<S>;
  static constexpr const char* name = "kvm-fixed256-portable";
  KvmFixedPortable(const Shape& s, long, const exec_t& exec)
      : ContractRow<S, M, KvmFixedPortable>{M(memory_config(s), fixed256(), unit_weights(s), s.B, exec)} {
    this->mem.set_readout_path(kvmem::kernels::ReadoutPath::portable);
  }
  static typename M::inputs inputs_of(const TypedInputs<S>& in) { return {in.q, in.k, in.v, in.gate}; }
};

template <class S>
using EvictH2oMemory = kvmem::EvictionMemory<exec_t, kvmem::score::AccumulatedAttention, S>;
template <class S>
struct EvictH2o : ContractRow<S, EvictH2oMemory<S>, EvictH2o<S>> {
  using M = EvictH2oMemory<S>;
  static constexpr const char* name = "evict-h2o256";
  EvictH2o(const Shape& s, long, const exec_t& exec) : ContractRow<S, M, EvictH2o>{M(eviction_config(s), s.B, {}, exec)} {}
  static typename M::inputs inputs_of(const TypedInputs<S>& in) { return {in.q, in.k, in.v}; }
};

template <template <class> class Memory, class S>
void bm_prefill(benchmark::State& st, const std::string& row, Shape s) {
  const exec_t exec = make_exec(s.threads);
  const Inputs f32(s, s.T);
  const TypedInputs<S> in(f32);
  Memory<S> mem(s, s.T, exec);
  double best = 1e300;
  for (auto _ : st) {
    const auto t0 = clock_t_::now();
    mem.prefill(exec, in);
    exec.fence();
    best = std::min(best, seconds_since(t0));
  }
  set_counters<S>(st, row, best, mem.held(s, s.T));
  st.counters["tokens/s"] = double(s.B) * s.T / best;
}

template <template <class> class Memory, class S>
void bm_decode(benchmark::State& st, const std::string& row, Shape s, long pos) {
  const exec_t exec = make_exec(s.threads);
  Memory<S> mem(s, pos + g_steps, exec);
  {
    const Inputs prompt(s, pos);
    mem.build(exec, TypedInputs<S>(prompt), pos);
    exec.fence();
  }
  const TypedInputs<S> in(Inputs(s, g_steps, 4321));
  double total = 0;
  long i = 0;
  for (auto _ : st) {
    const auto t0 = clock_t_::now();
    mem.decode(exec, in, i, pos);
    exec.fence();
    total += seconds_since(t0);
    ++i;
  }
  const double sec = total / double(i);
  set_counters<S>(st, row, sec, mem.held(s, pos + i));
  st.counters["step_us"] = sec * 1e6;
}

/// float32, bfloat16 and float16 of one memory, decode at `pos` and prefill of `T` tokens.
template <template <class> class Memory>
void add_memory(const Shape& shape, long pos, long T) {
  auto types = [&]<class... S>(std::type_identity<S>...) {
    (kvbench::register_benchmark("dtype/decode/" + std::string(Memory<S>::name) + "/" +
                                      std::string(kvmem::dtype_name<S>) + "/pos:" + std::to_string(pos) + "/" + shape.key(),
                                  [shape, pos](benchmark::State& st) {
                                    bm_decode<Memory, S>(st, std::string("decode/") + Memory<S>::name + shape.key(), shape, pos);
                                  })
         ->UseRealTime()
         ->Iterations(g_steps)
         ->Unit(benchmark::kMicrosecond),
     ...);
    Shape ps = shape;
    ps.T = T;
    (kvbench::register_benchmark("dtype/prefill/" + std::string(Memory<S>::name) + "/" +
                                      std::string(kvmem::dtype_name<S>) + "/" + ps.key(),
                                  [ps](benchmark::State& st) {
                                    bm_prefill<Memory, S>(st, std::string("prefill/") + Memory<S>::name + ps.key(), ps);
                                  })
         ->UseRealTime()
         ->Iterations(2)
         ->Unit(benchmark::kMillisecond),
     ...);
  };
  types(std::type_identity<float>{}, std::type_identity<kvmem::bfloat16>{}, std::type_identity<kvmem::float16>{});
}

void register_grid(const std::string& grid) {
  if (grid == "gpu") {  // scripts/gpu-check: the engines' shape (Hq = 32, Hkv = 8, D = 128, B = 8), position and T 16K
    const long pos = g_position > 0 ? g_position : 16384;
    const Shape shape{0, 128, 4, static_cast<int>(g_batch), 8, all_threads()};
    add_memory<Exact>(shape, pos, 16384);
    add_memory<KvmFixed>(shape, pos, 16384);
    if constexpr (KvmFixedMemory<kvmem::bfloat16>::tensor_core_readout_built) add_memory<KvmFixedPortable>(shape, pos, 16384);
    return;
  }
  const long pos = g_position > 0 ? g_position : (grid == "quick" ? 1024 : 4096), T = grid == "quick" ? 512 : 2048;
  const Shape shape{0, 128, 1, static_cast<int>(g_batch), 8, all_threads()};
  add_memory<Exact>(shape, pos, T);
  add_memory<KvmFixed>(shape, pos, T);
  if constexpr (KvmFixedMemory<kvmem::bfloat16>::tensor_core_readout_built) add_memory<KvmFixedPortable>(shape, pos, T);
  add_memory<EvictH2o>(shape, pos, T);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string grid = kvbench::take_flag(argc, argv, "grid", "standard");
  g_steps = std::stol(kvbench::take_flag(argc, argv, "steps", "64"));
  g_batch = std::stol(kvbench::take_flag(argc, argv, "batch", "8"));
  g_position = std::stol(kvbench::take_flag(argc, argv, "position", "0"));
  if (g_steps < 1 || g_batch < 1 || g_position < 0) {
    std::fprintf(stderr, "kvmem_bench_dtype: --steps (%ld) and --batch (%ld) must be >= 1, --position (%ld) >= 0\n",
                 g_steps, g_batch, g_position);
    return 2;
  }
  return kvbench::benchmark_main(argc, argv, grid, /*ceilings=*/false, register_grid);
}
