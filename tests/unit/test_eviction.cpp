// Fixed-budget KV eviction (spec shared/spec/EVICTION.md): the kernels of EvictionMemory against the naive
// float64 reference (tests/reference/eviction_reference.hpp) for every scorer over the spec's edge cases, the
// worked example of §1 through a user-defined scorer, decode == prefill == two prefills bit for bit, decode's
// cache == the Fenwick mask of §5 == the brute-force mask, SnapKV's selection, the memory bound, the same
// bits on one and on many threads, and bad input named.
#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <kvmem/eviction.hpp>
#include <kvmem/io/safetensors.hpp>

#include "../reference/eviction_reference.hpp"
#include "float_bits.hpp"

using Catch::Matchers::ContainsSubstring;
using host_exec = Kokkos::DefaultHostExecutionSpace;
using host_mem = host_exec::memory_space;

namespace {

/// Tolerance of the float32 outputs against the float64 reference (the acceptance criterion).
constexpr double tolerance = 1e-4;

/// A user-defined scorer: static scores [B, Hkv, T] read from a device view at insertion. It shows that a
/// scorer outside kvmem only derives from score::EvictionDefaults and replaces the hooks it needs. Its
/// absorb takes the key and value as templates, so it also serves bfloat16 / float16 caches.
template <class MemorySpace>
struct GivenScores : kvmem::score::EvictionDefaults {
  static constexpr std::string_view name = "given";
  Kokkos::View<const double***, Kokkos::LayoutRight, MemorySpace> scores;
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION double absorb(long b, int h, long t, const K*, const V*) const {
    return scores(b, h, t);
  }
};
static_assert(kvmem::score::EvictionScorer<GivenScores<host_mem>>);
static_assert(GivenScores<host_mem>::name == "given");  // used, so nvcc does not warn of an unused member

enum class Kind { streaming, knorm, h2o, h2o_mean, tova, tova_layer, kvpop, given };
constexpr Kind all_kinds[] = {Kind::streaming, Kind::knorm,      Kind::h2o,   Kind::h2o_mean,
                              Kind::tova,      Kind::tova_layer, Kind::kvpop, Kind::given};

const char* name_of(Kind k) {
  switch (k) {
    case Kind::streaming: return "streaming";
    case Kind::knorm: return "knorm";
    case Kind::h2o: return "h2o";
    case Kind::h2o_mean: return "h2o-normalized";
    case Kind::tova: return "tova";
    case Kind::tova_layer: return "tova-layer-mean";
    case Kind::kvpop: return "kvpop";
    case Kind::given: return "given";
  }
  return "?";
}

/// One batch of random inputs, tensors row-major [B, heads, T, channels] float32 as in kvmem-run.
struct EvictCase {
  Kind kind = Kind::knorm;
  long B = 1, Hq = 2, Hkv = 1, T = 40, D = 8, Dv = 6;
  std::vector<long> lengths;  // empty = all T
  int sinks = 2, window = 3, top_k = 5, decay = 1;
  double log_gamma = 0.0;  // opt-in decay of the training-free and given scorers (kvpop: theta)
  kvmem_ref::MLstmNorm norm = kvmem_ref::MLstmNorm::xlstm;
  unsigned seed = 1;
  bool duplicate_keys = false;  // token t % 4 == 2 (t >= 2) repeats token t - 2's key and value: ties
  bool merge = false;           // EvictionConfig::merge_evicted: evicted rows fold into their nearest kept row
  int given_levels = 0;         // given scores: integers in [0, levels) (ties); 0: normal
  // kvpop weights: every head's theta (NaN: random), gate weight scale (large: the soft cap binds), input
  // gate bias offset (very negative: the exp(-m) bound of the xlstm normaliser binds), score head scale.
  // f_bias: forget gate bias (large: f ~ 1, and the m_{-1} = 0 term F_t of m_t wins for many steps).
  float theta_all = std::numeric_limits<float>::quiet_NaN(), gate_scale = 1.0f, i_bias = 0.0f, f_bias = 1.5f,
        w_s_scale = 1.0f;
  std::vector<float> q, k, v, w_q, w_k, w_v, w_i, w_f, w_s, b_i, b_f, b_s, theta;
  std::vector<double> given;  // [B, Hkv, T]

  [[nodiscard]] long length(long b) const { return lengths.empty() ? T : lengths[b]; }
  [[nodiscard]] long G() const { return Hq / Hkv; }
  [[nodiscard]] long X() const { return D + Dv; }
  [[nodiscard]] long h() const { return D / 2; }
  [[nodiscard]] long budget() const { return static_cast<long>(sinks) + window + top_k; }

  EvictCase& generate() {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    auto fill = [&](std::vector<float>& x, long n, float scale, float offset = 0.0f) {
      x.resize(n);
      for (auto& e : x) e = offset + scale * normal(rng);
    };
    fill(q, B * Hq * T * D, 1.0f);
    fill(k, B * Hkv * T * D, 1.0f);
    fill(v, B * Hkv * T * Dv, 1.0f);
    if (duplicate_keys)
      for (long bh = 0; bh < B * Hkv; ++bh)
        for (long t = 2; t < T; ++t)
          if (t % 4 == 2) {
            std::copy_n(&k[(bh * T + t - 2) * D], D, &k[(bh * T + t) * D]);
            std::copy_n(&v[(bh * T + t - 2) * Dv], Dv, &v[(bh * T + t) * Dv]);
          }
    given.resize(B * Hkv * T);
    for (auto& g : given) g = given_levels > 0 ? std::floor(uni(rng) * given_levels) : static_cast<double>(normal(rng));
    const float proj = 1.5f / std::sqrt(static_cast<float>(X()));
    fill(w_q, Hkv * X() * h(), proj);
    fill(w_k, Hkv * X() * h(), proj);
    fill(w_v, Hkv * X() * h(), proj);
    fill(w_i, Hkv * X(), gate_scale * 0.5f / std::sqrt(static_cast<float>(X())));
    fill(w_f, Hkv * X(), gate_scale * 0.5f / std::sqrt(static_cast<float>(X())));
    fill(b_i, Hkv, 1.0f, i_bias);
    fill(b_f, Hkv, 0.5f, f_bias);
    fill(w_s, Hkv * h(), w_s_scale);
    fill(b_s, Hkv, 1.0f);
    fill(theta, Hkv, 2.0f);
    if (!std::isnan(theta_all)) theta.assign(Hkv, theta_all);
    return *this;
  }

  [[nodiscard]] kvmem::EvictionConfig config() const {
    kvmem::EvictionConfig c;
    c.head_dim = static_cast<int>(D);
    c.value_dim = static_cast<int>(Dv);
    c.query_heads = static_cast<int>(Hq);
    c.kv_heads = static_cast<int>(Hkv);
    c.sinks = sinks;
    c.window = window;
    c.top_k = top_k;
    c.decay_interval = decay;
    c.merge_evicted = merge;
    return c;
  }

  /// The kvpop weights as a safetensors file (the names of score::MLstmWeights).
  [[nodiscard]] kvmem::io::SafetensorsFile weights_file() const {
    kvmem::io::SafetensorsFile f;
    f.put("w_q", {Hkv, X(), h()}, w_q.data());
    f.put("w_k", {Hkv, X(), h()}, w_k.data());
    f.put("w_v", {Hkv, X(), h()}, w_v.data());
    f.put("w_i", {Hkv, X()}, w_i.data());
    f.put("w_f", {Hkv, X()}, w_f.data());
    f.put("w_s", {Hkv, h()}, w_s.data());
    f.put("b_i", {Hkv}, b_i.data());
    f.put("b_f", {Hkv}, b_f.data());
    f.put("b_s", {Hkv}, b_s.data());
    f.put("theta", {Hkv}, theta.data());
    return f;
  }

  /// (sequence b, kv-head h) for the reference: its G query heads, its length, float inputs widened.
  [[nodiscard]] kvmem_ref::EvictHead head(long b, long hk) const {
    kvmem_ref::EvictHead x;
    const long n = length(b);
    x.T = n, x.G = G(), x.D = D, x.Dv = Dv;
    for (long g = 0; g < G(); ++g)
      for (long t = 0; t < n; ++t)
        for (long c = 0; c < D; ++c) x.q.push_back(q[((b * Hq + hk * G() + g) * T + t) * D + c]);
    for (long t = 0; t < n; ++t) {
      for (long c = 0; c < D; ++c) x.k.push_back(k[((b * Hkv + hk) * T + t) * D + c]);
      for (long c = 0; c < Dv; ++c) x.v.push_back(v[((b * Hkv + hk) * T + t) * Dv + c]);
    }
    return x;
  }

  [[nodiscard]] kvmem_ref::EvictPolicy policy(long b, long hk) const {
    kvmem_ref::EvictPolicy p;
    switch (kind) {
      case Kind::streaming: p.kind = kvmem_ref::EvictKind::streaming; break;
      case Kind::knorm: p.kind = kvmem_ref::EvictKind::knorm; break;
      case Kind::h2o:
      case Kind::h2o_mean: p.kind = kvmem_ref::EvictKind::h2o; break;
      case Kind::tova:
      case Kind::tova_layer: p.kind = kvmem_ref::EvictKind::tova; break;
      case Kind::kvpop: p.kind = kvmem_ref::EvictKind::kvpop; break;
      case Kind::given: p.kind = kvmem_ref::EvictKind::given; break;
    }
    p.sinks = sinks, p.window = window, p.top_k = top_k, p.decay_interval = decay;
    p.merge = merge;
    p.normalize = kind == Kind::h2o_mean;
    p.layer_mean = kind == Kind::tova_layer;
    p.log_gamma = log_gamma;
    p.given.assign(given.begin() + (b * Hkv + hk) * T, given.begin() + (b * Hkv + hk) * T + length(b));
    auto& m = p.mlstm;
    m.w_q.assign(w_q.begin() + hk * X() * h(), w_q.begin() + (hk + 1) * X() * h());
    m.w_k.assign(w_k.begin() + hk * X() * h(), w_k.begin() + (hk + 1) * X() * h());
    m.w_v.assign(w_v.begin() + hk * X() * h(), w_v.begin() + (hk + 1) * X() * h());
    m.w_i.assign(w_i.begin() + hk * X(), w_i.begin() + (hk + 1) * X());
    m.w_f.assign(w_f.begin() + hk * X(), w_f.begin() + (hk + 1) * X());
    m.w_s.assign(w_s.begin() + hk * h(), w_s.begin() + (hk + 1) * h());
    m.b_i = b_i[hk], m.b_f = b_f[hk], m.b_s = b_s[hk], m.theta = theta[hk];
    m.norm = norm;
    return p;
  }

  [[nodiscard]] std::string describe() const {
    std::string l;
    for (long x : lengths) l += std::to_string(x) + ",";
    return std::string("scorer=") + name_of(kind) + (kind == Kind::kvpop ? (norm == kvmem_ref::MLstmNorm::xlstm ? "/xlstm" : "/plain") : "") +
           " B=" + std::to_string(B) + " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) + " T=" + std::to_string(T) +
           " D=" + std::to_string(D) + " Dv=" + std::to_string(Dv) + " s=" + std::to_string(sinks) + " w=" + std::to_string(window) +
           " k=" + std::to_string(top_k) + " n=" + std::to_string(decay) + " log_gamma=" + std::to_string(log_gamma) +
           " dup=" + std::to_string(duplicate_keys) + " levels=" + std::to_string(given_levels) +
           " merge=" + std::to_string(merge) + " seed=" + std::to_string(seed) + " lengths=" + l;
  }
};

template <class MemorySpace, kvmem::StorageType S = float>
using view4 = Kokkos::View<S****, Kokkos::LayoutRight, MemorySpace>;

/// x [B, H, T, C] on the device in the storage type S (rounded by kvmem::from_float).
template <class MemorySpace, kvmem::StorageType S = float>
view4<MemorySpace, S> to_device(const std::vector<float>& x, long B, long H, long T, long C, const char* name) {
  view4<MemorySpace, S> out(std::string(name), B, H, T, C);  // Kokkos 4.7 takes no const char* label
  std::vector<S> xs(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xs[i] = kvmem::from_float<S>(x[i]);
  Kokkos::deep_copy(out, Kokkos::View<const S****, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                             xs.data(), B, H, T, C));
  return out;
}

/// Calls f(scorer) with the case's scorer, built for MemorySpace (kvpop weights through load_mlstm_weights).
template <class MemorySpace, class F>
void with_scorer(const EvictCase& c, F&& f) {
  namespace score = kvmem::score;
  auto run = [&](auto s) {  // the scorers whose only shared setting is the per-head decay
    s.log_gamma = c.log_gamma;
    f(s);
  };
  switch (c.kind) {
    case Kind::streaming: run(score::None{}); break;
    case Kind::knorm: run(score::KeyNorm{}); break;
    case Kind::h2o:
    case Kind::h2o_mean: {
      score::AccumulatedAttention s;
      s.normalize = c.kind == Kind::h2o_mean;
      run(s);
      break;
    }
    case Kind::tova:
    case Kind::tova_layer: {
      score::LastQueryAttention s;
      s.layer_mean = c.kind == Kind::tova_layer;
      run(s);
      break;
    }
    case Kind::kvpop: {
      const auto w = score::load_mlstm_weights<MemorySpace>(c.weights_file(), c.config());
      f(score::MLstm<MemorySpace>(w, c.norm == kvmem_ref::MLstmNorm::xlstm ? score::MLstmNormalizer::xlstm
                                                                           : score::MLstmNormalizer::plain));
      break;
    }
    case Kind::given: {
      GivenScores<MemorySpace> s;
      Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> g("given", c.B, c.Hkv, c.T);
      Kokkos::deep_copy(g, Kokkos::View<const double***, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                               c.given.data(), c.B, c.Hkv, c.T));
      s.scores = g;
      run(s);
      break;
    }
  }
}

enum class Mode { prefill, decode, prefill_then_decode, two_prefills };

/// What the memory produced: y [B, Hq, T, Dv], the cache after the last step per (b, h) (index b * Hkv + h),
/// and in decode mode (with `record`) the cache after every step.
struct EvictOutput {
  std::vector<float> y;
  std::vector<float> lse;  // [B, Hq, T], the readout's log-sum-exp
  std::vector<long> rows;
  std::vector<std::vector<long>> kept;
  std::vector<std::vector<std::vector<long>>> steps;
};

/// rows and positions of mem.kept(), checking that positions increase and are -1 past the rows.
template <class Memory>
void read_kept(const Memory& mem, long B, long Hkv, long K, std::vector<long>& rows, std::vector<std::vector<long>>& kept) {
  using space = typename Memory::memory_space;
  Kokkos::View<long***, space> pos("kept_positions", B, Hkv, K);
  Kokkos::View<long**, space> rw("kept_rows", B, Hkv);
  mem.kept(pos, rw);
  auto ph = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pos);
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), rw);
  rows.assign(B * Hkv, 0);
  kept.assign(B * Hkv, {});
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < Hkv; ++h) {
      const long n = rh(b, h);
      REQUIRE(n >= 0);
      REQUIRE(n < K);  // K is chosen one past the most rows a head can hold
      rows[b * Hkv + h] = n;
      for (long i = 0; i < K; ++i) {
        if (i < n) kept[b * Hkv + h].push_back(ph(b, h, i));
        else REQUIRE(ph(b, h, i) == -1);
      }
    }
}

/// The cached positions of every (b, h) in increasing order, read from the memory's cache views (no kernel:
/// this runs after every decode step).
template <class Memory>
std::vector<std::vector<long>> cached_positions(const Memory& mem) {
  const auto& cache = mem.cache();
  auto live = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cache.live);
  auto order = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cache.order);
  auto positions = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cache.positions);
  std::vector<std::vector<long>> out;
  for (long b = 0; b < static_cast<long>(live.extent(0)); ++b)
    for (long h = 0; h < static_cast<long>(live.extent(1)); ++h) {
      out.emplace_back();
      for (long i = 0; i < live(b, h); ++i) out.back().push_back(positions(b, h, order(b, h, i)));
    }
  return out;
}

/// The eviction memory over case c with tokens in the storage type S (outputs widened back to float). Every
/// call asks for the readout's log-sum-exp (the AttentionMemory overloads with lse).
template <kvmem::StorageType S = float, class ExecSpace, class Scorer>
EvictOutput run_with(const EvictCase& c, const Scorer& scorer, Mode mode, long split, bool record, const ExecSpace& exec) {
  using space = typename ExecSpace::memory_space;
  const auto q = to_device<space, S>(c.q, c.B, c.Hq, c.T, c.D, "q");
  const auto k = to_device<space, S>(c.k, c.B, c.Hkv, c.T, c.D, "k");
  const auto v = to_device<space, S>(c.v, c.B, c.Hkv, c.T, c.Dv, "v");
  view4<space, S> y("y", c.B, c.Hq, c.T, c.Dv);
  Kokkos::View<float***, Kokkos::LayoutRight, space> lse("lse", c.B, c.Hq, c.T);
  Kokkos::deep_copy(lse, -std::numeric_limits<float>::infinity());  // what a prefill writes past a sequence
  using memory_t = kvmem::EvictionMemory<ExecSpace, Scorer, S>;
  memory_t mem(c.config(), static_cast<int>(c.B), scorer, exec);
  const long K = std::min(c.budget(), c.T) + 1;
  std::vector<long> len(c.B);
  for (long b = 0; b < c.B; ++b) len[b] = c.length(b);
  split = std::min(split, c.T);
  auto slice = [](const view4<space, S>& x, long from, long to) {
    return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(from, to), Kokkos::ALL);
  };
  auto in = [&](long from, long to) { return typename memory_t::inputs{slice(q, from, to), slice(k, from, to), slice(v, from, to)}; };
  auto lse_of = [&](long from, long to) { return Kokkos::subview(lse, Kokkos::ALL, Kokkos::ALL, std::make_pair(from, to)); };
  EvictOutput out;
  if (record) out.steps.assign(c.B * c.Hkv, {});
  long first_decoded = c.T;
  std::vector<long> head(c.B), tail(c.B);
  for (long b = 0; b < c.B; ++b) head[b] = std::min(len[b], split), tail[b] = std::max(0L, len[b] - split);
  switch (mode) {
    case Mode::prefill: mem.prefill(in(0, c.T), y, len, lse); break;
    case Mode::decode: first_decoded = 0; break;
    case Mode::prefill_then_decode:
      mem.prefill(in(0, split), slice(y, 0, split), head, lse_of(0, split));
      first_decoded = split;
      break;
    case Mode::two_prefills:
      mem.prefill(in(0, split), slice(y, 0, split), head, lse_of(0, split));
      mem.prefill(in(split, c.T), slice(y, split, c.T), tail, lse_of(split, c.T));
      break;
  }
  std::vector<unsigned char> active(c.B);
  for (long t = first_decoded; t < c.T; ++t) {
    for (long b = 0; b < c.B; ++b) active[b] = t < len[b];
    mem.decode(in(t, t + 1), slice(y, t, t + 1), active, lse_of(t, t + 1));
    if (record) {
      const auto kept = cached_positions(mem);
      for (long b = 0; b < c.B; ++b)
        for (long h = 0; h < c.Hkv; ++h)
          if (active[b]) out.steps[b * c.Hkv + h].push_back(kept[b * c.Hkv + h]);
    }
  }
  for (long b = 0; b < c.B; ++b) REQUIRE(mem.tokens(b) == len[b]);
  read_kept(mem, c.B, c.Hkv, K, out.rows, out.kept);
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  for (std::size_t i = 0; i < yh.size(); ++i) out.y.push_back(kvmem::to_float(yh.data()[i]));
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  out.lse.assign(lh.data(), lh.data() + lh.size());
  return out;
}

template <class ExecSpace = host_exec, kvmem::StorageType S = float>
EvictOutput run_evict(const EvictCase& c, Mode mode, long split = 0, bool record = false, const ExecSpace& exec = ExecSpace()) {
  EvictOutput out;
  with_scorer<typename ExecSpace::memory_space>(c, [&](const auto& scorer) { out = run_with<S>(c, scorer, mode, split, record, exec); });
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void require_same_bits(const EvictOutput& a, const EvictOutput& b) {
  REQUIRE(a.rows == b.rows);
  REQUIRE(a.kept == b.kept);
  REQUIRE(same_bits(a.y, b.y));
  REQUIRE(same_bits(a.lse, b.lse));
}

/// Largest |got - want| / max(1, max |want|).
double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0.0, scale = 1.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
  return worst / scale;
}

/// The memory's output of case c against the reference, per (sequence, kv-head): the cached positions after
/// the last step exactly (and after every step when recorded), y to `tolerance`, y past a sequence zero.
/// The reference of every kv-head of sequence b (TOVA's layer mean: all kv-heads at once).
std::vector<kvmem_ref::EvictResult> reference(const EvictCase& c, long b) {
  std::vector<kvmem_ref::EvictResult> refs;
  if (c.kind == Kind::tova_layer) {
    std::vector<kvmem_ref::EvictHead> heads;
    for (long h = 0; h < c.Hkv; ++h) heads.push_back(c.head(b, h));
    return kvmem_ref::evict_decode_layer(heads, c.policy(b, 0));
  }
  for (long h = 0; h < c.Hkv; ++h) refs.push_back(kvmem_ref::evict_decode(c.head(b, h), c.policy(b, h)));
  return refs;
}

void check_reference(const EvictCase& c, const EvictOutput& got, double tol = tolerance) {
  for (long b = 0; b < c.B; ++b) {
    const auto refs = reference(c, b);
    for (long h = 0; h < c.Hkv; ++h) {
      INFO("sequence " << b << " (length " << c.length(b) << "), kv-head " << h);
      const auto& ref = refs[h];
      const long idx = b * c.Hkv + h, n = c.length(b);
      REQUIRE(got.kept[idx] == ref.kept);
      REQUIRE(got.rows[idx] == static_cast<long>(ref.kept.size()));
      REQUIRE(got.rows[idx] <= std::min(c.budget(), n));
      if (!got.steps.empty()) {
        REQUIRE(static_cast<long>(got.steps[idx].size()) == n);
        for (long t = 0; t < n; ++t) {
          INFO("after step " << t);
          REQUIRE(got.steps[idx][t] == ref.attended[t]);
        }
      }
      std::vector<float> y, lse;
      for (long g = 0; g < c.G(); ++g)
        for (long t = 0; t < n; ++t) {
          for (long d = 0; d < c.Dv; ++d) y.push_back(got.y[((b * c.Hq + h * c.G() + g) * c.T + t) * c.Dv + d]);
          lse.push_back(got.lse[(b * c.Hq + h * c.G() + g) * c.T + t]);
        }
      CHECK(relative_error(y, ref.y) <= tol);
      CHECK(relative_error(lse, ref.lse) <= tol);
    }
  }
  for (long b = 0; b < c.B; ++b)
    for (long hq = 0; hq < c.Hq; ++hq)
      for (long t = c.length(b); t < c.T; ++t)
        for (long d = 0; d < c.Dv; ++d) REQUIRE(got.y[((b * c.Hq + hq) * c.T + t) * c.Dv + d] == 0.0f);
}

/// Case c in every mode: prefill against the reference; decode token by token (its cache after every step
/// against the reference's attended sets), two prefills split in the middle, and a prefill followed by a few
/// decode steps, each bit for bit = prefill.
void check_case(const EvictCase& c) {
  INFO(c.describe());
  const auto whole = run_evict(c, Mode::prefill);
  check_reference(c, whole);
  const auto decoded = run_evict(c, Mode::decode, 0, /*record=*/true);
  check_reference(c, decoded);
  {
    INFO("decode == prefill");
    require_same_bits(whole, decoded);
  }
  {
    INFO("two prefills split at " << c.T / 2);
    require_same_bits(whole, run_evict(c, Mode::two_prefills, c.T / 2));
  }
  {
    const long split = std::max(0L, c.T - 3);  // a few decode steps after a prefill
    INFO("prefill then decode from " << split);
    require_same_bits(whole, run_evict(c, Mode::prefill_then_decode, split));
  }
}

/// The spec's edge cases (§1 "Edge cases", Q7) for scorer `kind`.
std::vector<EvictCase> edge_cases(Kind kind) {
  std::vector<EvictCase> cases;
  auto add = [&](auto edit) {
    EvictCase c;
    c.kind = kind;
    c.seed = static_cast<unsigned>(100 * static_cast<int>(kind) + cases.size() + 1);
    edit(c);
    c.generate();
    cases.push_back(c);
  };
  add([](EvictCase&) {});                                                     // s = 2, w = 3, k = 5, T = 40
  add([](EvictCase& c) { c.top_k = 0; });                                     // k = 0: sinks + window
  add([](EvictCase& c) { c.sinks = 45; });                                    // s > T: plain causal
  add([](EvictCase& c) { c.sinks = 40; });                                    // s = T
  add([](EvictCase& c) { c.window = 50; });                                   // w > T
  add([](EvictCase& c) { c.window = 40; c.sinks = 0; });                      // w = T
  add([](EvictCase& c) { c.sinks = 15, c.window = 25; });                     // s + w = T, each < T
  add([](EvictCase& c) { c.sinks = 15, c.window = 24, c.top_k = 0; });        // one eligible token, k = 0
  add([](EvictCase& c) { c.sinks = 0, c.window = 1, c.top_k = 6; });          // TOVA(B) = (0, 1, B)
  add([](EvictCase& c) { c.sinks = 0, c.window = 4, c.top_k = 3; });          // H2O(heavy, recent) = (0, recent + 1, heavy)
  add([](EvictCase& c) { c.Hq = 3, c.Hkv = 3; });                             // G = 1, Hkv > 1
  add([](EvictCase& c) { c.Hq = 8, c.Hkv = 2, c.T = 37; });                   // G = 4
  add([](EvictCase& c) { c.B = 3, c.Hq = 4, c.Hkv = 2, c.lengths = {40, 0, 17}; });  // ragged, an empty sequence
  add([](EvictCase& c) { c.B = 2, c.T = 23, c.lengths = {1, 23}, c.sinks = 1, c.window = 2, c.top_k = 2; });
  add([](EvictCase& c) { c.D = 6, c.Dv = 10, c.T = 33; });                    // D != Dv
  add([](EvictCase& c) { c.D = 4, c.Dv = 2, c.Hq = 4, c.Hkv = 2, c.T = 45, c.sinks = 1, c.window = 2, c.top_k = 3; });
  add([](EvictCase& c) { c.T = 0; });                                         // no token
  add([](EvictCase& c) { c.T = 1; });                                         // one token
  add([](EvictCase& c) { c.T = 2, c.sinks = 0, c.window = 1, c.top_k = 0; }); // the smallest budget
  add([](EvictCase& c) { c.T = 60, c.top_k = 7, c.duplicate_keys = true; });  // ties (knorm, tova)
  add([](EvictCase& c) { c.T = 60, c.Hq = 4, c.Hkv = 2, c.sinks = 1, c.top_k = 4, c.duplicate_keys = true; });
  add([](EvictCase& c) { c.T = 150, c.Hq = 4, c.Hkv = 2, c.sinks = 4, c.window = 8, c.top_k = 10; });
  if (kind != Kind::kvpop) add([](EvictCase& c) { c.T = 80, c.log_gamma = -0.05; });  // opt-in decay, n = 1
  if (kind != Kind::kvpop) add([](EvictCase& c) { c.T = 80, c.log_gamma = -0.05, c.decay = 3; });
  if (kind == Kind::given) {
    add([](EvictCase& c) { c.T = 90, c.given_levels = 3; });  // many exact ties
    add([](EvictCase& c) { c.T = 90, c.given_levels = 4, c.log_gamma = -0.5, c.decay = 1; });
    add([](EvictCase& c) { c.T = 90, c.given_levels = 4, c.log_gamma = -0.5, c.decay = 3, c.B = 2, c.Hkv = 2, c.Hq = 4; });
  }
  if (kind == Kind::kvpop) {  // both normalisers, n = 1 and n = 3, the soft cap and the exp(-m) bound
    for (auto norm : {kvmem_ref::MLstmNorm::xlstm, kvmem_ref::MLstmNorm::plain})
      for (int n : {1, 3}) {
        add([&](EvictCase& c) { c.norm = norm, c.decay = n, c.T = 70, c.Hq = 4, c.Hkv = 2, c.sinks = 3, c.window = 4, c.top_k = 6; });
        add([&](EvictCase& c) { c.norm = norm, c.decay = n, c.B = 2, c.lengths = {50, 31}, c.T = 50, c.D = 6, c.Dv = 4; });
        add([&](EvictCase& c) { c.norm = norm, c.decay = n, c.T = 60, c.gate_scale = 40.0f, c.i_bias = 8.0f; });  // soft cap binds
        add([&](EvictCase& c) { c.norm = norm, c.decay = n, c.T = 60, c.i_bias = -6.0f; });  // exp(-m) > |q.n|
      }
  }
  return cases;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// The worked example of spec §1, through a user-defined scorer

TEST_CASE("eviction: the spec's worked example through a user-defined scorer", "[eviction][example]") {
  // s = 1, w = 2, k = 2, T = 7, static scores [9, 5, 1, 3, 3, 0, 2], log gamma = 0.
  EvictCase c;
  c.kind = Kind::given;
  c.T = 7, c.Hq = 1, c.Hkv = 1, c.D = 4, c.Dv = 3, c.sinks = 1, c.window = 2, c.top_k = 2;
  c.generate();
  c.given = {9, 5, 1, 3, 3, 0, 2};
  const std::vector<std::vector<long>> spec = {{0},          {0, 1},          {0, 1, 2},      {0, 1, 2, 3},
                                               {0, 1, 2, 3, 4}, {0, 1, 3, 4, 5}, {0, 1, 4, 5, 6}};
  // the reference
  const auto ref = kvmem_ref::evict_decode(c.head(0, 0), c.policy(0, 0));
  REQUIRE(ref.attended == spec);
  REQUIRE(ref.kept == std::vector<long>{0, 1, 4, 5, 6});
  // the memory, token by token and in one prefill
  const auto decoded = run_evict(c, Mode::decode, 0, true);
  REQUIRE(decoded.steps[0] == spec);
  REQUIRE(decoded.kept[0] == std::vector<long>{0, 1, 4, 5, 6});
  REQUIRE(decoded.rows[0] == 5);
  const auto whole = run_evict(c, Mode::prefill);
  REQUIRE(whole.kept[0] == std::vector<long>{0, 1, 4, 5, 6});
  require_same_bits(whole, decoded);
  check_reference(c, whole);
  // the Fenwick mask of §5 gives the same rows
  kvmem::training::RunningTopK mask(c.given, 1, 2, 2);
  for (long q = 0; q < 7; ++q) {
    std::vector<long> row;
    for (long t = 0; t < 7; ++t)
      if (mask.kept(q, t)) row.push_back(t);
    REQUIRE(row == spec[q]);
  }
}

// ---------------------------------------------------------------------------------------------------
// The reference against itself: §4's claim decode == brute force for static scores and n = 1

TEST_CASE("eviction: reference decode equals the brute-force top-k for static scores, n = 1", "[eviction][reference]") {
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::kvpop, Kind::given})
    for (int levels : {0, 3}) {
      EvictCase c;
      c.kind = kind, c.T = 120, c.Hq = 2, c.Hkv = 1, c.sinks = 3, c.window = 5, c.top_k = 9;
      c.given_levels = levels, c.duplicate_keys = levels > 0, c.log_gamma = kind == Kind::given && levels ? -0.5 : 0.0;
      c.seed = 7 + static_cast<unsigned>(kind);
      c.generate();
      INFO(c.describe());
      const auto x = c.head(0, 0);
      const auto p = c.policy(0, 0);
      const auto ref = kvmem_ref::evict_decode(x, p);
      const auto kappa = kvmem_ref::static_keys(x, p);
      for (long q = 0; q < c.T; ++q) REQUIRE(ref.attended[q] == kvmem_ref::topk_row(kappa, c.sinks, c.window, c.top_k, q));
    }
  // StreamingLLM keeps the sinks and the last w + k tokens.
  EvictCase c;
  c.kind = Kind::streaming, c.T = 50, c.sinks = 2, c.window = 3, c.top_k = 4;
  c.generate();
  const auto ref = kvmem_ref::evict_decode(c.head(0, 0), c.policy(0, 0));
  REQUIRE(ref.kept == std::vector<long>{0, 1, 43, 44, 45, 46, 47, 48, 49});
}

// ---------------------------------------------------------------------------------------------------
// The kernels against the reference

TEST_CASE("eviction: kernels match the reference for every scorer on the edge cases; all modes give the same bits",
          "[eviction][reference][modes]") {
  for (Kind kind : all_kinds)
    for (const auto& c : edge_cases(kind)) check_case(c);
}

TEST_CASE("eviction: kvpop over long positions, where the decay term dominates (§4, Q9)", "[eviction][reference]") {
  // theta = -30: log gamma = log 0.999 (to 1e-13), so (q - t) log gamma reaches -2 against scores of O(1).
  for (auto norm : {kvmem_ref::MLstmNorm::xlstm, kvmem_ref::MLstmNorm::plain})
    for (int n : {1, 3}) {
      EvictCase c;
      c.kind = Kind::kvpop, c.norm = norm, c.decay = n;
      c.T = 2000, c.Hq = 2, c.Hkv = 1, c.D = 8, c.Dv = 8, c.sinks = 4, c.window = 8, c.top_k = 8;
      c.theta_all = -30.0f, c.w_s_scale = 0.5f;
      c.seed = 31 + n;
      c.generate();
      INFO(c.describe());
      REQUIRE(c.policy(0, 0).mlstm.log_gamma() == Catch::Approx(std::log(0.999)).epsilon(1e-12));
      const auto whole = run_evict(c, Mode::prefill);
      const auto ref = kvmem_ref::evict_decode(c.head(0, 0), c.policy(0, 0));
      REQUIRE(whole.kept[0] == ref.kept);
      std::vector<float> y(whole.y.begin(), whole.y.end());  // [Hq = G, T, Dv]
      CHECK(relative_error(y, ref.y) <= tolerance);
      require_same_bits(whole, run_evict(c, Mode::two_prefills, 1234));
      if (n == 1) {  // the decay matters: with log gamma = log 0.999999 the policy keeps other tokens
        auto no_decay = c;
        no_decay.theta_all = 80.0f;
        no_decay.generate();
        REQUIRE(kvmem_ref::evict_decode(no_decay.head(0, 0), no_decay.policy(0, 0)).kept != ref.kept);
      }
    }
}

TEST_CASE("eviction: TOVA's layer mean evicts the same token from every kv-head; with one kv-head it is the group mean",
          "[eviction][reference]") {
  for (long Hkv : {1L, 3L}) {
    EvictCase c;
    c.kind = Kind::tova_layer, c.B = 2, c.T = 70, c.lengths = {70, 44}, c.Hq = 2 * Hkv, c.Hkv = Hkv;
    c.sinks = 1, c.window = 2, c.top_k = 5, c.duplicate_keys = true, c.seed = 90 + static_cast<unsigned>(Hkv);
    c.generate();
    INFO(c.describe());
    const auto layer = run_evict(c, Mode::decode, 0, true);
    check_reference(c, layer);
    for (long b = 0; b < c.B; ++b)
      for (long h = 1; h < c.Hkv; ++h) REQUIRE(layer.steps[b * c.Hkv + h] == layer.steps[b * c.Hkv]);
    auto group = c;
    group.kind = Kind::tova;
    const auto per_head = run_evict(group, Mode::prefill);
    if (Hkv == 1) require_same_bits(layer, per_head);
    else REQUIRE(layer.kept != per_head.kept);  // the layer mean is another policy
  }
}

// ---------------------------------------------------------------------------------------------------
// Decode == Fenwick mask == brute force (§4, §5)

TEST_CASE("eviction: decode's cache at every step is the row of the Fenwick mask (static scorers, n = 1)",
          "[eviction][mask]") {
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::kvpop, Kind::given})
    for (int variant = 0; variant < 3; ++variant) {
      // kvpop: xlstm, plain, and xlstm with f ~ 1 and a small input gate: m_t = F_t (the m_{-1} = 0 term of
      // §3) for many steps, which reaches the scores through eps exp(m) of the xlstm normaliser (~1e-7)
      if (kind != Kind::kvpop && variant > 0) continue;
      const auto norm = variant == 1 ? kvmem_ref::MLstmNorm::plain : kvmem_ref::MLstmNorm::xlstm;
      EvictCase c;
      if (variant == 2) c.i_bias = -2.0f, c.f_bias = 6.0f;
      c.kind = kind, c.norm = norm, c.B = 2, c.lengths = {150, 97}, c.T = 150, c.Hq = 4, c.Hkv = 2;
      c.sinks = 3, c.window = 5, c.top_k = 9, c.duplicate_keys = true, c.given_levels = 3;
      c.log_gamma = kind == Kind::given ? -0.25 : 0.0;
      c.seed = 50 + static_cast<unsigned>(kind);
      c.generate();
      INFO(c.describe());
      const auto decoded = run_evict(c, Mode::decode, 0, true);
      check_reference(c, decoded);
      const auto k = to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k");
      const auto v = to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v");
      with_scorer<host_mem>(c, [&](const auto& scorer) {
        using S = std::remove_cvref_t<decltype(scorer)>;
        if constexpr (!S::needs_probabilities) {
          const auto masks = kvmem::training::eviction_masks(host_exec(), c.config(), scorer, k, v, c.lengths);
          REQUIRE(static_cast<long>(masks.size()) == c.B * c.Hkv);
          // the static keys kappa of the library (recurrence) against the reference (closed form)
          S bound = scorer;
          bound.bind(c.B, c.config());
          bound.reset();
          Kokkos::View<long*, host_mem> len("len", c.B);
          for (long b = 0; b < c.B; ++b) len(b) = c.length(b);
          Kokkos::View<double***, Kokkos::LayoutRight, host_mem> kappa("kappa", c.B, c.Hkv, c.T);
          kvmem::kernels::static_scores(host_exec(), kvmem::kernels::EvictionParams::of(c.config()), bound, k, v, len, kappa);
          host_exec().fence();
          for (long b = 0; b < c.B; ++b)
            for (long h = 0; h < c.Hkv; ++h) {
              INFO("sequence " << b << ", kv-head " << h);
              const auto& mask = masks[b * c.Hkv + h];
              const long n = c.length(b);
              REQUIRE(mask.tokens() == n);
              const auto ref_kappa = kvmem_ref::static_keys(c.head(b, h), c.policy(b, h));
              // KVPOP's mLSTM and KNorm's sum run in float32 against the float64 reference (docs/numerics.md,
              // "Eviction statistics"; the mLSTM here within 3.7e-7 (1 + |kappa|)).
              const double kappa_tolerance = kind == Kind::kvpop || kind == Kind::knorm ? 1e-5 : 1e-9;
              for (long t = 0; t < n; ++t) {
                if (std::isnan(ref_kappa[t])) {
                  REQUIRE(kappa(b, h, t) == -std::numeric_limits<double>::infinity());  // never scored (§2)
                  continue;
                }
                INFO("token " << t);
                REQUIRE(std::abs(kappa(b, h, t) - ref_kappa[t]) <= kappa_tolerance * (1.0 + std::abs(ref_kappa[t])));
              }
              for (long q = 0; q < n; ++q) {
                INFO("query " << q);
                std::vector<long> row;
                for (long t = 0; t < n; ++t)
                  if (mask.kept(q, t)) row.push_back(t);
                REQUIRE(row == decoded.steps[b * c.Hkv + h][q]);
                REQUIRE(row == kvmem_ref::topk_row(ref_kappa, c.sinks, c.window, c.top_k, q));
              }
            }
        }
      });
    }
}

TEST_CASE("eviction: RunningTopK equals the brute-force mask on keys with many ties", "[eviction][mask]") {
  struct Shape {
    long T;
    int s, w, k;
  };
  const Shape shapes[] = {{4096, 4, 64, 100}, {4096, 0, 1, 7}, {1000, 0, 1, 0},  {1000, 3, 5, 0},   {300, 400, 2, 5},
                          {300, 300, 2, 5},  {300, 3, 400, 5}, {300, 0, 300, 5}, {777, 10, 20, 1},  {2000, 5, 10, 1500},
                          {0, 1, 1, 1},      {1, 0, 1, 1},     {2, 0, 1, 1},     {64, 1, 1, 64},    {65, 0, 2, 63}};
  std::mt19937 rng(2024);
  for (const auto& sh : shapes)
    for (int keys = 0; keys < 4; ++keys) {
      if (sh.T == 4096 && keys != (sh.k == 7 ? 1 : 0)) continue;  // the long shapes: one tie-heavy key set each
      // 0: integers in [0, 4); 1: all equal; 2: random doubles; 3: integers with -inf (never scored) at the end
      std::vector<double> kappa(sh.T);
      std::uniform_int_distribution<int> level(0, 3);
      std::normal_distribution<double> normal;
      for (long t = 0; t < sh.T; ++t)
        kappa[t] = keys == 0 || keys == 3 ? level(rng) : keys == 1 ? 1.5 : normal(rng);
      if (keys == 3)
        for (long t = std::max(0L, sh.T - 5); t < sh.T; ++t) kappa[t] = -std::numeric_limits<double>::infinity();
      INFO("T=" << sh.T << " s=" << sh.s << " w=" << sh.w << " k=" << sh.k << " keys=" << keys);
      const kvmem::training::RunningTopK mask(kappa, sh.s, sh.w, sh.k);
      REQUIRE(mask.tokens() == sh.T);
      std::vector<long> row;
      for (long q = 0; q < sh.T; ++q) {
        row.clear();
        for (long t = 0; t <= q + 3 && t < sh.T; ++t)
          if (mask.kept(q, t)) row.push_back(t);
        const auto want = kvmem_ref::topk_row(kappa, sh.s, sh.w, sh.k, q);
        if (row != want) {
          INFO("query " << q);
          REQUIRE(row == want);
        }
        REQUIRE(static_cast<long>(row.size()) <= static_cast<long>(sh.s) + sh.w + sh.k);
      }
    }
}

// ---------------------------------------------------------------------------------------------------
// Determinism: threads and backends

namespace {
EvictCase thread_case(Kind kind) {
  EvictCase c;
  c.kind = kind, c.B = 3, c.T = 90, c.lengths = {90, 41, 77}, c.Hq = 4, c.Hkv = 2;
  c.sinks = 2, c.window = 4, c.top_k = 7, c.duplicate_keys = true;
  c.seed = 300 + static_cast<unsigned>(kind);
  c.generate();
  return c;
}
}  // namespace

TEST_CASE("eviction: a prefill split anywhere, or continued in decode, gives the bits of one prefill", "[eviction][modes]") {
  // splits inside the window, at the window's first exit, past a short sequence (ragged lengths 90, 41, 77)
  for (Kind kind : all_kinds) {
    const auto c = thread_case(kind);
    INFO(c.describe());
    const auto whole = run_evict(c, Mode::prefill);
    for (long split : {1L, 3L, 6L, 7L, 40L, 41L, 60L, 89L}) {
      INFO("split at " << split);
      require_same_bits(whole, run_evict(c, Mode::two_prefills, split));
    }
    require_same_bits(whole, run_evict(c, Mode::prefill_then_decode, 70));
  }
}

TEST_CASE("eviction: reruns and reset() give the same bits", "[eviction][determinism]") {
  for (Kind kind : all_kinds) {
    const auto c = thread_case(kind);
    INFO(c.describe());
    const auto first = run_evict(c, Mode::prefill);
    require_same_bits(first, run_evict(c, Mode::prefill));
    // a memory that ran another batch, then reset(), gives the bits of a fresh one
    with_scorer<host_mem>(c, [&](const auto& scorer) {
      using S = std::remove_cvref_t<decltype(scorer)>;
      kvmem::EvictionMemory<host_exec, S> mem(c.config(), static_cast<int>(c.B), scorer);
      auto other = c;
      other.seed += 1000;
      other.generate();
      view4<host_mem> y("y", c.B, c.Hq, c.T, c.Dv);
      std::vector<long> len(c.lengths);
      mem.prefill(to_device<host_mem>(other.q, c.B, c.Hq, c.T, c.D, "q"), to_device<host_mem>(other.k, c.B, c.Hkv, c.T, c.D, "k"),
                  to_device<host_mem>(other.v, c.B, c.Hkv, c.T, c.Dv, "v"), y);
      mem.reset();
      for (long b = 0; b < c.B; ++b) REQUIRE(mem.tokens(b) == 0);
      Kokkos::View<float***, Kokkos::LayoutRight, host_mem> lse("lse", c.B, c.Hq, c.T);
      mem.prefill(typename kvmem::EvictionMemory<host_exec, S>::inputs{to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q"), to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k"),
                   to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v")},
                  y, len, lse);
      EvictOutput again;
      read_kept(mem, c.B, c.Hkv, std::min(c.budget(), c.T) + 1, again.rows, again.kept);
      again.y.assign(y.data(), y.data() + y.size());
      again.lse.assign(lse.data(), lse.data() + lse.size());
      require_same_bits(first, again);
    });
  }
}

#ifdef KOKKOS_ENABLE_OPENMP
TEST_CASE("eviction: OpenMP on one thread and on every thread give the same bits", "[eviction][backends][determinism]") {
  const int all = Kokkos::OpenMP().concurrency();
  if (all < 2) WARN("the OpenMP pool has " << all << " thread(s): nothing to compare against one thread");
  for (Kind kind : all_kinds)
    for (bool merge : {false, true}) {
    auto c = thread_case(kind);
    c.merge = merge;
    INFO(c.describe());
    for (Mode mode : {Mode::prefill, Mode::decode}) {
      INFO("mode=" << static_cast<int>(mode));
      const auto one = run_evict(c, mode, 0, false, Kokkos::OpenMP(1));
      require_same_bits(one, run_evict(c, mode, 0, false, Kokkos::OpenMP()));
      if (all > 2) require_same_bits(one, run_evict(c, mode, 0, false, Kokkos::OpenMP(2)));
    }
    }
}
#endif

/// y, and per (b, h) the cached positions and statistics in position order, of kernels::eviction_tokens run
/// directly on the default host space over every token of case c with `team_size` threads per team.
struct TeamRun {
  std::vector<float> y;
  std::vector<std::vector<long>> kept;
  std::vector<std::vector<double>> stats;
};
template <class Scorer>
TeamRun run_team(const EvictCase& c, Scorer scorer, int team_size) {
  const auto q = to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q");
  const auto k = to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k");
  const auto v = to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v");
  view4<host_mem, float> y("y", c.B, c.Hq, c.T, c.Dv);
  scorer.bind(c.B, c.config());
  kvmem::state::EvictionCache<host_mem> cache;
  cache.allocate(c.B, static_cast<int>(c.Hkv), c.budget() + 1, static_cast<int>(c.D), static_cast<int>(c.Dv),
                 Scorer::needs_probabilities, c.merge);
  Kokkos::View<long*, host_mem> first("first", c.B), len("len", c.B);
  for (long b = 0; b < c.B; ++b) len(b) = c.length(b);
  kvmem::kernels::eviction_tokens(host_exec(), kvmem::kernels::EvictionParams::of(c.config()), cache, scorer, q, k, v,
                                  y, first, len, team_size);
  host_exec().fence();
  TeamRun r;
  r.y.assign(y.data(), y.data() + y.size());
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      r.kept.emplace_back();
      r.stats.emplace_back();
      for (long i = 0; i < cache.live(b, h); ++i) {
        const int s = cache.order(b, h, i);
        r.kept.back().push_back(cache.positions(b, h, s));
        r.stats.back().push_back(cache.stats(b, h, s));
      }
    }
  return r;
}

TEST_CASE("eviction: every team size gives the bits of a team of one thread (order shift, mLSTM, attend)",
          "[eviction][backends][determinism]") {
  const int threads = host_exec().concurrency();
  if (threads < 2) WARN("the host space has " << threads << " thread(s): only teams of one thread run");
  for (Kind kind : all_kinds)
    for (bool merge : {false, true}) {
    auto c = thread_case(kind);  // ragged lengths, duplicate keys, evictions from the 7th step on
    c.merge = merge;
    INFO(c.describe());
    with_scorer<host_mem>(c, [&](const auto& scorer) {
      const auto one = run_team(c, scorer, 1);
      REQUIRE(one.kept == run_evict(c, Mode::prefill).kept);  // the memory's own cache
      for (int team = 2; team <= std::min(threads, 4); ++team) {
        INFO("team size " << team);
        const auto got = run_team(c, scorer, team);
        REQUIRE(got.kept == one.kept);
        REQUIRE(same_bits(got.y, one.y));
        for (std::size_t i = 0; i < one.stats.size(); ++i)
          for (std::size_t j = 0; j < one.stats[i].size(); ++j)
            REQUIRE(kvmem_test::same_bits(got.stats[i][j], one.stats[i][j]));
      }
    });
    }
}

#ifdef KOKKOS_ENABLE_SERIAL
TEST_CASE("eviction: Serial matches the reference and the default host space bit for bit", "[eviction][backends]") {
  for (Kind kind : all_kinds) {
    const auto c = thread_case(kind);
    INFO(c.describe());
    const auto serial = run_evict<Kokkos::Serial>(c, Mode::prefill);
    check_reference(c, serial);
    require_same_bits(serial, run_evict(c, Mode::prefill));
    require_same_bits(serial, run_evict<Kokkos::Serial>(c, Mode::decode));
  }
}
#endif

// ---------------------------------------------------------------------------------------------------
// SnapKV (§6)

namespace {
void check_snapkv(const EvictCase& c, int W, int top_k, bool same_keys = false) {
  INFO(c.describe() << " W_obs=" << W << " C_max=" << W + top_k);
  const auto q = to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q");
  auto keys = c.k;
  if (same_keys)  // every key equal: exact ties of the pooled scores
    for (long i = 0; i < static_cast<long>(keys.size()); ++i) keys[i] = c.k[i % c.D];
  const auto k = to_device<host_mem>(keys, c.B, c.Hkv, c.T, c.D, "k");
  Kokkos::View<long*, host_mem> len("len", c.B);
  for (long b = 0; b < c.B; ++b) len(b) = c.length(b);
  kvmem::kernels::SnapKvScratch<host_mem> scratch;
  scratch.allocate(c.B, c.Hq, c.Hkv, c.T, W);
  const long K = std::min<long>(c.T, W + top_k) + 2;
  Kokkos::View<long***, host_mem> positions("positions", c.B, c.Hkv, K);
  Kokkos::View<long**, host_mem> rows("rows", c.B, c.Hkv);
  kvmem::kernels::snapkv_keep(host_exec(), q, k, len, W, top_k, scratch, positions, rows);
  host_exec().fence();
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      INFO("sequence " << b << " (length " << c.length(b) << "), kv-head " << h);
      auto x = c.head(b, h);
      for (long i = 0; i < static_cast<long>(x.k.size()); ++i) x.k[i] = keys[((b * c.Hkv + h) * c.T) * c.D + i];
      const auto want = kvmem_ref::snapkv_keep(x.q, x.k, x.G, x.T, x.D, W, W + top_k);
      std::vector<long> got;
      for (long i = 0; i < K; ++i) {
        if (i < rows(b, h)) got.push_back(positions(b, h, i));
        else REQUIRE(positions(b, h, i) == -1);
      }
      REQUIRE(got == want);
      REQUIRE(rows(b, h) == std::min<long>(c.length(b), W + top_k));
      if (same_keys && c.length(b) > W + top_k) {  // the newest top_k interior prefix tokens win the tie
        const long prefix = c.length(b) - W;
        std::vector<long> expect;
        for (long t = prefix - 2 - top_k; t < prefix - 2; ++t) expect.push_back(t);
        for (long t = prefix; t < c.length(b); ++t) expect.push_back(t);
        REQUIRE(got == expect);
      }
    }
}
}  // namespace

TEST_CASE("eviction: snapkv_keep matches the reference", "[eviction][snapkv]") {
  EvictCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 50, c.lengths = {50, 33};
  c.seed = 77;
  c.generate();
  check_snapkv(c, 8, 12);  // T > C_max = 20
  check_snapkv(c, 8, 0);   // keep the window only
  check_snapkv(c, 1, 30);  // W = 1
  check_snapkv(c, 4, 46);  // T = C_max: everything
  check_snapkv(c, 4, 60);  // T < C_max
  check_snapkv(c, 60, 3);  // L < W
  check_snapkv(c, 8, 12, /*same_keys=*/true);
  check_snapkv(c, 5, 7, /*same_keys=*/true);
  EvictCase g1;
  g1.B = 1, g1.Hq = 3, g1.Hkv = 3, g1.T = 64, g1.D = 6, g1.seed = 78;
  g1.generate();
  check_snapkv(g1, 6, 10);
  EvictCase empty;
  empty.B = 2, empty.T = 20, empty.lengths = {0, 20};
  empty.generate();
  check_snapkv(empty, 4, 4);
}

// ---------------------------------------------------------------------------------------------------
// The memory is bounded

TEST_CASE("eviction: held_bytes is fixed by the budget and the cache never holds more rows", "[eviction][budget]") {
  EvictCase c;
  c.kind = Kind::h2o, c.B = 2, c.Hq = 4, c.Hkv = 2, c.T = 300, c.lengths = {300, 211};
  c.sinks = 2, c.window = 4, c.top_k = 6;
  c.generate();
  const long budget = 12, expect = c.B * c.Hkv * (budget + 1) * (c.D + c.Dv) * 4;
  with_scorer<host_mem>(c, [&](const auto& scorer) {
    using S = std::remove_cvref_t<decltype(scorer)>;
    kvmem::EvictionMemory<host_exec, S> mem(c.config(), static_cast<int>(c.B), scorer);
    REQUIRE(mem.config().budget() == budget);
    REQUIRE(mem.held_bytes() == expect);
    REQUIRE(mem.cache().slots() == budget + 1);
    REQUIRE(static_cast<long>((mem.cache().keys.size() + mem.cache().values.size()) * sizeof(float)) == expect);
    view4<host_mem> y("y", c.B, c.Hq, c.T, c.Dv);
    mem.prefill(to_device<host_mem>(c.q, c.B, c.Hq, c.T, c.D, "q"), to_device<host_mem>(c.k, c.B, c.Hkv, c.T, c.D, "k"),
                to_device<host_mem>(c.v, c.B, c.Hkv, c.T, c.Dv, "v"), y, c.lengths);
    REQUIRE(mem.held_bytes() == expect);
    REQUIRE(mem.cache().slots() == budget + 1);
  });
  const auto decoded = run_evict(c, Mode::decode, 0, true);
  for (long b = 0; b < c.B; ++b)
    for (long h = 0; h < c.Hkv; ++h) {
      const auto& steps = decoded.steps[b * c.Hkv + h];
      for (long t = 0; t < c.length(b); ++t) REQUIRE(static_cast<long>(steps[t].size()) == std::min(t + 1, budget));
      REQUIRE(decoded.rows[b * c.Hkv + h] == budget);
    }
  // StreamingLLM (s, w, k) is the sliding window (s, w + k, 0) (§6)
  auto streaming = c;
  streaming.kind = Kind::streaming;
  auto wide = streaming;
  wide.window = streaming.window + streaming.top_k, wide.top_k = 0;
  require_same_bits(run_evict(streaming, Mode::prefill), run_evict(wide, Mode::prefill));
}

// ---------------------------------------------------------------------------------------------------
// Merging eviction (EvictionConfig::merge_evicted)

TEST_CASE("merging eviction: kernels match the reference for every scorer on the edge cases; all modes give the same bits",
          "[eviction][merge][reference][modes]") {
  for (Kind kind : all_kinds) {
    auto cases = edge_cases(kind);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      // KVPOP's 16 normaliser cases (from index 22: xlstm n = 1, 3, plain n = 1, 3, four each): n = 1 of both
      // normalisers, plain and with the soft cap binding (its reference is O(T^3) with merging).
      if (kind == Kind::kvpop && i >= 22 && i != 22 && i != 24 && i != 30 && i != 32) continue;
      auto c = cases[i];
      c.merge = true;
      check_case(c);
    }
  }
}

TEST_CASE("merging eviction: a split prefill, or one continued in decode, gives the bits of one prefill",
          "[eviction][merge][modes]") {
  for (Kind kind : all_kinds) {
    auto c = thread_case(kind);
    c.merge = true;
    INFO(c.describe());
    const auto whole = run_evict(c, Mode::prefill);
    check_reference(c, whole);
    for (long split : {1L, 5L, 6L, 40L, 41L, 89L}) {
      INFO("split " << split);
      require_same_bits(whole, run_evict(c, Mode::two_prefills, split));
      require_same_bits(whole, run_evict(c, Mode::prefill_then_decode, split));
    }
  }
}

TEST_CASE("merging eviction: merging changes what is read, not which tokens are kept (static scorers)",
          "[eviction][merge]") {
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::given}) {
    auto c = thread_case(kind);
    const auto plain = run_evict(c, Mode::prefill);
    c.merge = true;
    const auto merged = run_evict(c, Mode::prefill);
    INFO(c.describe());
    REQUIRE(merged.kept == plain.kept);   // a static score does not see the merge
    REQUIRE(!same_bits(merged.y, plain.y));  // but the rows and their log-count bias do
  }
}

TEST_CASE("merging eviction: cosine similarity of a zero key is 0, of a NaN key NaN", "[eviction][merge][numerics]") {
  const float zero[4] = {0, 0, 0, 0}, a[4] = {1, 2, 3, 4}, b[4] = {-1, 2, 0.5f, 4};
  const float nan[4] = {1, std::numeric_limits<float>::quiet_NaN(), 0, 0};
  REQUIRE(kvmem::kernels::key_cosine(zero, 0.0f, a, 4) == 0.0f);
  REQUIRE(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), zero, 4) == 0.0f);
  REQUIRE(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), a, 4) == Catch::Approx(1.0f).epsilon(1e-6));
  const double want = (-1 + 4 + 1.5 + 16) / std::sqrt(30.0) / std::sqrt(1 + 4 + 0.25 + 16.0);
  REQUIRE(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), b, 4) == Catch::Approx(want).epsilon(1e-6));
  REQUIRE(std::isnan(kvmem::kernels::key_cosine(a, kvmem::kernels::norm2(a, 4), nan, 4)));
}

TEST_CASE("merging eviction: a row's count saturates at 2^24 tokens and stays a weighted mean",
          "[eviction][merge][numerics]") {
  EvictCase c;
  c.kind = Kind::streaming, c.T = 12, c.Hq = 1, c.Hkv = 1, c.D = 4, c.Dv = 3, c.sinks = 1, c.window = 2, c.top_k = 3;
  c.merge = true;
  c.generate();
  kvmem::EvictionMemory<host_exec, kvmem::score::None> mem(c.config(), 1);
  const auto q = to_device<host_mem>(c.q, 1, 1, c.T, c.D, "q"), k = to_device<host_mem>(c.k, 1, 1, c.T, c.D, "k");
  const auto v = to_device<host_mem>(c.v, 1, 1, c.T, c.Dv, "v");
  view4<host_mem> y("y", 1, 1, c.T, c.Dv);
  const std::vector<long> first{c.T - 1};
  mem.prefill(q, k, v, y, first);  // every token but the last: the cache is full
  const auto& cache = mem.cache();
  const long live = cache.live(0, 0);
  REQUIRE(live == c.budget());
  const float big = kvmem::kernels::max_merge_count - 1.0f;
  for (long i = 0; i < live; ++i) cache.counts(0, 0, cache.order(0, 0, i)) = big;
  std::vector<float> before_keys;
  for (long s = 0; s < cache.slots(); ++s)
    for (int d = 0; d < c.D; ++d) before_keys.push_back(cache.keys(0, 0, s, d));
  auto last = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, std::make_pair(c.T - 1, c.T), Kokkos::ALL); };
  mem.decode(last(q), last(k), last(v), last(y));  // one token in, one row merged into another
  float most = 0;
  long merged_slot = -1;
  for (long i = 0; i < cache.live(0, 0); ++i) {
    const int s = cache.order(0, 0, i);
    if (cache.counts(0, 0, s) > most) most = cache.counts(0, 0, s), merged_slot = s;
  }
  REQUIRE(most == kvmem::kernels::max_merge_count);  // big + big clamps to 2^24
  long evicted_slot = -1;  // the freed slot still holds the evicted row's key
  for (long s = 0; s < cache.slots(); ++s)
    if (cache.positions(0, 0, s) < 0) evicted_slot = s;
  REQUIRE(evicted_slot >= 0);
  for (int d = 0; d < c.D; ++d)  // two rows of equal weight: the mean of the two keys
    REQUIRE(cache.keys(0, 0, merged_slot, d) == kvmem::kernels::mul_add(0.5f, before_keys[merged_slot * c.D + d],
                                                                        0.5f * before_keys[evicted_slot * c.D + d]));
  for (long d = 0; d < c.Dv; ++d) REQUIRE(std::isfinite(y(0, 0, c.T - 1, d)));
}

TEST_CASE("merging eviction: held_bytes adds one float32 count per row", "[eviction][merge][budget]") {
  EvictCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.sinks = 2, c.window = 4, c.top_k = 6, c.merge = true;
  c.generate();
  kvmem::EvictionMemory<host_exec, kvmem::score::None> mem(c.config(), static_cast<int>(c.B));
  REQUIRE(mem.held_bytes() == c.B * c.Hkv * 13 * ((c.D + c.Dv) * 4 + 4));
  REQUIRE(static_cast<long>(mem.cache().counts.size()) == c.B * c.Hkv * 13);
}

// ---------------------------------------------------------------------------------------------------
// Bad input is named

TEST_CASE("eviction: bad EvictionConfig fields are named", "[eviction][errors]") {
  auto good = [] {
    kvmem::EvictionConfig c;
    c.head_dim = 8, c.value_dim = 6, c.query_heads = 4, c.kv_heads = 2, c.sinks = 1, c.window = 2, c.top_k = 3;
    return c;
  };
  REQUIRE_NOTHROW(good().validate());
  auto expect = [&](auto edit, const std::string& text) {
    auto c = good();
    edit(c);
    INFO(text);
    REQUIRE_THROWS_AS(c.validate(), kvmem::invalid_argument);
    REQUIRE_THROWS_WITH(c.validate(), ContainsSubstring(text));
    REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::KeyNorm>(c, 1)), ContainsSubstring(text));
    REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention>(c, 1)), ContainsSubstring(text));
  };
  expect([](auto& c) { c.window = 0; }, "window = 0");
  expect([](auto& c) { c.window = -3; }, "window = -3");
  expect([](auto& c) { c.top_k = -1; }, "top_k = -1");
  expect([](auto& c) { c.sinks = -1; }, "sinks = -1");
  expect([](auto& c) { c.head_dim = 0; }, "head_dim = 0");
  expect([](auto& c) { c.value_dim = 0; }, "value_dim = 0");
  expect([](auto& c) { c.kv_heads = 0; }, "kv_heads = 0");
  expect([](auto& c) { c.query_heads = 3; }, "query_heads = 3");
  expect([](auto& c) { c.query_heads = 0; }, "query_heads = 0");
  expect([](auto& c) { c.decay_interval = 0; }, "decay_interval = 0");
  expect([](auto& c) { c.top_k = 1 << 30; }, "sinks + window + top_k = ");
  REQUIRE_THROWS_WITH((kvmem::EvictionMemory<host_exec, kvmem::score::None>(good(), 0)), ContainsSubstring("batch = 0"));
  // the Fenwick mask checks its policy too, and NaN keys
  const std::vector<double> kappa{1.0, 2.0, std::nan(""), 0.0};
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(std::vector<double>{1, 2}, 0, 0, 1), ContainsSubstring("window = 0"));
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(std::vector<double>{1, 2}, 0, 1, -1), ContainsSubstring("top_k = -1"));
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(std::vector<double>{1, 2}, -2, 1, 1), ContainsSubstring("sinks = -2"));
  REQUIRE_THROWS_WITH(kvmem::training::RunningTopK(kappa, 0, 1, 1), ContainsSubstring("kappa[2]"));
}

TEST_CASE("eviction: mismatched shapes, lengths and strides are named and change nothing", "[eviction][errors]") {
  using V4 = Kokkos::View<float****, host_mem>;
  kvmem::EvictionConfig cfg;
  cfg.head_dim = 8, cfg.value_dim = 6, cfg.query_heads = 4, cfg.kv_heads = 2, cfg.sinks = 1, cfg.window = 2, cfg.top_k = 1;
  const long B = 2, T = 5;
  V4 q("q", B, 4, T, 8), k("k", B, 2, T, 8), v("v", B, 2, T, 6), y("y", B, 4, T, 6);
  Kokkos::deep_copy(q, 0.3f);
  Kokkos::deep_copy(k, 0.2f);
  Kokkos::deep_copy(v, 0.1f);
  kvmem::EvictionMemory<host_exec, kvmem::score::KeyNorm> mem(cfg, static_cast<int>(B));
  REQUIRE_NOTHROW(mem.prefill(q, k, v, y));
  std::vector<long> rows_before, rows_after;
  std::vector<std::vector<long>> kept_before, kept_after;
  read_kept(mem, B, 2, 6, rows_before, kept_before);
  auto throws = [&](auto call, const std::string& text) {
    INFO(text);
    REQUIRE_THROWS_AS(call(), kvmem::invalid_argument);
    REQUIRE_THROWS_WITH(call(), ContainsSubstring(text));
  };
  throws([&] { mem.prefill(V4("q", B, 3, T, 8), k, v, y); }, "q.extent(1) = 3");
  throws([&] { mem.prefill(V4("q", 1, 4, T, 8), k, v, y); }, "q.extent(0) = 1");
  throws([&] { mem.prefill(q, V4("k", B, 2, 4, 8), v, y); }, "k.extent(2) = 4");
  throws([&] { mem.prefill(q, V4("k", B, 1, T, 8), v, y); }, "k.extent(1) = 1");
  throws([&] { mem.prefill(q, V4("k", B, 2, T, 6), v, y); }, "k.extent(3) = 6");
  throws([&] { mem.prefill(q, k, V4("v", B, 2, T, 5), y); }, "v.extent(3) = 5");
  throws([&] { mem.prefill(q, k, v, V4("y", B, 4, T, 8)); }, "y.extent(3) = 8");
  throws([&] { mem.prefill(q, k, v, V4("y", B, 4, 6, 6)); }, "y.extent(2) = 6");
  const std::vector<long> too_long{5, 6}, negative{-1, 2}, one{3};
  throws([&] { mem.prefill(q, k, v, y, too_long); }, "lengths[1] = 6");
  throws([&] { mem.prefill(q, k, v, y, negative); }, "lengths[0] = -1");
  throws([&] { mem.prefill(q, k, v, y, one); }, "lengths.size() = 1");
  Kokkos::View<float*****, host_mem> wide("wide", B, 4, T, 8, 2);
  Kokkos::View<const float****, Kokkos::LayoutStride, host_mem> strided =
      Kokkos::subview(wide, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, 0);
  throws([&] { mem.prefill(strided, k, v, y); }, "q.stride(3) = 2");
  const auto first = std::make_pair(0L, 1L);
  auto s4 = [&](const V4& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, first, Kokkos::ALL); };
  throws([&] { mem.decode(q, k, v, y); }, "q.extent(2) = 5");
  throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(V4("y", B, 4, T, 5))); }, "y.extent(3) = 5");
  const std::vector<unsigned char> short_active{1};
  throws([&] { mem.decode(s4(q), s4(k), s4(v), s4(y), short_active); }, "active.size() = 1");
  throws([&] { mem.kept(Kokkos::View<long***, host_mem>("p", 1, 2, 4), Kokkos::View<long**, host_mem>("r", B, 2)); },
         "positions extents = 1 x 2");
  throws([&] { mem.kept(Kokkos::View<long***, host_mem>("p", B, 2, 4), Kokkos::View<long**, host_mem>("r", B, 1)); },
         "rows extents = 2 x 1");
  // nothing changed
  REQUIRE(mem.tokens(0) == T);
  REQUIRE(mem.tokens(1) == T);
  read_kept(mem, B, 2, 6, rows_after, kept_after);
  REQUIRE(rows_after == rows_before);
  REQUIRE(kept_after == kept_before);
  // eviction_masks: n > 1 (the order depends on q) and mismatched shapes
  auto n3 = cfg;
  n3.decay_interval = 3;
  throws([&] { kvmem::training::eviction_masks(host_exec(), n3, kvmem::score::KeyNorm{}, k, v); }, "decay_interval = 3");
  throws([&] { kvmem::training::eviction_masks(host_exec(), cfg, kvmem::score::KeyNorm{}, k, V4("v", B, 2, T, 5)); },
         "v extents");
  throws([&] { kvmem::training::eviction_masks(host_exec(), cfg, kvmem::score::KeyNorm{}, V4("k", B, 3, T, 8), v); },
         "k.extent(1) = 3");
  throws([&] { kvmem::training::eviction_masks(host_exec(), cfg, kvmem::score::KeyNorm{}, k, v, too_long); },
         "lengths[1] = 6");
}

TEST_CASE("eviction: missing and misshapen mLSTM weights are named", "[eviction][errors]") {
  EvictCase c;
  c.kind = Kind::kvpop, c.Hq = 4, c.Hkv = 2, c.D = 8, c.Dv = 6;
  c.generate();
  const auto cfg = c.config();
  REQUIRE_NOTHROW(kvmem::score::load_mlstm_weights<host_mem>(c.weights_file(), cfg));
  auto throws = [&](auto call, const std::vector<std::string>& texts) {
    REQUIRE_THROWS_AS(call(), kvmem::invalid_argument);
    for (const auto& text : texts) REQUIRE_THROWS_WITH(call(), ContainsSubstring(text));
  };
  for (const char* name : {"w_q", "w_k", "w_v", "w_i", "b_i", "w_f", "b_f", "w_s", "b_s", "theta"}) {
    INFO("missing " << name);
    auto file = c.weights_file();
    file.tensors.erase(name);
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {std::string("'") + name + "'", "missing"});
  }
  {  // a misshapen tensor: w_s [Hkv, h + 1]
    auto file = c.weights_file();
    const std::vector<float> bad(2 * 5, 0.5f);
    file.put("w_s", {2, 5}, bad.data());
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"mLSTM weight 'w_s' shape = [2, 5]", "[2, 4]"});
  }
  {  // w_k with X = D instead of D + Dv
    auto file = c.weights_file();
    const std::vector<float> bad(2 * 8 * 4, 0.5f);
    file.put("w_k", {2, 8, 4}, bad.data());
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"mLSTM weight 'w_k' shape = [2, 8, 4]"});
  }
  {  // theta for one kv-head only
    auto file = c.weights_file();
    const float one = 0.0f;
    file.put("theta", {1}, &one);
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"'theta'"});
  }
  {  // wrong rank
    auto file = c.weights_file();
    const std::vector<float> bad(2, 0.5f);
    file.put("b_i", {2, 1}, bad.data());
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"'b_i' rank = 2"});
  }
  {  // an integer tensor
    auto file = c.weights_file();
    const std::int32_t ints[] = {1, 2};
    file.put("theta", {2}, ints);
    throws([&] { kvmem::score::load_mlstm_weights<host_mem>(file, cfg); }, {"mLSTM weight 'theta' dtype = I32"});
  }
  {  // F64 weights load to the same values
    auto file = c.weights_file();
    std::vector<double> wide(c.w_q.begin(), c.w_q.end());
    file.put("w_q", {2, c.X(), c.h()}, wide.data());
    const auto w = kvmem::score::load_mlstm_weights<host_mem>(file, cfg);
    REQUIRE(w.w_q(1, 3, 2) == c.w_q[(1 * c.X() + 3) * c.h() + 2]);
  }
  // odd head_dim
  auto odd = cfg;
  odd.head_dim = 7;
  throws([&] { kvmem::score::load_mlstm_weights<host_mem>(c.weights_file(), odd); }, {"head_dim = 7", "even"});
  const auto w = kvmem::score::load_mlstm_weights<host_mem>(c.weights_file(), cfg);
  using MLstm = kvmem::score::MLstm<host_mem>;
  throws([&] { kvmem::EvictionMemory<host_exec, MLstm>(odd, 1, MLstm(w)); }, {"head_dim = 7", "even"});
  // weights for another shape, or none at all, are rejected when the memory is built
  auto other = cfg;
  other.value_dim = 8;
  throws([&] { kvmem::EvictionMemory<host_exec, MLstm>(other, 1, MLstm(w)); }, {"mLSTM weight 'w_q' shape = [2, 14, 4]"});
  throws([&] { kvmem::EvictionMemory<host_exec, MLstm>(cfg, 1); }, {"mLSTM weight 'w_q' shape"});
  throws([&] { kvmem::training::eviction_masks(host_exec(), other, MLstm(w), view4<host_mem>("k", 1, 2, 3, 8),
                                               view4<host_mem>("v", 1, 2, 3, 8)); },
         {"mLSTM weight 'w_q' shape"});
}

// ---------------------------------------------------------------------------------------------------
// Storage types: the cache holds bfloat16 / float16 keys and values as the input gave them

TEMPLATE_TEST_CASE("eviction over bfloat16 / float16 tokens: the reference's cache, y within the storage bound",
                   "[eviction][dtype]", kvmem::bfloat16, kvmem::float16) {
  // Inputs rounded to the storage type reach the reference as they reach the memory, and the cache holds
  // them unrounded further: scores (float64 from the widened keys) and so every eviction are the
  // reference's, and y differs only by float32 arithmetic and its own rounding, u relative (the bound of
  // docs/numerics.md with exact keys and values, |v| <= 1 <= the error's scale).
  using S = TestType;
  for (Kind kind : {Kind::streaming, Kind::knorm, Kind::h2o, Kind::tova, Kind::tova_layer, Kind::kvpop}) {
    for (int variant = 0; variant < 2; ++variant) {
      EvictCase c;
      c.kind = kind;
      c.seed = static_cast<unsigned>(700 + 10 * static_cast<int>(kind) + variant);
      if (variant == 1) c.T = 60, c.Hq = 4, c.Hkv = 2, c.sinks = 1, c.top_k = 4, c.B = 2, c.lengths = {60, 33};
      c.generate();
      for (auto* x : {&c.q, &c.k, &c.v})
        for (auto& e : *x) e = kvmem::to_float(kvmem::from_float<S>(e));
      INFO(c.describe());
      const auto whole = run_evict<host_exec, S>(c, Mode::prefill);
      check_reference(c, whole, tolerance + kvmem::unit_roundoff<S>);
      const auto decoded = run_evict<host_exec, S>(c, Mode::decode);
      require_same_bits(whole, decoded);
    }
  }
}

TEST_CASE("eviction: a bfloat16 cache holds half the bytes of a float32 one", "[eviction][dtype][budget]") {
  EvictCase c;
  c.generate();
  kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention> f32(c.config(), 2);
  kvmem::EvictionMemory<host_exec, kvmem::score::AccumulatedAttention, kvmem::bfloat16> bf16(c.config(), 2);
  CHECK(2 * bf16.held_bytes() == f32.held_bytes());
  CHECK(f32.allocated_bytes() - bf16.allocated_bytes() ==
        static_cast<long>(f32.cache().keys.span() + f32.cache().values.span()) * 2);
}
