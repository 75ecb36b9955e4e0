// Naive scalar float64 reference of the KVM (Key-Value Means) attention memory.
// Written directly from shared/spec/KVM.md (sections 2-6, ambiguities resolved as in section 9).
// Header-only, standard library only. Clarity over speed.
//
// Conventions (spec section references in brackets):
//  * r = rope_dims = 0 zeroes nothing before LN_s (kvmem convention, [2], [9.4]).
//  * merge gate g = 1 + expm1(z) for z <= 0, 1 + z for z > 0 [2]; gates on keys and values of merged
//    tokens, appended and initial rows are ungated [5.4].
//  * novelty ties: (score asc, token index asc) [9.1]; merge argmax ties: lowest row index >= P [9.2];
//    merge routing is batched against one snapshot taken after the append [9.3].
//  * MergeRule::proportional (kvmem's merge::Proportional, not in the spec): the same chunk schedule, budget,
//    novelty ranking and winner-take-all routing, with memory key = the raw key (no LN_s, no channel
//    zeroed), ungated folds, a count per row, and rows read as K_i / n_i, V_i / n_i with logit bias log(n_i).
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kvmem_ref {

enum class Schedule { fixed, power_law, saturation };
enum class MergeRule { kvm, proportional };

struct KvmParams {
  long chunk = 256, window_chunks = 2, rope_dims = 64, sinks = 1;
  Schedule schedule = Schedule::fixed;
  long min_len = -1; double growth_factor = 1.0, growth_exponent = 0.5; long round_down = 1;
  double saturation_n = 1024; long max_chunks = 1;
  double ln_eps = 1e-5, norm_eps = 1e-12;
  MergeRule rule = MergeRule::kvm;
};

struct KvmSequence {          // one sequence of a batch
  long T = 0, D = 0, Dv = 0, Hq = 0, Hkv = 0;
  std::vector<double> q;         // [Hq, T, D]  row-major
  std::vector<double> k;         // [Hkv, T, D]
  std::vector<double> v;         // [Hkv, T, Dv]
  std::vector<double> gate;      // [Hkv, T]   merge-gate pre-activation z
  std::vector<double> ln_weight, ln_bias;   // [D]  (shared by all heads)
  std::vector<double> tau_state, tau_bswa;  // [Hq]
};

struct KvmResult {
  std::vector<double> y;             // [Hq, T, Dv]
  std::vector<double> lse;           // [Hq, T] log-sum-exp of each query's logits (natural log)
  long rows = 0;                     // state rows m of the final state (same for every kv head)
  std::vector<double> state_keys;    // [Hkv, rows, D]  running sums K (not LN_s(K)), creation order
  std::vector<double> state_values;  // [Hkv, rows, Dv] running sums V
  std::vector<double> state_radius;  // [Hkv, rows]
  std::vector<double> state_counts;  // [Hkv, rows] tokens per row (MergeRule::proportional)
};

// B(ctx) of spec section 5.2.
inline long budget_rows(const KvmParams& p, long ctx) {
  const long R = p.round_down <= 0 ? 1 : p.round_down;
  auto rd = [R](double floored) {                 // rd(x) = floor(max(x, 0) / R) * R
    long x = static_cast<long>(std::max(floored, 0.0));
    return x / R * R;
  };
  const double n = static_cast<double>(ctx);
  switch (p.schedule) {
    case Schedule::fixed:
      return p.min_len;
    case Schedule::power_law: {
      double pw = (p.growth_exponent == 0.5) ? std::sqrt(n) : std::pow(n, p.growth_exponent);
      return std::max(rd(std::floor(p.growth_factor * pw)), p.min_len);
    }
    case Schedule::saturation:
      return std::max(rd(std::floor((p.saturation_n * n) / (p.saturation_n + n))), p.min_len);
  }
  return p.min_len;
}

namespace detail {

using Vec = std::vector<double>;

inline double dot(const double* a, const double* b, long n) {
  double s = 0.0;
  for (long i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline double l2norm(const double* a, long n) { return std::sqrt(dot(a, a, n)); }

inline double merge_gate(double z) { return z <= 0.0 ? 1.0 + std::expm1(z) : 1.0 + z; }

// Window start once n tokens exist: max(0, ceil(n / C) * C - L).
inline long bswa_begin(long n, long C, long L) { return std::max(0L, (n + C - 1) / C * C - L); }

// LN_s(x): mean / biased variance over the D channels, then the shared affine (w_s, b_s).
inline Vec ln_s(const double* x, const KvmSequence& s, const KvmParams& p) {
  const long D = s.D;
  double mean = 0.0;
  for (long i = 0; i < D; ++i) mean += x[i];
  mean /= static_cast<double>(D);
  double var = 0.0;
  for (long i = 0; i < D; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= static_cast<double>(D);
  const double denom = std::sqrt(var + p.ln_eps);
  Vec out(D);
  for (long i = 0; i < D; ++i) out[i] = (x[i] - mean) / denom * s.ln_weight[i] + s.ln_bias[i];
  return out;
}

// Accessors for one kv head j of a sequence.
struct Head {
  const KvmSequence& s;
  const KvmParams& p;
  long j;
  const double* k(long t) const { return &s.k[(j * s.T + t) * s.D]; }
  const double* v(long t) const { return &s.v[(j * s.T + t) * s.Dv]; }
  double g(long t) const { return p.rule == MergeRule::proportional ? 1.0 : merge_gate(s.gate[j * s.T + t]); }
  // Memory key kbar_t = LN_s(k_t with channels [0, r) set to 0); the raw key for proportional merging.
  Vec kbar(long t) const {
    Vec x(k(t), k(t) + s.D);
    if (p.rule == MergeRule::proportional) return x;
    for (long i = 0; i < p.rope_dims; ++i) x[i] = 0.0;
    return ln_s(x.data(), s, p);
  }
};

struct State {
  std::vector<Vec> K, V;   // running sums
  Vec rho;                 // value radius, fixed per row
  Vec n;                   // tokens per row
  long rows() const { return static_cast<long>(K.size()); }
  void append(const Vec& key, const double* val, long Dv) {
    K.push_back(key);
    V.emplace_back(val, val + Dv);
    rho.push_back(l2norm(val, Dv));
    n.push_back(1.0);
  }
};

// Readout view of a state: Khat_i = LN_s(K_i), Vhat_i = rho_i * V_i / max(||V_i||, eps_norm).
struct StateHat {
  std::vector<Vec> Khat, Vhat;
  Vec bias;  // logit bias of each row: 0 (KVM), log(n_i) (proportional)
};

inline StateHat read_state(const State& st, const KvmSequence& s, const KvmParams& p) {
  StateHat h;
  for (long i = 0; i < st.rows(); ++i) {
    if (p.rule == MergeRule::proportional) {
      Vec kh(st.K[i]), vh(st.V[i]);
      for (double& x : kh) x /= st.n[i];
      for (double& x : vh) x /= st.n[i];
      h.Khat.push_back(kh);
      h.Vhat.push_back(vh);
      h.bias.push_back(std::log(st.n[i]));
      continue;
    }
    h.bias.push_back(0.0);
    h.Khat.push_back(ln_s(st.K[i].data(), s, p));
    const double nv = std::max(l2norm(st.V[i].data(), s.Dv), p.norm_eps);
    Vec vh(s.Dv);
    for (long c = 0; c < s.Dv; ++c) vh[c] = st.rho[i] * st.V[i][c] / nv;
    h.Vhat.push_back(vh);
  }
  return h;
}

// Section 3: y_u for query head h at position u; state rows (if any) plus window keys [b, u]. Returns the
// log-sum-exp of the logits, log sum_j exp(logit_j).
inline double readout(const Head& hd, long h, long u, const StateHat* sh, long b, double* y) {
  const KvmSequence& s = hd.s;
  const double* q = &s.q[(h * s.T + u) * s.D];
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  Vec logits;
  std::vector<const double*> vals;
  if (sh != nullptr) {
    for (std::size_t i = 0; i < sh->Khat.size(); ++i) {
      logits.push_back(s.tau_state[h] * dot(q, sh->Khat[i].data(), s.D) * scale + sh->bias[i]);
      vals.push_back(sh->Vhat[i].data());
    }
  }
  for (long pos = b; pos <= u; ++pos) {
    logits.push_back(s.tau_bswa[h] * dot(q, hd.k(pos), s.D) * scale);
    vals.push_back(hd.v(pos));
  }
  double mx = logits[0];
  for (double l : logits) mx = std::max(mx, l);
  double sum = 0.0;
  for (double& l : logits) { l = std::exp(l - mx); sum += l; }
  for (long c = 0; c < s.Dv; ++c) {
    double acc = 0.0;
    for (std::size_t i = 0; i < logits.size(); ++i) acc += logits[i] * vals[i][c];
    y[c] = acc / sum;
  }
  return mx + std::log(sum);
}

// Diagnostics of one state update (for tests).
struct UpdateLog {
  long block_begin = 0, ctx = 0, avail = 0, budget = 0, target = 0, n_app = 0, n_merged = 0,
       rows_after = 0;
  std::vector<long> appended;   // token positions appended as new rows
};

// Section 5: update with overflow block O = [b, b + C).
inline void update(State& st, const Head& hd, long b, long ctx, long avail, UpdateLog* log) {
  const KvmSequence& s = hd.s;
  const KvmParams& p = hd.p;
  const long C = p.chunk;
  const long m = st.rows();
  const long B = budget_rows(p, ctx);
  const long target = std::max(m, std::min({B, avail, C * p.max_chunks}));
  const long n_app = std::min(target - m, C);

  std::vector<Vec> kb(C);
  for (long t = 0; t < C; ++t) kb[t] = hd.kbar(b + t);

  // 3. Append selection: lowest novelty score (ungated key vs all current rows).
  std::vector<bool> is_app(C, n_app == C);
  if (n_app > 0 && n_app < C) {
    assert(m > 0);
    const StateHat cur = read_state(st, s, p);
    Vec score(C);
    for (long t = 0; t < C; ++t) {
      double best = dot(kb[t].data(), cur.Khat[0].data(), s.D);
      for (long i = 1; i < m; ++i) best = std::max(best, dot(kb[t].data(), cur.Khat[i].data(), s.D));
      score[t] = best;
    }
    std::vector<long> order(C);
    for (long t = 0; t < C; ++t) order[t] = t;
    std::sort(order.begin(), order.end(), [&](long a, long c) {
      if (score[a] != score[c]) return score[a] < score[c];
      return a < c;
    });
    for (long i = 0; i < n_app; ++i) is_app[order[i]] = true;
  }

  // 4. Append (ungated) in increasing token order.
  std::vector<long> appended, merged;
  for (long t = 0; t < C; ++t) {
    if (is_app[t]) { st.append(kb[t], hd.v(b + t), s.Dv); appended.push_back(b + t); }
    else merged.push_back(t);
  }

  // 5. Merge the rest into the post-append state; all routed against one snapshot.
  const long m2 = st.rows();
  const long P = std::min(p.sinks, m2);
  if (!merged.empty()) {
    assert(m2 > P);
    const StateHat snap = read_state(st, s, p);
    std::vector<long> dest;
    std::vector<Vec> kg(merged.size());
    for (std::size_t idx = 0; idx < merged.size(); ++idx) {
      const long t = merged[idx];
      const double g = hd.g(b + t);
      kg[idx] = kb[t];
      for (double& x : kg[idx]) x *= g;
      long best = P;
      double best_val = dot(kg[idx].data(), snap.Khat[P].data(), s.D);
      for (long i = P + 1; i < m2; ++i) {
        const double val = dot(kg[idx].data(), snap.Khat[i].data(), s.D);
        if (val > best_val) { best = i; best_val = val; }   // strict: ties keep the lowest row
      }
      dest.push_back(best);
    }
    for (std::size_t idx = 0; idx < merged.size(); ++idx) {
      const long t = merged[idx];
      const double g = hd.g(b + t);
      for (long c = 0; c < s.D; ++c) st.K[dest[idx]][c] += kg[idx][c];
      for (long c = 0; c < s.Dv; ++c) st.V[dest[idx]][c] += g * hd.v(b + t)[c];
      st.n[dest[idx]] += 1.0;
    }
  }

  if (log != nullptr) {
    log->block_begin = b; log->ctx = ctx; log->avail = avail; log->budget = B; log->target = target;
    log->n_app = n_app; log->n_merged = static_cast<long>(merged.size()); log->rows_after = m2;
    log->appended = appended;
  }
}

inline void check_config(const KvmSequence& s, const KvmParams& p) {
  assert(p.chunk >= 1 && p.window_chunks >= 1);
  assert(p.rope_dims >= 0 && p.rope_dims <= s.D);
  assert(p.sinks >= 0);
  assert(s.Hkv >= 1 && s.Hq % s.Hkv == 0);
  (void)s; (void)p;
}

inline KvmResult make_result(const KvmSequence& s) {
  KvmResult r;
  r.y.assign(s.Hq * s.T * s.Dv, 0.0);
  r.lse.assign(s.Hq * s.T, 0.0);
  return r;
}

inline void store_state(KvmResult& r, const KvmSequence& s, long j, const State& st) {
  if (j == 0) r.rows = st.rows();
  assert(r.rows == st.rows());
  for (long i = 0; i < st.rows(); ++i) {
    r.state_keys.insert(r.state_keys.end(), st.K[i].begin(), st.K[i].end());
    r.state_values.insert(r.state_values.end(), st.V[i].begin(), st.V[i].end());
    r.state_radius.push_back(st.rho[i]);
    r.state_counts.push_back(st.n[i]);
  }
  (void)s;
}

// Section 4: chunked prefill. `log` (optional) receives the updates of kv head 0.
inline KvmResult prefill_impl(const KvmSequence& s, const KvmParams& p, std::vector<UpdateLog>* log) {
  check_config(s, p);
  KvmResult res = make_result(s);
  const long T = s.T, C = p.chunk, L = p.window_chunks * C, G = s.Hq / s.Hkv;
  for (long j = 0; j < s.Hkv; ++j) {
    const Head hd{s, p, j};
    auto y = [&](long h, long u) { return &res.y[(h * T + u) * s.Dv]; };
    // Front block: exact causal attention, no state.
    const long L0 = std::min(T, L);
    for (long h = j * G; h < (j + 1) * G; ++h)
      for (long u = 0; u < L0; ++u) res.lse[h * T + u] = readout(hd, h, u, nullptr, 0, y(h, u));
    // The first chunk initializes the state (ungated, no merge).
    State st;
    const long n0 = std::min(T, C);
    for (long t = 0; t < n0; ++t) st.append(hd.kbar(t), hd.v(t), s.Dv);
    [[maybe_unused]] long cov = n0;  // checked by the asserts only
    for (long s0 = L0; s0 < T; s0 += C) {
      const long e = std::min(T, s0 + C);
      const long b = bswa_begin(e, C, L);
      assert(b == cov);
      const StateHat sh = read_state(st, s, p);
      for (long h = j * G; h < (j + 1) * G; ++h)
        for (long u = s0; u < e; ++u) res.lse[h * T + u] = readout(hd, h, u, &sh, b, y(h, u));  // attend first
      const long nb = bswa_begin(std::min(T, e + C), C, L);
      if (nb > b) {                                                         // then update
        assert(nb - b == C);
        UpdateLog lg;
        update(st, hd, b, e, nb, &lg);
        if (log != nullptr && j == 0) log->push_back(lg);
        cov = nb;
      }
    }
    assert(cov == std::max(std::min(T, C), bswa_begin(T, C, L)));

    store_state(res, s, j, st);
  }
  return res;
}

// Section 6: token-by-token decode from an empty cache. Only positions < n are read at step n.
inline KvmResult decode_impl(const KvmSequence& s, const KvmParams& p, std::vector<UpdateLog>* log) {
  check_config(s, p);
  KvmResult res = make_result(s);
  const long T = s.T, C = p.chunk, L = p.window_chunks * C, G = s.Hq / s.Hkv;
  for (long j = 0; j < s.Hkv; ++j) {
    const Head hd{s, p, j};
    State st;
    long cov = 0;
    StateHat sh;                                // readout view, recomputed whenever the state changes
    bool state_changed = true;
    for (long n = 1; n <= T; ++n) {
      const long u = n - 1;                     // the new token (pushed into the window)
      const long direct = std::min(n, C);
      if (cov < direct) {                       // still inside the first chunk
        for (long t = cov; t < direct; ++t) st.append(hd.kbar(t), hd.v(t), s.Dv);
        cov = direct;
        state_changed = true;
      }
      const long nb = bswa_begin(n, C, L);
      const long target = std::max(direct, nb);
      if (cov < target) {                       // exactly one block leaves the window
        assert(target == cov + C);
        UpdateLog lg;
        update(st, hd, cov, L + cov, cov + C, &lg);
        if (log != nullptr && j == 0) log->push_back(lg);
        cov = target;
        state_changed = true;
      }
      // Window is [nb, n); the state is read only once nb > 0.
      if (nb > 0 && state_changed) { sh = read_state(st, s, p); state_changed = false; }
      for (long h = j * G; h < (j + 1) * G; ++h)
        res.lse[h * T + u] = readout(hd, h, u, nb > 0 ? &sh : nullptr, nb, &res.y[(h * T + u) * s.Dv]);
    }
    assert(cov == std::max(std::min(T, C), bswa_begin(T, C, L)));
    store_state(res, s, j, st);
  }
  return res;
}

}  // namespace detail

inline KvmResult kvm_prefill(const KvmSequence& s, const KvmParams& p) {
  return detail::prefill_impl(s, p, nullptr);
}

inline KvmResult kvm_decode(const KvmSequence& s, const KvmParams& p) {
  return detail::decode_impl(s, p, nullptr);
}

}  // namespace kvmem_ref
