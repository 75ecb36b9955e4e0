/// \file main.cpp
/// kvmem-soak: long decode streams through a memory, checked at every token (docs/reliability.md).
///
///   kvmem-soak [--memory NAME[,NAME...]|all] [--tokens N] [--every K] [--seed S] [--spike-every P]
///              [--json FILE] [--no-kokkos-tools] [--list]
///
/// One sequence, one kv-head and one query head (head_dim = value_dim = 64), decoded token by token on
/// Kokkos::DefaultExecutionSpace from a seeded Gaussian stream with a spike every P-th token (attention
/// memories: key and value x100, gate pre-activation +8; Trellis: latent target x100 with the largest step
/// and no forgetting). Checked at every token: y finite; state rows and held_bytes() within the schedule's
/// bound. At every K-th token (checkpoint): state rows equal to what the schedule says (state::final_rows
/// for KVM, spec OVQ.md §3 for OVQ, the slot count for Trellis), every live state entry finite (keys,
/// values, radius, counts, read caches; Trellis' M1 and M2), and the process's resident memory (VmRSS),
/// Kokkos allocations, and host heap allocations inside decode() since the last checkpoint. After the
/// first checkpoint (warm-up) RSS may grow only by what the memory itself allocated (the state doubling
/// its capacity under a growing budget), and Kokkos may allocate only state rows.
/// Exit status 0 when every check of every memory passed, 1 otherwise, 2 for bad arguments.
///
/// The "-bf16" memories hold their tokens in bfloat16 and decode beside a float32 twin on the same stream;
/// at every checkpoint the mean relative difference of their outputs since the last one is reported, and
/// a difference that grows along the stream (the last third of it above 1.25 x the middle third, plus 2^-8)
/// fails the run (docs/numerics.md).
///
/// The eviction memories whose scorer reads attention probabilities (evict-h2o, evict-tova) decode beside
/// the float64 twin of their statistics (eviction_shadow.hpp): after every token it reads the kernel's
/// cache, recomputes the step's probabilities in float64 from the same keys and query, and fails the run
/// when a statistic leaves the float32 error bound of docs/numerics.md or an eviction picks a token whose
/// float64 score is lower than another's by more than their bounds; it also reports what a float32 running
/// sum of the same probabilities would have drifted to. evict-kvpop decodes beside the float64 twin of its
/// float32 mLSTM (mlstm_twin.hpp) and reports the score error and the evictions float64 would have made
/// otherwise.
///
/// Adding a memory: one entry in soak_cases() below (a name, a factory, the rows the schedule promises
/// after n tokens and their upper bound); a memory whose `inputs` differ from kvmem::Memory's also gets a
/// subject (see TrellisSubject). Every subject decodes through the memory contract (contract_decode).

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
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "eviction_shadow.hpp"
#include "mlstm_twin.hpp"

// ---- host heap allocation counter (every operator new of the process, Kokkos' library included) ----
// nvcc takes the global operator new and delete for __host__ __device__ functions; the replacements are
// host code, so the device compilation pass (__CUDA_ARCH__ defined) keeps the device runtime's own.
namespace {
std::atomic<long> g_heap_allocations{0};
}
#if !defined(__CUDA_ARCH__)
// g++ sees operator new's malloc only where it inlines it and then takes free() for a mismatch.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
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
#pragma GCC diagnostic pop
#endif  // !__CUDA_ARCH__

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
  double drift = -1.0;  ///< paired subjects: mean of ||y16 - y32|| / ||y32|| over the tokens since the last checkpoint
  kvmem_soak::ShadowInterval shadow;  ///< H2O, TOVA: the statistics against their float64 twin since then
  kvmem_soak::MLstmInterval mlstm;    ///< KVPOP: the float32 mLSTM's scores against its float64 twin since then
};

struct Result {
  std::string name;
  long tokens = 0, nonfinite_outputs = 0, first_nonfinite = -1, bound_violations = 0, first_bound_violation = -1;
  long row_mismatches = 0, nonfinite_state = 0, max_rows = 0, max_held = 0, max_bound = 0;
  long rss_drift = 0, other_kokkos_allocations = 0;
  double seconds = 0, heap_allocations_per_token = 0;
  /// Paired subjects (a 16-bit memory against its float32 twin): the mean relative output difference over
  /// the middle third of the checkpoint intervals and over the last third; -1 otherwise.
  double middle_drift = -1.0, last_drift = -1.0;
  /// Subjects with a float64 twin: H2O and TOVA eviction (their statistics, `shadow`), KVPOP (its mLSTM
  /// scores, `mlstm`); the whole stream's.
  enum class Twin { none, statistics, mlstm } twin = Twin::none;
  kvmem_soak::ShadowInterval shadow;
  kvmem_soak::MLstmInterval mlstm;
  std::vector<Checkpoint> checkpoints;
  /// The 16-bit memory drifts when its difference from float32 grows along the stream: the last third of
  /// the intervals above 1.25 x the middle third plus 2^-8 (one bfloat16 rounding), as a 16-bit merge sum
  /// that stalls would make it. The first third is the warm-up (the state still filling).
  /// Only paired subjects have a drift (the others keep -1 in both and never drift).
  [[nodiscard]] bool drifted() const { return middle_drift >= 0.0 && last_drift > 1.25 * middle_drift + 0x1p-8; }
  [[nodiscard]] bool passed() const {
    return nonfinite_outputs == 0 && bound_violations == 0 && row_mismatches == 0 && nonfinite_state == 0 &&
           rss_drift <= (1L << 20) && other_kokkos_allocations == 0 && !drifted() && shadow.violations == 0 &&
           shadow.unexplained == 0 && mlstm.invalid == 0;
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

/// Counts non-finite entries of a host mirror of `view` over (sequence 0, every head, slots [0, rows)).
template <class View>
long nonfinite_rows(const View& view, long rows) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  long bad = 0;
  for (std::size_t head = 0; head < h.extent(1); ++head)
    for (long i = 0; i < rows; ++i) {
      if constexpr (View::rank() == 4) {
        for (std::size_t c = 0; c < h.extent(3); ++c) bad += std::isfinite(kvmem::to_float(h(0, head, i, c))) ? 0 : 1;
      } else {
        bad += std::isfinite(kvmem::to_float(h(0, head, i))) ? 0 : 1;
      }
    }
  return bad;
}

/// Copies the output y [1, H, 1, Dv] of a decode step to its host mirror and counts its non-finite entries.
template <class View, class Mirror>
long nonfinite_y(const View& y, const Mirror& hy) {
  Kokkos::deep_copy(hy, y);
  long bad = 0;
  for (std::size_t h = 0; h < hy.extent(1); ++h)
    for (std::size_t c = 0; c < hy.extent(3); ++c) bad += std::isfinite(kvmem::to_float(hy(0, h, 0, c))) ? 0 : 1;
  return bad;
}

/// Fills `x` [dim] with a Gaussian vector scaled to unit L2 norm (Trellis' recommended input, spec
/// TRELLIS.md §5).
template <class Rng>
void unit_gaussian(Rng& rng, std::normal_distribution<float>& normal, float* x, int dim) {
  float n = 0.0f;
  for (int c = 0; c < dim; ++c) {  // the draw first: `(x[c] = draw) * x[c]` reads x[c] unsequenced
    x[c] = normal(rng);
    n += x[c] * x[c];
  }
  const float inv = 1.0f / (std::sqrt(n) + 1e-6f);
  for (int c = 0; c < dim; ++c) x[c] *= inv;
}

template <class S = float>
using view4 = Kokkos::View<S****, Kokkos::LayoutRight, Kokkos::DefaultExecutionSpace::memory_space>;
template <class S = float>
using view3 = Kokkos::View<S***, Kokkos::LayoutRight, Kokkos::DefaultExecutionSpace::memory_space>;

/// One decode step of `mem` through the memory contract (kvmem::AttentionMemory: decode(inputs, y, active),
/// every sequence active), as an engine drives any memory: the subjects below differ only in the family's
/// `inputs` aggregate they build and in what they check.
template <kvmem::AttentionMemory Memory, class Y>
void contract_decode(Memory& mem, const typename Memory::inputs& in, const Y& y) {
  mem.decode(in, y, std::span<const unsigned char>{});
}

/// A kvmem::Memory (KVM, OVQ, any merge x budget x scorer) or EvictionMemory under soak: one sequence,
/// decode(q, k, v, gate, y), tokens in the memory's storage type. Inputs: Gaussian q, k, v, gate
/// pre-activation uniform in [-2, 2], rounded to the storage type; a spike token has k and v x100 and gate
/// +8. Rows: cursor(0).rows; held bound: (rows + window) x (D + Dv + 1) x 4 B per kv-head (float32: a
/// 16-bit window holds less).
template <class Memory>
struct AttentionSubject {
  using S = typename Memory::storage_type;
  Memory& mem;
  int Hq, Hkv, D, Dv;
  view4<S> q, k, v, y;
  view3<S> gate;
  typename view4<S>::host_mirror_type hq, hk, hv, hy;
  typename view3<S>::host_mirror_type hg;
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform{-2.0f, 2.0f};

  explicit AttentionSubject(Memory& m)
      : mem(m), Hq(m.config().query_heads), Hkv(m.config().kv_heads), D(m.config().head_dim), Dv(m.config().value_dim),
        q("q", 1, Hq, 1, D), k("k", 1, Hkv, 1, D), v("v", 1, Hkv, 1, Dv), y("y", 1, Hq, 1, Dv), gate("gate", 1, Hkv, 1),
        hq(Kokkos::create_mirror_view(q)), hk(Kokkos::create_mirror_view(k)), hv(Kokkos::create_mirror_view(v)),
        hy(Kokkos::create_mirror_view(y)), hg(Kokkos::create_mirror_view(gate)) {}

  template <class Rng>
  void next(Rng& rng, bool spike) {
    const float scale = spike ? 100.0f : 1.0f;
    for (int h = 0; h < Hq; ++h)
      for (int c = 0; c < D; ++c) hq(0, h, 0, c) = kvmem::from_float<S>(normal(rng));
    for (int h = 0; h < Hkv; ++h) {
      for (int c = 0; c < D; ++c) hk(0, h, 0, c) = kvmem::from_float<S>(scale * normal(rng));
      for (int c = 0; c < Dv; ++c) hv(0, h, 0, c) = kvmem::from_float<S>(scale * normal(rng));
      hg(0, h, 0) = kvmem::from_float<S>(spike ? 8.0f : uniform(rng));
    }
    Kokkos::deep_copy(q, hq);
    Kokkos::deep_copy(k, hk);
    Kokkos::deep_copy(v, hv);
    Kokkos::deep_copy(gate, hg);
  }
  void decode() { contract_decode(mem, {q, k, v, gate}, y); }
  long nonfinite_output() { return nonfinite_y(y, hy); }
  [[nodiscard]] long rows() const { return mem.cursor(0).rows; }
  [[nodiscard]] long held_bytes() const { return mem.held_bytes(); }
  [[nodiscard]] long allocated_bytes() const { return mem.allocated_bytes(); }
  [[nodiscard]] long held_bound(long rows_bound) const {
    return (rows_bound + mem.config().window()) * (D + Dv + 1) * static_cast<long>(sizeof(float)) * Hkv;
  }
  /// Non-finite entries among the live rows (keys, values, both read caches, radius, counts).
  [[nodiscard]] long nonfinite_state(long rows) const {
    const auto& st = mem.rows();
    return nonfinite_rows(st.keys, rows) + nonfinite_rows(st.values, rows) + nonfinite_rows(st.read_keys, rows) +
           nonfinite_rows(st.read_values, rows) + nonfinite_rows(st.radius, rows) + nonfinite_rows(st.counts, rows);
  }
};

/// A kvmem::TrellisMemory under soak: one sequence, decode(q, k, v, alpha, beta1, gamma1, beta2, gamma2, y).
/// Inputs as the spec recommends (TRELLIS.md §5) and the tests use: unit-norm Gaussian q, k, v; alpha
/// 0.7 x Gaussian [m]; forget gates uniform in [0.6, 1], step sizes uniform in [0.05, 0.6]. A spike token
/// has alpha x100 with no forgetting (beta 1) and the largest step (gamma 1). Rows: the m slots, always;
/// held bound: m x (D + Dv) x 4 B per head.
template <class Memory>
struct TrellisSubject {
  Memory& mem;
  int H, D, Dv, m;
  view4<> q, k, v, alpha, y;
  view3<> beta1, gamma1, beta2, gamma2;
  typename view4<>::host_mirror_type hq, hk, hv, ha, hy;
  typename view3<>::host_mirror_type hb1, hg1, hb2, hg2;
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> forget{0.6f, 1.0f}, step{0.05f, 0.6f};

  explicit TrellisSubject(Memory& mm)
      : mem(mm), H(mm.config().heads), D(mm.config().head_dim), Dv(mm.config().value_dim), m(mm.config().slots),
        q("q", 1, H, 1, D), k("k", 1, H, 1, D), v("v", 1, H, 1, Dv), alpha("alpha", 1, H, 1, m), y("y", 1, H, 1, Dv),
        beta1("beta1", 1, H, 1), gamma1("gamma1", 1, H, 1), beta2("beta2", 1, H, 1), gamma2("gamma2", 1, H, 1),
        hq(Kokkos::create_mirror_view(q)), hk(Kokkos::create_mirror_view(k)), hv(Kokkos::create_mirror_view(v)),
        ha(Kokkos::create_mirror_view(alpha)), hy(Kokkos::create_mirror_view(y)),
        hb1(Kokkos::create_mirror_view(beta1)), hg1(Kokkos::create_mirror_view(gamma1)),
        hb2(Kokkos::create_mirror_view(beta2)), hg2(Kokkos::create_mirror_view(gamma2)) {}

  template <class Rng>
  void next(Rng& rng, bool spike) {
    for (int h = 0; h < H; ++h) {
      unit_gaussian(rng, normal, &hq(0, h, 0, 0), D);
      unit_gaussian(rng, normal, &hk(0, h, 0, 0), D);
      unit_gaussian(rng, normal, &hv(0, h, 0, 0), Dv);
      for (int s = 0; s < m; ++s) ha(0, h, 0, s) = (spike ? 70.0f : 0.7f) * normal(rng);
      hb1(0, h, 0) = spike ? 1.0f : forget(rng);
      hg1(0, h, 0) = spike ? 1.0f : step(rng);
      hb2(0, h, 0) = spike ? 1.0f : forget(rng);
      hg2(0, h, 0) = spike ? 1.0f : step(rng);
    }
    Kokkos::deep_copy(q, hq);
    Kokkos::deep_copy(k, hk);
    Kokkos::deep_copy(v, hv);
    Kokkos::deep_copy(alpha, ha);
    Kokkos::deep_copy(beta1, hb1);
    Kokkos::deep_copy(gamma1, hg1);
    Kokkos::deep_copy(beta2, hb2);
    Kokkos::deep_copy(gamma2, hg2);
  }
  void decode() { contract_decode(mem, {q, k, v, alpha, beta1, gamma1, beta2, gamma2}, y); }
  long nonfinite_output() { return nonfinite_y(y, hy); }
  [[nodiscard]] long rows() const { return m; }
  [[nodiscard]] long held_bytes() const { return mem.held_bytes(); }
  [[nodiscard]] long allocated_bytes() const { return mem.allocated_bytes(); }
  [[nodiscard]] long held_bound(long rows_bound) const {
    return rows_bound * (D + Dv) * static_cast<long>(sizeof(float)) * H;
  }
  /// Non-finite entries of M1 and M2.
  [[nodiscard]] long nonfinite_state(long rows) const {
    return nonfinite_rows(mem.m1(), rows) + nonfinite_rows(mem.m2(), rows);
  }
};

/// A kvmem::EvictionMemory under soak: the inputs of AttentionSubject (the gate is not used), decode(q, k, v, y).
/// Rows: the cached rows of the (only) kv-head, min(n, budget); held bound: (budget + 1) x (D + Dv) x 4 B per kv-head.
template <class Memory>
struct EvictionSubject : AttentionSubject<Memory> {
  using AttentionSubject<Memory>::AttentionSubject;
  void decode() { contract_decode(this->mem, {this->q, this->k, this->v}, this->y); }
  [[nodiscard]] long rows() const {
    long live = 0;
    Kokkos::deep_copy(live, Kokkos::subview(this->mem.cache().live, 0, 0));
    return live;
  }
  /// held_bytes() is the fixed allocation of budget + 1 rows, whatever the rows cached so far.
  [[nodiscard]] long held_bound(long) const {
    return (this->mem.config().budget() + 1) * (this->D + this->Dv) * static_cast<long>(sizeof(float)) * this->Hkv;
  }
  /// Non-finite entries among the keys and values of every row slot.
  [[nodiscard]] long nonfinite_state(long) const {
    const auto& c = this->mem.cache();
    return nonfinite_rows(c.keys, c.slots()) + nonfinite_rows(c.values, c.slots());
  }
};

/// An EvictionMemory whose scorer reads probabilities (H2O, TOVA), followed by the float64 twin of its
/// statistics (kvmem_soak::EvictionShadow; docs/numerics.md "Eviction statistics"): after every step the
/// kernel's cache is read back (host mirrors made once) and the twin checks its statistics and its choice.
template <class Memory>
struct ShadowedEvictionSubject : EvictionSubject<Memory> {
  using cache_t = std::remove_cvref_t<decltype(std::declval<Memory&>().cache())>;
  typename decltype(cache_t::positions)::host_mirror_type positions;
  typename decltype(cache_t::stats)::host_mirror_type stats;
  typename decltype(cache_t::order)::host_mirror_type order;
  typename decltype(cache_t::live)::host_mirror_type live;
  typename decltype(cache_t::keys)::host_mirror_type keys;
  typename decltype(cache_t::probabilities)::host_mirror_type probabilities;
  kvmem_soak::EvictionShadow shadow;

  ShadowedEvictionSubject(Memory& m, kvmem_soak::EvictionShadow::Stat kind)
      : EvictionSubject<Memory>(m), positions(Kokkos::create_mirror_view(m.cache().positions)),
        stats(Kokkos::create_mirror_view(m.cache().stats)), order(Kokkos::create_mirror_view(m.cache().order)),
        live(Kokkos::create_mirror_view(m.cache().live)), keys(Kokkos::create_mirror_view(m.cache().keys)),
        probabilities(Kokkos::create_mirror_view(m.cache().probabilities)),
        shadow(kind, m.cache().slots(), m.config().sinks, m.config().window, m.config().group(), m.config().head_dim) {}

  /// Step q's statistics and eviction against the twin (outside decode(): the soak's heap counter is
  /// decode's own).
  void follow(long q) {
    const auto& c = this->mem.cache();
    Kokkos::deep_copy(positions, c.positions);
    Kokkos::deep_copy(stats, c.stats);
    Kokkos::deep_copy(order, c.order);
    Kokkos::deep_copy(live, c.live);
    Kokkos::deep_copy(keys, c.keys);
    Kokkos::deep_copy(probabilities, c.probabilities);
    shadow.follow(
        q, live(0, 0), [&](long i) { return static_cast<long>(order(0, 0, i)); },
        [&](long s) { return positions(0, 0, s); }, [&](long s) { return stats(0, 0, s); },
        [&](long i) { return probabilities(0, 0, i); }, [&](long s) { return &keys(0, 0, s, 0); },
        [&](int g) { return &this->hq(0, g, 0, 0); });
  }
  static constexpr auto twin = Result::Twin::statistics;
  void take_twin(Checkpoint& c, Result& r) {
    c.shadow = shadow.take();
    r.shadow.merge(c.shadow);
  }
};

/// An EvictionMemory with KVPOP's mLSTM scorer (float32), beside score::MLstm<HostSpace, double> on the same
/// weights (kvmem_soak::MLstmTwin): after every step the kernel's positions and scores are read back.
template <class Memory>
struct KvpopTwinSubject : EvictionSubject<Memory> {
  using cache_t = std::remove_cvref_t<decltype(std::declval<Memory&>().cache())>;
  typename decltype(cache_t::positions)::host_mirror_type positions;
  typename decltype(cache_t::stats)::host_mirror_type stats;
  kvmem_soak::MLstmTwin mlstm;

  KvpopTwinSubject(Memory& m, const kvmem::score::MLstmWeights<Kokkos::HostSpace>& host_weights)
      : EvictionSubject<Memory>(m), positions(Kokkos::create_mirror_view(m.cache().positions)),
        stats(Kokkos::create_mirror_view(m.cache().stats)), mlstm(host_weights, m.config()) {}

  void follow(long q) {
    Kokkos::deep_copy(positions, this->mem.cache().positions);
    Kokkos::deep_copy(stats, this->mem.cache().stats);
    mlstm.follow(q, &this->hk(0, 0, 0, 0), &this->hv(0, 0, 0, 0), [&](long s) { return positions(0, 0, s); },
                 [&](long s) { return stats(0, 0, s); });
  }
  static constexpr auto twin = Result::Twin::mlstm;
  void take_twin(Checkpoint& c, Result& r) {
    c.mlstm = mlstm.take();
    r.mlstm.merge(c.mlstm);
  }
};

/// A memory holding its tokens in a 16-bit storage type next to its float32 twin, both decoding the same
/// stream: the 16-bit subject's tokens (rounded), widened exactly for the twin, so the two differ only by
/// what the 16-bit memory stores. The 16-bit memory is the one checked (rows, bounds, finiteness, memory);
/// drift() compares the outputs of the token just decoded (docs/numerics.md: the merge sums are float32,
/// so the 16-bit memory's error must stay at its storage rounding, not grow with the stream).
template <class Memory16, class Memory32>
struct PairedSubject : AttentionSubject<Memory16> {
  AttentionSubject<Memory32> twin;
  PairedSubject(Memory16& m16, Memory32& m32) : AttentionSubject<Memory16>(m16), twin(m32) {}

  template <class Rng>
  void next(Rng& rng, bool spike) {
    AttentionSubject<Memory16>::next(rng, spike);
    auto widen = [](const auto& from, const auto& to, const auto& device) {
      for (std::size_t i = 0; i < from.span(); ++i) to.data()[i] = kvmem::to_float(from.data()[i]);
      Kokkos::deep_copy(device, to);
    };
    widen(this->hq, twin.hq, twin.q);
    widen(this->hk, twin.hk, twin.k);
    widen(this->hv, twin.hv, twin.v);
    widen(this->hg, twin.hg, twin.gate);
  }
  void decode() {
    AttentionSubject<Memory16>::decode();
    twin.decode();
  }
  /// ||y16 - y32|| / ||y32|| of the token just decoded (after nonfinite_output(), which brought y16 to
  /// the host; 0 for a zero y32).
  double drift() {
    Kokkos::deep_copy(twin.hy, twin.y);
    double err = 0.0, ref = 0.0;
    for (std::size_t i = 0; i < twin.hy.span(); ++i) {
      const double y32 = twin.hy.data()[i], d = kvmem::to_float(this->hy.data()[i]) - y32;
      err += d * d;
      ref += y32 * y32;
    }
    return ref > 0.0 ? std::sqrt(err / ref) : 0.0;
  }
  /// Both memories' allocations: the twin's state grows too, and the RSS check counts it.
  [[nodiscard]] long allocated_bytes() const { return this->mem.allocated_bytes() + twin.mem.allocated_bytes(); }
};

/// Random mLSTM weights [1 kv-head] for the soak of score::MLstm: N(0, 0.3^2) projections and gates.
template <class Space>
kvmem::score::MLstmWeights<Space> soak_mlstm_weights(unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  const long X = 2 * kDim, h = kDim / 2;
  auto fill = [&](auto view) {
    auto host = Kokkos::create_mirror_view(view);
    for (std::size_t i = 0; i < host.span(); ++i) host.data()[i] = normal(rng);
    Kokkos::deep_copy(view, host);
    return view;
  };
  kvmem::score::MLstmWeights<Space> w;
  w.w_q = fill(Kokkos::View<float***, Kokkos::LayoutRight, Space>("w_q", 1, X, h));
  w.w_k = fill(Kokkos::View<float***, Kokkos::LayoutRight, Space>("w_k", 1, X, h));
  w.w_v = fill(Kokkos::View<float***, Kokkos::LayoutRight, Space>("w_v", 1, X, h));
  w.w_i = fill(Kokkos::View<float**, Kokkos::LayoutRight, Space>("w_i", 1, X));
  w.w_f = fill(Kokkos::View<float**, Kokkos::LayoutRight, Space>("w_f", 1, X));
  w.w_s = fill(Kokkos::View<float**, Kokkos::LayoutRight, Space>("w_s", 1, h));
  w.b_i = fill(Kokkos::View<float*, Space>("b_i", 1));
  w.b_f = fill(Kokkos::View<float*, Space>("b_f", 1));
  w.b_s = fill(Kokkos::View<float*, Space>("b_s", 1));
  w.theta = fill(Kokkos::View<float*, Space>("theta", 1));
  return w;
}

/// Decodes o.tokens tokens through `subject`. expected(n): the rows after n tokens; bound(n): their upper bound.
template <class Subject>
Result soak(Subject& subject, const std::string& name, const Options& o, const std::function<long(long)>& expected,
            const std::function<long(long)>& bound) {
  std::mt19937_64 rng(o.seed);
  Result r;
  r.name = name;
  const auto start = std::chrono::steady_clock::now();
  long rss_warm = -1, allocated_warm = 0, decode_heap = 0, heap_last = 0, kokkos_last = g_kokkos_allocations;
  long other_warm = 0;
  constexpr bool paired = requires { subject.drift(); };
  constexpr bool shadowed = requires { subject.follow(0L); };
  if constexpr (shadowed) r.twin = Subject::twin;
  double drift_sum = 0.0;  // relative output differences since the last checkpoint (paired subjects)
  long drift_tokens = 0;
  std::printf("%-14s %9s %7s %7s %12s %12s %10s %8s %10s %8s%s\n", name.c_str(), "tokens", "rows", "expect", "held B",
              "allocated B", "RSS MiB", "kokkos+", "heap+/tok", "seconds", paired ? "  drift vs f32" : "");
  for (long n = 1; n <= o.tokens; ++n) {
    subject.next(rng, o.spike_every > 0 && n % o.spike_every == 0);
    const long heap_before = g_heap_allocations.load(std::memory_order_relaxed);
    subject.decode();
    decode_heap += g_heap_allocations.load(std::memory_order_relaxed) - heap_before;  // decode's own, not this loop's
    if constexpr (shadowed) subject.follow(n - 1);
    if (const long bad = subject.nonfinite_output(); bad > 0) {
      if (r.first_nonfinite < 0) r.first_nonfinite = n;
      r.nonfinite_outputs += bad;
    }
    if constexpr (paired) {
      drift_sum += subject.drift();
      ++drift_tokens;
    }
    const long rows = subject.rows(), held = subject.held_bytes(), rows_bound = bound(n);
    const long held_bound = subject.held_bound(rows_bound);
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
      c.allocated_bytes = subject.allocated_bytes();
      c.rss = rss_bytes();
      c.kokkos_allocations = g_kokkos_allocations - kokkos_last;
      c.heap_allocations = decode_heap - heap_last;
      heap_last = decode_heap;
      kokkos_last = g_kokkos_allocations;
      c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if constexpr (paired) {
        c.drift = drift_sum / static_cast<double>(drift_tokens);
        drift_sum = 0.0, drift_tokens = 0;
      }
      if constexpr (shadowed) subject.take_twin(c, r);
      if (c.rows != c.expected_rows) ++r.row_mismatches;
      r.nonfinite_state += subject.nonfinite_state(rows);
      if (rss_warm < 0) {  // the first checkpoint ends the warm-up
        rss_warm = c.rss;
        allocated_warm = c.allocated_bytes;
        other_warm = g_kokkos_other_allocations;
      } else {
        r.rss_drift = std::max(r.rss_drift, (c.rss - rss_warm) - (c.allocated_bytes - allocated_warm));
      }
      char drift[160] = "";
      if (paired) std::snprintf(drift, sizeof drift, "  %12.3e", c.drift);
      if (r.twin == Result::Twin::statistics)
        std::snprintf(drift, sizeof drift, "  f64 twin: stat err %.2e (%.1e of bound, %ld over)  f32 sum %.2e  choices %ld/%ld (%ld unexplained)",
                      c.shadow.max_error, c.shadow.max_bound_used, c.shadow.violations, c.shadow.max_f32_sum_error,
                      c.shadow.differing, c.shadow.decisions, c.shadow.unexplained);
      if (r.twin == Result::Twin::mlstm)
        std::snprintf(drift, sizeof drift, "  f64 twin: score err %.2e  choices %ld/%ld (gap <= %.2g x err)", c.mlstm.max_error,
                      c.mlstm.differing, c.mlstm.decisions, c.mlstm.max_gap);
      std::printf("%-14s %9ld %7ld %7ld %12ld %12ld %10.1f %8ld %10.2f %8.1f%s%s\n", "", c.tokens, c.rows,
                  c.expected_rows, c.held_bytes, c.allocated_bytes, c.rss / 1048576.0, c.kokkos_allocations,
                  static_cast<double>(c.heap_allocations) / o.every, c.seconds, drift,
                  c.rows != c.expected_rows ? "  ROWS MISMATCH" : "");
      std::fflush(stdout);
      r.checkpoints.push_back(c);
    }
  }
  r.tokens = o.tokens;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.other_kokkos_allocations = g_kokkos_other_allocations - other_warm;
  if constexpr (paired) {  // the mean differences of the middle and the last third of the intervals
    const std::size_t n = r.checkpoints.size(), third = std::max<std::size_t>(n / 3, 1);
    auto mean = [&](std::size_t from, std::size_t to) {
      double s = 0.0;
      for (std::size_t i = from; i < to; ++i) s += r.checkpoints[i].drift;
      return to > from ? s / static_cast<double>(to - from) : 0.0;
    };
    r.middle_drift = mean(std::min(third, n - 1), std::max(n - third, std::min(third, n - 1) + 1));
    r.last_drift = mean(n - third, n);
  }
  const long counted = r.checkpoints.size() > 1 ? o.tokens - r.checkpoints.front().tokens : 0;
  long heap_after_warm = 0;
  for (std::size_t i = 1; i < r.checkpoints.size(); ++i) heap_after_warm += r.checkpoints[i].heap_allocations;
  r.heap_allocations_per_token = counted ? static_cast<double>(heap_after_warm) / counted : 0.0;
  return r;
}

/// Soaks the memory make(std::type_identity<S>{}) builds: a float32 memory alone (AttentionSubject), a
/// 16-bit one beside the float32 memory make(std::type_identity<float>{}) builds (PairedSubject).
template <class S, class Make>
Result soak_memory(const std::string& name, const Options& o, Make make, const std::function<long(long)>& expected,
                   const std::function<long(long)>& bound) {
  auto mem = make(std::type_identity<S>{});
  if constexpr (std::is_same_v<S, float>) {
    AttentionSubject subject(mem);
    return soak(subject, name, o, expected, bound);
  } else {
    auto twin = make(std::type_identity<float>{});
    PairedSubject subject(mem, twin);
    return soak(subject, name, o, expected, bound);
  }
}

/// OVQ's dictionary size once the chunks before token n are committed: sizes[c] of spec OVQ.md §3 (plateau
/// N_t = floor(tN / (t + N)) at t = cC, in integers), c = floor(n / C) committed chunks (OVQ commits a chunk
/// as soon as it is complete). Written from the spec, not from kvmem's planner, so it checks that too.
long ovq_plateau_rows(long n, long C, long N) {
  const long t = n / C * C;
  return std::min(t * N / (t + N), N);
}

std::vector<SoakCase> soak_cases() {
  using exec = Kokkos::DefaultExecutionSpace;
  using space = exec::memory_space;
  std::vector<SoakCase> cases;
  // KVM fixed-256, KVM 16 sqrt(N) and OVQ, with tokens in float32 and in bfloat16 (the latter next to a
  // float32 twin on the same stream: the output's drift against float32, docs/numerics.md).
  const auto merging = [&cases]<class S>(std::type_identity<S>) {
    const std::string suffix = std::is_same_v<S, float> ? "" : "-bf16";
    const std::string stored = std::is_same_v<S, float> ? "" : "; tokens in bfloat16, beside a float32 twin";
    // KVM, fixed budget of 256 rows (= one chunk; kvm-paper "fixed-256").
    cases.push_back({"kvm-fixed256" + suffix, "KVM, budget::Fixed{256}, max_rows 256, C 256, window 2 x 256" + stored,
                     [suffix](const Options& o) {
                       const auto cfg = soak_config(256);
                       const kvmem::budget::Fixed budget{256};
                       const auto weights = soak_weights<space>(o.seed);
                       return soak_memory<S>(
                           "kvm-fixed256" + suffix, o,
                           [&]<class T>(std::type_identity<T>) {
                             return kvmem::KvmMemory<exec, kvmem::budget::Fixed, T>(cfg, budget, weights, 1);
                           },
                           [&](long n) { return kvmem::state::final_rows(cfg, budget, n); },
                           [&](long n) { return std::min(n, 256L); });
                     }});
    // KVM, power-law budget 16 * sqrt(ctx) (kvm-paper "16 sqrt(N)"), no cap below the budget.
    cases.push_back({"kvm-sqrt16" + suffix, "KVM, budget::PowerLaw{256, 16, 0.5}, max_rows 2^40, C 256, window 2 x 256" + stored,
                     [suffix](const Options& o) {
                       const auto cfg = soak_config(1L << 40);
                       const kvmem::budget::PowerLaw budget{256, 16.0, 0.5, 1};
                       const auto weights = soak_weights<space>(o.seed);
                       // ctx of an update is L + its first token < L + n; rows never exceed the budget there.
                       const long L = cfg.window(), C = cfg.chunk;
                       return soak_memory<S>(
                           "kvm-sqrt16" + suffix, o,
                           [&]<class T>(std::type_identity<T>) {
                             return kvmem::KvmMemory<exec, kvmem::budget::PowerLaw, T>(cfg, budget, weights, 1);
                           },
                           [&](long n) { return kvmem::state::final_rows(cfg, budget, n); },
                           [&, L, C](long n) { return std::max(std::min(n, C), budget.rows(L + n)); });
                     }});
    // OVQ with the OVQ code defaults (kvmem-run ovq): C 128, N 2048 centroids, plateau tN/(t+N), window of
    // one chunk, no sinks, no RoPE split, beta 1.
    cases.push_back({"ovq" + suffix, "OVQ, budget::Plateau{2048}, max_rows 2048, C 128, window 1 x 128, beta 1" + stored,
                     [suffix](const Options& o) {
                       constexpr long N = 2048;
                       auto cfg = soak_config(N);
                       cfg.chunk = 128;
                       cfg.window_chunks = 1;
                       cfg.rope_dims = 0;
                       cfg.sinks = 0;
                       const kvmem::budget::Plateau budget{static_cast<double>(N)};
                       Kokkos::View<float*, space> beta("beta", 1);
                       Kokkos::deep_copy(beta, 1.0f);
                       const long C = cfg.chunk;
                       return soak_memory<S>(
                           "ovq" + suffix, o,
                           [&]<class T>(std::type_identity<T>) {
                             return kvmem::OvqMemory<exec, kvmem::budget::Plateau, T>(cfg, budget, {{}, {}, beta, beta}, 1);
                           },
                           [C](long n) { return ovq_plateau_rows(n, C, N); },
                           [&](long n) { return std::min(budget.rows(n), N); });
                     }});
  };
  merging(std::type_identity<float>{});
  merging(std::type_identity<kvmem::bfloat16>{});
  // KVM 16 sqrt(ctx) whose state rows are also evicted by H2O above 256 (kvmem::KvmMemoryWithRowEviction):
  // rows = the schedule's grant, capped at 256.
  cases.push_back({"kvm-sqrt16-h2o256", "KVM, budget::PowerLaw{256, 16, 0.5}, H2O row eviction above 256 rows, C 256",
                   [](const Options& o) {
                     const auto cfg = soak_config(1L << 40);
                     const kvmem::budget::PowerLaw budget{256, 16.0, 0.5, 1};
                     constexpr long cap = 256;
                     kvmem::KvmMemoryWithRowEviction<exec, kvmem::budget::PowerLaw, kvmem::score::RowAccumulatedAttention>
                         mem(cfg, budget, soak_weights<space>(o.seed), 1, kvmem::score::RowAccumulatedAttention{.max_rows = cap});
                     AttentionSubject subject(mem);
                     auto rows = [&](long n) { return std::min(kvmem::state::final_rows(cfg, budget, n), cap); };
                     return soak(subject, "kvm-sqrt16-h2o256", o, rows, rows);
                   }});
  // Trellis with the paper's 64 slots and the spec's defaults (phi silu, f LN-SiLU, gates checked).
  cases.push_back({"trellis", "Trellis, 64 slots, phi silu, f ln-silu, one head", [](const Options& o) {
                     kvmem::TrellisConfig cfg;
                     cfg.slots = 64;
                     cfg.head_dim = kDim;
                     cfg.value_dim = kDim;
                     cfg.heads = 1;
                     kvmem::TrellisMemory<exec> mem(cfg, 1);
                     TrellisSubject subject(mem);
                     const long m = cfg.slots;
                     return soak(subject, "trellis", o, [m](long) { return m; }, [m](long) { return m; });
                   }});
  // Eviction memories: sinks 4 + window 64 + top-k 188 = 256 rows, one entry per scorer.
  const auto eviction = [](const char* name, const char* text, auto make_scorer) {
    return SoakCase{name, text, [name, make_scorer](const Options& o) {
                      kvmem::EvictionConfig cfg{.head_dim = kDim, .value_dim = kDim, .query_heads = 1, .kv_heads = 1,
                                                .sinks = 4, .window = 64, .top_k = 188};
                      using Scorer = decltype(make_scorer(o));
                      kvmem::EvictionMemory<exec, Scorer> mem(cfg, 1, make_scorer(o));
                      const long budget = cfg.budget();
                      auto rows = [budget](long n) { return std::min(n, budget); };
                      if constexpr (Scorer::needs_probabilities) {  // H2O, TOVA: their float64 twin beside them
                        using Stat = kvmem_soak::EvictionShadow::Stat;
                        constexpr bool accumulated = std::is_same_v<Scorer, kvmem::score::AccumulatedAttention>;
                        ShadowedEvictionSubject<decltype(mem)> subject(mem, accumulated ? Stat::accumulated : Stat::last_query);
                        return soak(subject, name, o, rows, rows);
                      } else if constexpr (std::is_same_v<Scorer, kvmem::score::MLstm<space>>) {  // KVPOP
                        KvpopTwinSubject<decltype(mem)> subject(mem, soak_mlstm_weights<Kokkos::HostSpace>(o.seed));
                        return soak(subject, name, o, rows, rows);
                      } else {
                        EvictionSubject<decltype(mem)> subject(mem);
                        return soak(subject, name, o, rows, rows);
                      }
                    }};
  };
  const char* policy = ", sinks 4 + window 64 + top-k 188 = 256 rows";
  cases.push_back(eviction("evict-streaming", (std::string("StreamingLLM") + policy).c_str(),
                           [](const Options&) { return kvmem::score::None{}; }));
  cases.push_back(eviction("evict-knorm", (std::string("KNorm") + policy).c_str(),
                           [](const Options&) { return kvmem::score::KeyNorm{}; }));
  cases.push_back(eviction("evict-h2o", (std::string("H2O") + policy).c_str(),
                           [](const Options&) { return kvmem::score::AccumulatedAttention{}; }));
  cases.push_back(eviction("evict-tova", (std::string("TOVA") + policy).c_str(),
                           [](const Options&) { return kvmem::score::LastQueryAttention{}; }));
  cases.push_back(eviction("evict-kvpop", (std::string("KVPOP mLSTM, random N(0, 0.3) weights") + policy).c_str(),
                           [](const Options& o) { return kvmem::score::MLstm<space>(soak_mlstm_weights<space>(o.seed)); }));
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
        << ", \"heap_allocations_per_token\": " << r.heap_allocations_per_token << ", \"middle_drift\": " << r.middle_drift
        << ", \"last_drift\": " << r.last_drift;
    if (r.twin == Result::Twin::mlstm)
      out << ", \"f64_twin\": {\"max_score_error\": " << r.mlstm.max_error << ", \"evictions\": " << r.mlstm.decisions
          << ", \"differing_choices\": " << r.mlstm.differing << ", \"max_gap_in_errors\": " << r.mlstm.max_gap
          << ", \"invalid_evictions\": " << r.mlstm.invalid << "}";
    if (r.twin == Result::Twin::statistics)
      out << ", \"f64_twin\": {\"max_relative_error\": " << r.shadow.max_error << ", \"max_bound_used\": "
          << r.shadow.max_bound_used << ", \"violations\": " << r.shadow.violations
          << ", \"float32_sum_relative_error\": " << r.shadow.max_f32_sum_error << ", \"evictions\": " << r.shadow.decisions
          << ", \"differing_choices\": " << r.shadow.differing << ", \"unexplained_choices\": " << r.shadow.unexplained << "}";
    out << ",\n     \"checkpoints\": [";
    for (std::size_t j = 0; j < r.checkpoints.size(); ++j) {
      const auto& c = r.checkpoints[j];
      out << (j ? ", " : "") << "[" << c.tokens << ", " << c.rows << ", " << c.expected_rows << ", " << c.held_bytes << ", "
          << c.allocated_bytes << ", " << c.rss << ", " << c.kokkos_allocations << ", " << c.heap_allocations << ", "
          << c.seconds << ", " << c.drift << "]";
    }
    out << "]}" << (i + 1 < results.size() ? "," : "") << "\n";
  }
  out << "  ],\n  \"checkpoint_fields\": [\"tokens\", \"rows\", \"expected_rows\", \"held_bytes\", \"allocated_bytes\", "
         "\"rss_bytes\", \"kokkos_allocations\", \"heap_allocations\", \"seconds\", \"drift\"]\n}\n";
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
    if (r.twin == Result::Twin::mlstm)
      std::printf("  mLSTM scores against their float64 twin: max |score - score64| / (1 + |score64|) %.3e; %ld of %ld "
                  "evictions chose another token than float64 effective scores would, their gaps at most %.3g x that "
                  "error; %ld evicted a token the policy cannot evict\n",
                  r.mlstm.max_error, r.mlstm.differing, r.mlstm.decisions, r.mlstm.max_gap, r.mlstm.invalid);
    if (r.twin == Result::Twin::statistics)
      std::printf("  statistics against their float64 twin: max relative error %.3e, %.2e of the bound, %ld (step, row) "
                  "pairs over it; a float32 running sum would be %.3e off; %ld of %ld evictions chose another token than "
                  "float64 scores would, %ld of them not explained by the bound\n",
                  r.shadow.max_error, r.shadow.max_bound_used, r.shadow.violations, r.shadow.max_f32_sum_error,
                  r.shadow.differing, r.shadow.decisions, r.shadow.unexplained);
    if (r.middle_drift >= 0)
      std::printf("  output against the float32 twin: mean ||y - y32|| / ||y32|| %.3e over the middle third of the stream, "
                  "%.3e over the last third%s\n",
                  r.middle_drift, r.last_drift, r.drifted() ? "  DRIFTS" : "");
    std::fflush(stdout);
  }
  if (!o.json.empty()) write_json(o.json, results, o);
  return ok ? 0 : 1;
}
