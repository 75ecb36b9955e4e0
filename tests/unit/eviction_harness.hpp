#pragma once
// The harness of the fixed-budget KV eviction tests (spec shared/spec/EVICTION.md; test_eviction_*.cpp):
// random cases for every scorer (and a user-defined one), the memory run over them in every mode, and the
// naive float64 reference (tests/reference/eviction_reference.hpp) with the checks against it.
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
#include "worst_error.hpp"

namespace kvmem_test::eviction {

using host_exec = Kokkos::DefaultHostExecutionSpace;
using host_mem = host_exec::memory_space;

/// Tolerance of the float32 outputs against the float64 reference (the acceptance criterion).
inline constexpr double tolerance = 1e-4;

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
inline constexpr Kind all_kinds[] = {Kind::streaming, Kind::knorm,      Kind::h2o,   Kind::h2o_mean,
                              Kind::tova,      Kind::tova_layer, Kind::kvpop, Kind::given};

inline const char* name_of(Kind k) {
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

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

inline void require_same_bits(const EvictOutput& a, const EvictOutput& b) {
  REQUIRE(a.rows == b.rows);
  REQUIRE(a.kept == b.kept);
  REQUIRE(same_bits(a.y, b.y));
  REQUIRE(same_bits(a.lse, b.lse));
}

/// The memory's output of case c against the reference, per (sequence, kv-head): the cached positions after
/// the last step exactly (and after every step when recorded), y to `tolerance`, y past a sequence zero.
/// The reference of every kv-head of sequence b (TOVA's layer mean: all kv-heads at once).
inline std::vector<kvmem_ref::EvictResult> reference(const EvictCase& c, long b) {
  std::vector<kvmem_ref::EvictResult> refs;
  if (c.kind == Kind::tova_layer) {
    std::vector<kvmem_ref::EvictHead> heads;
    for (long h = 0; h < c.Hkv; ++h) heads.push_back(c.head(b, h));
    return kvmem_ref::evict_decode_layer(heads, c.policy(b, 0));
  }
  for (long h = 0; h < c.Hkv; ++h) refs.push_back(kvmem_ref::evict_decode(c.head(b, h), c.policy(b, h)));
  return refs;
}

inline void check_reference(const EvictCase& c, const EvictOutput& got, double tol = tolerance) {
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
inline void check_case(const EvictCase& c) {
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
inline std::vector<EvictCase> edge_cases(Kind kind) {
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

/// The case of the determinism and merging tests for scorer `kind`: three ragged sequences (90, 41, 77
/// tokens), GQA, duplicate keys, evictions from the 7th step on.
inline EvictCase thread_case(Kind kind) {
  EvictCase c;
  c.kind = kind, c.B = 3, c.T = 90, c.lengths = {90, 41, 77}, c.Hq = 4, c.Hkv = 2;
  c.sinks = 2, c.window = 4, c.top_k = 7, c.duplicate_keys = true;
  c.seed = 300 + static_cast<unsigned>(kind);
  c.generate();
  return c;
}

}  // namespace kvmem_test::eviction
