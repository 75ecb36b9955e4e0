#pragma once
// Naive float64 reference of fixed-budget KV eviction, written from shared/spec/EVICTION.md (section numbers
// below refer to it) and independent of kvmem's kernels. One (sequence, kv-head) with its G query heads at a
// time; the cache is a plain sorted std::vector of positions.
//   evict_decode():  the per-token state machine of §1 (steps 1-5) for every scorer of §6 (StreamingLLM,
//                    KNorm, H2O raw and normalised, TOVA group-mean, given static scores) and KVPOP (§2-§4);
//   evict_decode_layer(): the same for every kv-head of a sequence at once with TOVA's layer mean (§6:
//                    one token evicted from every kv-head, by the mean over all heads of the layer);
//                    the effective score of §4 is evaluated from its definition at every eviction,
//                    eff_t(q) = score_t + floor((q - t) / n) log gamma, for n = 1 as for n > 1;
//   mlstm_scores():  KVPOP's delayed scores (§2, §3) through the CLOSED PARALLEL FORM
//                    C_t = sum_j exp(i~_j + F_t - F_j - m_t) kf_j vf_j^T, m_t = max(F_t, max_j(i~_j + F_t - F_j)),
//                    every state materialised from scratch (not the recurrence kvmem runs);
//   topk_row():      one row of the §5 mask straight from its definition with static keys kappa (no Fenwick);
//   snapkv_keep():   SnapKV's selection (§6) from its definition.
//   EvictPolicy::chunk, observation, prompt_calls: compression per chunk and at the end of a prompt
//                    (kvmem's EvictionConfig::chunk and observation_window, docs/eviction.md): the steps that
//                    evict and the queries whose attention updates the statistics, from their definition;
//                    EvictKind::snapkv: SnapKV's statistic (§6), the observation window's attention (mean over
//                    the group), average-pooled over the eligible tokens at t - 2 .. t + 2 when the memory evicts;
//   EvictPolicy::merge: kvmem's merging eviction (EvictionConfig::merge_evicted, not in the spec): before an
//                    evicted token's row is dropped, it is folded into the cached row (sinks excepted) of
//                    highest cosine similarity of keys (0 for a zero norm; ties: the older row), as the
//                    count-weighted means of keys and values; rows are read with the logit bias log(count),
//                    and KVPOP's delayed score of token u reads u's row as it stands at step u + w - 1.
// Header-only, standard library only. Clarity over speed.

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "float64_math.hpp"

namespace kvmem_ref {

enum class EvictKind { streaming, knorm, h2o, tova, kvpop, given, snapkv };
enum class MLstmNorm { xlstm, plain };

/// KVPOP mLSTM weights of one kv-head (§3), float64. X = D + Dv, h = D / 2.
struct MLstmHead {
  std::vector<double> w_q, w_k, w_v;  ///< [X][h] row-major
  std::vector<double> w_i, w_f;       ///< [X]
  std::vector<double> w_s;            ///< [h]
  double b_i = 0, b_f = 0, b_s = 0, theta = 0;
  MLstmNorm norm = MLstmNorm::xlstm;
  double soft_cap = 15.0, eps = 1e-6;

  /// log gamma_h = log gamma_min + sigmoid(theta) (log gamma_max - log gamma_min), §4 / App. E.
  [[nodiscard]] double log_gamma() const {
    const double lo = std::log(0.999), hi = std::log(0.999999);
    return lo + (hi - lo) / (1.0 + std::exp(-theta));
  }
};

/// The policy and scorer of §1 / §6.
struct EvictPolicy {
  EvictKind kind = EvictKind::knorm;
  long sinks = 0, window = 1, top_k = 0, decay_interval = 1;  ///< s, w, k, n
  bool normalize = false;                                     ///< H2O: kvpress ObservedAttention mean
  bool layer_mean = false;                                    ///< TOVA: evict_decode_layer's layer mean
  double log_gamma = 0.0;                                     ///< every kind but kvpop (kvpop: from theta)
  std::vector<double> given;                                  ///< EvictKind::given: static score per token [T]
  MLstmHead mlstm;                                            ///< EvictKind::kvpop
  bool merge = false;                                         ///< fold evicted rows into their nearest kept row
  /// C: positions per chunk; step q evicts when q % C == 0 (C = 1: every step, the streaming eviction);
  /// C = 0: only decode steps evict (the prompt is held whole until the first one).
  long chunk = 1;
  /// W_obs: the last W_obs queries of each chunk (C = 0: of each prompt call) update the statistics; 0: all.
  long observation = 64;
  /// The first tokens come in prefill/extend calls of these lengths, the others in decode steps; empty: one
  /// prefill call of all T tokens. Only C = 0 reads it (the other chunks are positions from the start).
  std::vector<long> prompt_calls;
};

/// One (sequence, kv-head): G query heads, T tokens.
struct EvictHead {
  long T = 0, G = 1, D = 0, Dv = 0;
  std::vector<double> q;  ///< [G][T][D]
  std::vector<double> k;  ///< [T][D]
  std::vector<double> v;  ///< [T][Dv]
};

struct EvictResult {
  std::vector<double> y;                    ///< [G][T][Dv]
  std::vector<double> lse;                  ///< [G][T] log-sum-exp of each query's logits (natural log)
  std::vector<std::vector<long>> attended;  ///< per query q: the attended set A(q), ascending
  std::vector<long> kept;                   ///< A(T - 1) (the cache after the last step), ascending
  std::vector<double> score;                ///< [T] static score_t (NaN: never scored, or a dynamic scorer)
};

namespace evict_detail {

using math::Vec;
using math::log_sigmoid;
using math::sigmoid;
using math::softmax;
inline constexpr double nan = std::numeric_limits<double>::quiet_NaN();



/// y[a] = sum_j x[j] W[j][a], W [X][h].
inline Vec project(const Vec& x, const Vec& W, long h) {
  Vec y(h, 0.0);
  for (std::size_t j = 0; j < x.size(); ++j)
    for (long a = 0; a < h; ++a) y[a] += x[j] * W[j * h + a];
  return y;
}

/// Hedgehog feature map HH(y) = [softmax(y); softmax(-y)] (h -> 2h).
inline Vec hedgehog(const Vec& y) {
  Vec neg(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) neg[i] = -y[i];
  Vec out = softmax(y);
  const Vec b = softmax(neg);
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

/// The rows of one kv-head as a merging eviction holds them: key [D], value [Dv] and count of the row of each
/// position (a position's own token until rows merge into it).
struct MergedRows {
  std::vector<Vec> K, V;
  Vec n;
  MergedRows(const EvictHead& x) : n(x.T, 1.0) {
    for (long t = 0; t < x.T; ++t) {
      K.emplace_back(x.k.begin() + t * x.D, x.k.begin() + (t + 1) * x.D);
      V.emplace_back(x.v.begin() + t * x.Dv, x.v.begin() + (t + 1) * x.Dv);
    }
  }
  /// Folds the row of `from` into the cached row t >= s (t != from) of highest cosine similarity of keys
  /// (0 when a norm is 0), the older on a tie.
  void merge(long from, const std::vector<long>& cache, long s) {
    auto dot = [](const Vec& a, const Vec& b) {
      double d = 0;
      for (std::size_t i = 0; i < a.size(); ++i) d += a[i] * b[i];
      return d;
    };
    auto norm = [&](const Vec& a) { return std::sqrt(dot(a, a)); };
    const double nf = norm(K[from]);
    long into = -1;
    double best = 0;
    for (long t : cache) {
      if (t < s || t == from) continue;
      const double d = nf * norm(K[t]);
      const double c = d == 0 ? 0.0 : dot(K[from], K[t]) / d;
      if (into < 0 || c > best) into = t, best = c;
    }
    const double a = n[into], b = n[from];
    for (std::size_t i = 0; i < K[into].size(); ++i) K[into][i] = (a * K[into][i] + b * K[from][i]) / (a + b);
    for (std::size_t i = 0; i < V[into].size(); ++i) V[into][i] = (a * V[into][i] + b * V[from][i]) / (a + b);
    n[into] = a + b;
  }
};

/// Steps 2-3 of step q (§1): while more than k cached tokens lie in R = [s, q - w], evict the one with the
/// lowest (eff(t, q), t).
template <class Eff, class OnEvict>
void evict_down(std::vector<long>& cache, long s, long w, long k, long q, const Eff& eff, const OnEvict& on_evict) {
  while (true) {
    std::vector<long> R;
    for (long t : cache)
      if (t >= s && t <= q - w) R.push_back(t);
    if (static_cast<long>(R.size()) <= k) return;
    long worst = R[0];
    for (long t : R) {
      const double e = eff(t, q), ew = eff(worst, q);
      if (e < ew || (e == ew && t < worst)) worst = t;
    }
    on_evict(worst);
    cache.erase(std::find(cache.begin(), cache.end(), worst));
  }
}

}  // namespace evict_detail

/// KVPOP's static score of every token u with u + w - 1 < T, read from the state after token u + w - 1 (§2),
/// with C_t and n_t from the closed parallel form of §3 (each state summed from scratch); NaN elsewhere.
/// `only` >= 0: the score of token `only` alone, its query features from `key` [D] and `value` [Dv] instead
/// of its own (a merging eviction scores the row as it stands).
inline std::vector<double> mlstm_scores(const EvictHead& x, const MLstmHead& m, long window, long only = -1,
                                        const double* key = nullptr, const double* value = nullptr) {
  using namespace evict_detail;
  const long T = x.T, D = x.D, Dv = x.Dv, h = D / 2;
  if (D % 2 != 0) throw std::invalid_argument("mlstm_scores: D must be even");
  const double c = m.soft_cap;
  auto cap = [&](double z) { return c > 0 ? c * std::tanh(z / c) : z; };
  std::vector<Vec> qf(T), kf(T), vf(T);
  Vec ig(T), lf(T), F(T);
  for (long t = 0; t < T; ++t) {
    Vec xt(x.k.begin() + t * D, x.k.begin() + (t + 1) * D);
    xt.insert(xt.end(), x.v.begin() + t * Dv, x.v.begin() + (t + 1) * Dv);
    qf[t] = hedgehog(project(xt, m.w_q, h));
    kf[t] = hedgehog(project(xt, m.w_k, h));
    vf[t] = project(xt, m.w_v, h);
    double zi = m.b_i, zf = m.b_f;
    for (long j = 0; j < D + Dv; ++j) zi += xt[j] * m.w_i[j], zf += xt[j] * m.w_f[j];
    ig[t] = cap(zi);
    lf[t] = log_sigmoid(cap(zf));
    F[t] = (t > 0 ? F[t - 1] : 0.0) + lf[t];  // F_t = sum_{l <= t} log f_l
  }
  Vec score(T, nan);
  for (long u = only < 0 ? 0 : only; u + window - 1 < T && (only < 0 || u == only); ++u) {
    const long t = u + window - 1;
    double mt = F[t];  // the m_{-1} = 0 term
    for (long j = 0; j <= t; ++j) mt = std::max(mt, ig[j] + F[t] - F[j]);
    Vec C(D * h, 0.0), n(D, 0.0);
    for (long j = 0; j <= t; ++j) {
      const double a = std::exp(ig[j] + F[t] - F[j] - mt);
      for (long i = 0; i < D; ++i) {
        n[i] += a * kf[j][i];
        for (long b = 0; b < h; ++b) C[i * h + b] += a * kf[j][i] * vf[j][b];
      }
    }
    Vec q = qf[u];
    if (only >= 0) {
      Vec xu(key, key + D);
      xu.insert(xu.end(), value, value + Dv);
      q = hedgehog(project(xu, m.w_q, h));
    }
    if (m.norm == MLstmNorm::xlstm)
      for (auto& e : q) e /= std::sqrt(static_cast<double>(D));
    double qn = 0;
    for (long i = 0; i < D; ++i) qn += q[i] * n[i];
    const double den = m.norm == MLstmNorm::xlstm ? std::max(std::abs(qn), std::exp(-mt)) + m.eps : qn;
    double s = m.b_s;
    for (long b = 0; b < h; ++b) {
      double num = 0;
      for (long i = 0; i < D; ++i) num += q[i] * C[i * h + b];
      const double hv = num / den;
      s += m.w_s[b] * hv * sigmoid(hv);  // SiLU
    }
    score[u] = s;
  }
  return score;
}

/// The static score of every token for the static scorers (§6), NaN for H2O/TOVA.
inline std::vector<double> static_scores(const EvictHead& x, const EvictPolicy& p) {
  std::vector<double> s(x.T, evict_detail::nan);
  for (long t = 0; t < x.T; ++t) {
    switch (p.kind) {
      case EvictKind::streaming: s[t] = 0.0; break;
      case EvictKind::knorm: {
        double n2 = 0;
        for (long i = 0; i < x.D; ++i) n2 += x.k[t * x.D + i] * x.k[t * x.D + i];
        s[t] = -std::sqrt(n2);
        break;
      }
      case EvictKind::given: s[t] = p.given.at(t); break;
      default: break;
    }
  }
  if (p.kind == EvictKind::kvpop) s = mlstm_scores(x, p.mlstm, p.window);
  return s;
}

/// log gamma of the policy (§4): from theta for kvpop, the opt-in value otherwise.
inline double policy_log_gamma(const EvictPolicy& p) {
  return p.kind == EvictKind::kvpop ? p.mlstm.log_gamma() : p.log_gamma;
}

/// Static key kappa_t = score_t - t log gamma (§4, n = 1).
inline std::vector<double> static_keys(const EvictHead& x, const EvictPolicy& p) {
  auto s = static_scores(x, p);
  const double lg = policy_log_gamma(p);
  for (long t = 0; t < x.T; ++t) s[t] -= static_cast<double>(t) * lg;
  return s;
}

/// Whether step q evicts (after its append), whether its query updates the statistics, and whether it is the
/// first such query of its chunk (SnapKV's sum restarts there), from EvictPolicy::chunk, observation and
/// prompt_calls.
struct StepRoles {
  std::vector<bool> evicts, observes, first_observer;
  StepRoles(const EvictPolicy& p, long T) : evicts(T), observes(T), first_observer(T) {
    const long C = p.chunk, W = p.observation;
    if (C >= 1) {
      const long first = W > 0 && W < C ? C - W : 0;  // the first observing place in a chunk
      for (long q = 0; q < T; ++q) {
        evicts[q] = q % C == 0;
        observes[q] = q % C >= first;
        first_observer[q] = q % C == first;
      }
      return;
    }
    std::vector<long> calls = p.prompt_calls;
    if (calls.empty()) calls.push_back(T);
    long start = 0;
    for (long len : calls) {  // a prompt call: no eviction; its last W queries observe
      const long end = start + len, first = W > 0 && end - W > start ? end - W : start;
      for (long q = start; q < end && q < T; ++q) {
        evicts[q] = false;
        observes[q] = q >= first;
        first_observer[q] = q == first;
      }
      start = end;
    }
    for (long q = start; q < T; ++q) evicts[q] = observes[q] = first_observer[q] = true;  // decode steps
  }
};

/// The decode state machine of §1, one token after the other.
inline EvictResult evict_decode(const EvictHead& x, const EvictPolicy& p) {
  using namespace evict_detail;
  if (p.window < 1 || p.top_k < 0 || p.sinks < 0 || p.decay_interval < 1 || p.chunk < 0 || p.observation < 0)
    throw std::invalid_argument("evict_decode: bad policy");
  const long T = x.T, G = x.G, D = x.D, Dv = x.Dv, s = p.sinks, w = p.window, k = p.top_k, n = p.decay_interval;
  const bool dynamic = p.kind == EvictKind::h2o || p.kind == EvictKind::tova || p.kind == EvictKind::snapkv;
  const StepRoles roles(p, T);
  EvictResult r;
  r.y.assign(G * T * Dv, 0.0);
  r.lse.assign(G * T, 0.0);
  r.attended.resize(T);
  r.score = dynamic ? Vec(T, nan) : static_scores(x, p);
  const double lg = policy_log_gamma(p);
  Vec acc(T, 0.0), last(T, 0.0);  // H2O accumulated attention; TOVA attention of the previous query
  Vec window(T, 0.0);             // SnapKV: the observation window's attention, pooled when the memory evicts
  std::vector<long> cache;        // cached positions, ascending
  MergedRows rows(x);             // the rows as they stand (the tokens themselves unless p.merge)
  auto base = [&](long t, long q) -> double {
    switch (p.kind) {
      case EvictKind::h2o: return p.normalize ? acc[t] / (static_cast<double>(G) * static_cast<double>(q - t)) : acc[t];
      case EvictKind::tova: return last[t];
      case EvictKind::snapkv: return window[t];
      default:
        if (std::isnan(r.score[t])) throw std::logic_error("evict_decode: token evicted before it was scored");
        return r.score[t];
    }
  };
  auto eff = [&](long t, long q) { return base(t, q) + static_cast<double>((q - t) / n) * lg; };
  for (long q = 0; q < T; ++q) {
    // 1. append (scores of static scorers are precomputed: a static score never changes; a merging
    // eviction's KVPOP scores token u = q - w + 1 now, from its row as it stands).
    cache.push_back(q);
    const long u = q - w + 1;
    if (p.merge && p.kind == EvictKind::kvpop && u >= s && u >= 0)
      r.score[u] = mlstm_scores(x, p.mlstm, w, u, rows.K[u].data(), rows.V[u].data())[u];
    // 2.-3. R = cached tokens in [s, q - w]; token q - w has joined it. Evict the min of (eff, t), at the
    // steps that evict. SnapKV first pools its statistic over R: the mean over t - 2 .. t + 2 of the tokens
    // of R there (absent ones count 0: always / 5).
    if (roles.evicts[q]) {
      std::vector<long> R;
      for (long t : cache)
        if (t >= s && t <= q - w) R.push_back(t);
      if (p.kind == EvictKind::snapkv && static_cast<long>(R.size()) > k) {
        Vec pooled(T, 0.0);
        for (long t : R)
          for (long u : R)
            if (u >= t - 2 && u <= t + 2) pooled[t] += window[u];
        for (long t : R) window[t] = pooled[t] / 5.0;
      }
      evict_down(cache, s, w, k, q, eff, [&](long t) {
        if (p.merge) rows.merge(t, cache, s);
      });
    }
    r.attended[q] = cache;
    // 4. one softmax per query head over the attended set.
    Vec psum(cache.size(), 0.0);
    for (long g = 0; g < G; ++g) {
      Vec logits(cache.size());
      for (std::size_t i = 0; i < cache.size(); ++i) {
        double d = 0;
        for (long c = 0; c < D; ++c) d += x.q[(g * T + q) * D + c] * rows.K[cache[i]][c];
        logits[i] = d / std::sqrt(static_cast<double>(D)) + std::log(rows.n[cache[i]]);
      }
      const Vec pr = softmax(logits);
      r.lse[g * T + q] = math::log_sum_exp(logits);
      for (std::size_t i = 0; i < cache.size(); ++i) {
        psum[i] += pr[i];
        for (long c = 0; c < Dv; ++c) r.y[(g * T + q) * Dv + c] += pr[i] * rows.V[cache[i]][c];
      }
    }
    // 5. dynamic statistics, from the queries that observe.
    if (!roles.observes[q]) continue;
    for (std::size_t i = 0; i < cache.size(); ++i) {
      acc[cache[i]] += psum[i];
      last[cache[i]] = psum[i] / static_cast<double>(G);
      window[cache[i]] = (roles.first_observer[q] ? 0.0 : window[cache[i]]) + psum[i] / static_cast<double>(G);
    }
  }
  if (T > 0) r.kept = r.attended[T - 1];
  return r;
}

/// TOVA with the original's layer mean (§6), all kv-heads of one sequence at once (heads[h], h < Hkv, the
/// same T and G): one cache for the layer, eff_t(q) = mean over all Hkv * G query heads of p_{q-1 -> t}
/// + floor((q - t) / n) log gamma, the min of (eff, t) evicted from every kv-head.
inline std::vector<EvictResult> evict_decode_layer(const std::vector<EvictHead>& heads, const EvictPolicy& p) {
  using namespace evict_detail;
  if (p.kind != EvictKind::tova || p.window < 1 || p.top_k < 0 || p.sinks < 0 || p.decay_interval < 1)
    throw std::invalid_argument("evict_decode_layer: TOVA and a good policy only");
  const long H = static_cast<long>(heads.size());
  const long T = H ? heads[0].T : 0, s = p.sinks, w = p.window, k = p.top_k, n = p.decay_interval;
  std::vector<EvictResult> r(H);
  for (long h = 0; h < H; ++h) {
    r[h].y.assign(heads[h].G * T * heads[h].Dv, 0.0);
    r[h].lse.assign(heads[h].G * T, 0.0);
    r[h].attended.resize(T);
    r[h].score.assign(T, nan);
  }
  Vec last(T, 0.0);
  std::vector<long> cache;
  std::vector<MergedRows> rows(heads.begin(), heads.end());  // each kv-head merges into its own nearest row
  auto eff = [&](long t, long q) { return last[t] + static_cast<double>((q - t) / n) * p.log_gamma; };
  for (long q = 0; q < T; ++q) {
    cache.push_back(q);
    evict_down(cache, s, w, k, q, eff, [&](long t) {
      if (p.merge)
        for (auto& hr : rows) hr.merge(t, cache, s);
    });
    Vec psum(cache.size(), 0.0);
    long heads_of_layer = 0;
    for (long h = 0; h < H; ++h) {
      const EvictHead& x = heads[h];
      r[h].attended[q] = cache;
      for (long g = 0; g < x.G; ++g, ++heads_of_layer) {
        Vec logits(cache.size());
        for (std::size_t i = 0; i < cache.size(); ++i) {
          double d = 0;
          for (long c = 0; c < x.D; ++c) d += x.q[(g * T + q) * x.D + c] * rows[h].K[cache[i]][c];
          logits[i] = d / std::sqrt(static_cast<double>(x.D)) + std::log(rows[h].n[cache[i]]);
        }
        const Vec pr = softmax(logits);
        r[h].lse[g * T + q] = math::log_sum_exp(logits);
        for (std::size_t i = 0; i < cache.size(); ++i) {
          psum[i] += pr[i];
          for (long c = 0; c < x.Dv; ++c) r[h].y[(g * T + q) * x.Dv + c] += pr[i] * rows[h].V[cache[i]][c];
        }
      }
    }
    for (std::size_t i = 0; i < cache.size(); ++i) last[cache[i]] = psum[i] / static_cast<double>(heads_of_layer);
  }
  for (long h = 0; h < H; ++h)
    if (T > 0) r[h].kept = r[h].attended[T - 1];
  return r;
}

/// Row q of the §5 mask from its definition: sinks {t < s}, window {q - w < t}, and the k eligible tokens
/// {s <= t <= q - w} with the highest (kappa_t, t) (newer wins a tie), all t <= q; ascending.
inline std::vector<long> topk_row(const std::vector<double>& kappa, long s, long w, long k, long q) {
  std::vector<long> row, eligible;
  for (long t = 0; t <= q; ++t) {
    if (t < s || q - t < w) row.push_back(t);
    else eligible.push_back(t);
  }
  auto better = [&](long a, long b) { return kappa[a] != kappa[b] ? kappa[a] > kappa[b] : a > b; };
  if (static_cast<long>(eligible.size()) > k) {
    std::nth_element(eligible.begin(), eligible.begin() + k, eligible.end(), better);
    eligible.resize(k);
  }
  row.insert(row.end(), eligible.begin(), eligible.end());
  std::sort(row.begin(), row.end());
  return row;
}

/// SnapKV's kept positions after a prompt of T tokens (§6): q [G][T][D], k [T][D]; W = W_obs, C_max.
/// Every token when T <= C_max; else the window [T - W, T) and the top C_max - W prefix tokens t < T - W by
/// mean_g avgpool5(sum_{i in window} p^{(g)}_{i -> t}) (zero pads counted: always / 5; newer wins a tie).
inline std::vector<long> snapkv_keep(const std::vector<double>& q, const std::vector<double>& k, long G, long T, long D,
                                     long W, long C_max) {
  using namespace evict_detail;
  std::vector<long> keep;
  if (T <= C_max) {
    for (long t = 0; t < T; ++t) keep.push_back(t);
    return keep;
  }
  const long prefix = T - W;
  Vec score(prefix, 0.0);
  for (long g = 0; g < G; ++g) {
    Vec raw(prefix, 0.0);
    for (long i = T - W; i < T; ++i) {
      Vec logits(i + 1);
      for (long t = 0; t <= i; ++t) {
        double d = 0;
        for (long c = 0; c < D; ++c) d += q[(g * T + i) * D + c] * k[t * D + c];
        logits[t] = d / std::sqrt(static_cast<double>(D));
      }
      const Vec pr = softmax(logits);  // dense causal row of query i
      for (long t = 0; t < prefix; ++t) raw[t] += pr[t];
    }
    for (long t = 0; t < prefix; ++t) {
      double pooled = 0;
      for (long d = -2; d <= 2; ++d)
        if (t + d >= 0 && t + d < prefix) pooled += raw[t + d];
      score[t] += pooled / 5.0 / static_cast<double>(G);
    }
  }
  std::vector<long> order(prefix);
  for (long t = 0; t < prefix; ++t) order[t] = t;
  std::sort(order.begin(), order.end(), [&](long a, long b) { return score[a] != score[b] ? score[a] > score[b] : a > b; });
  order.resize(std::min(prefix, C_max - W));
  for (long t = prefix; t < T; ++t) order.push_back(t);
  std::sort(order.begin(), order.end());
  return order;
}

}  // namespace kvmem_ref
