// Naive scalar float64 reference of OVQ (Online Vector-Quantized attention).
// Written directly from shared/spec/OVQ.md (sections 2-6, ambiguities resolved as in section 9).
// Header-only, standard library only. Clarity over speed.
//
// Conventions (spec section references in brackets):
//  * khat = k / (||k|| + 1e-5), qs = q / (||q|| + 1e-5) * beta * sqrt(D);
//    logit = qs . key + bias [2].
//  * Sizes: sizes[0] = 0, sizes[c] = min(max(s(t), sizes[c-1]), N), t = min(T, c*C) [3]; s(t) is
//    the plateau floor(tN/(t+N)) (double arithmetic), min(t, N), or OvqParams::budget(t) if set.
//    Additionally sizes[c] <= sizes[c-1] + C (a commit cannot create more rows than it has
//    tokens); this never binds for plateau or min (spec: num_new <= C always), only for a budget.
//  * Only full chunks are committed [5, 9.3]; the m == 0, num_new == 0 quirk is reproduced
//    [5, 9.4]: the chunk is folded into row 0 although row 0 is not live yet.
//  * New-centroid ties: (score asc, token index asc) [9.1]; argmax ties: lowest centroid [9.2].
//  * normalize_centroids: after the update, every row of Dk and Dv is set to x / max(||x||, 1e-12)
//    (all N rows; rows never written stay zero) [5.5].
// Shares namespace kvmem_ref with tests/reference/kvm_reference.hpp: helper names in `detail` are
// OVQ-specific (`ovq_` prefix, `commit`) so that both headers can be included in one TU.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <vector>

namespace kvmem_ref {

enum class OvqGrowth { plateau, min };   // sizes: plateau tN/(t+N) (spec section 3), or min(t, N)

struct OvqParams {
  long chunk = 128;                 // C
  long max_centroids = 2048;        // N
  OvqGrowth growth = OvqGrowth::plateau;
  bool normalize_centroids = false;
  bool count_bias = true;           // log(counts) added to the centroid logits
  // Optional generalization: if set, replaces the growth formula s(t):
  // sizes[c] = min(max(budget(t), sizes[c-1]), N, sizes[c-1] + C).
  std::function<long(long t)> budget;
};

struct OvqSequence {                // one sequence of a batch
  long T = 0, D = 0, Dv = 0, H = 0;
  std::vector<double> q, k;         // [H, T, D] row-major
  std::vector<double> v;            // [H, T, Dv]
  std::vector<double> beta;         // [H]
};

struct OvqResult {
  std::vector<double> y;                // [H, T, Dv]
  std::vector<double> lse;              // [H, T] log-sum-exp of each query's logits (natural log)
  long rows = 0;                        // live rows `size` of the final committed state
                                        // (the same for every head)
  std::vector<double> centroid_keys;    // [H, rows, D]
  std::vector<double> centroid_values;  // [H, rows, Dv]
  std::vector<double> counts;           // [H, rows]
};

namespace detail {

// sizes[c] from sizes[c-1] = prev and t = min(T, c*C) (spec section 3).
inline long ovq_next_size(const OvqParams& p, long prev, long t) {
  const long N = p.max_centroids;
  long s;
  if (p.budget) {
    s = p.budget(t);
  } else if (p.growth == OvqGrowth::plateau) {
    const double x = (static_cast<double>(t) * static_cast<double>(N)) / static_cast<double>(t + N);
    s = std::min(static_cast<long>(std::floor(x)), N);
  } else {
    s = std::min(t, N);
  }
  return std::min({std::max(s, prev), N, prev + p.chunk});
}

inline double ovq_dot(const double* a, const double* b, long n) {
  double s = 0.0;
  for (long i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x / (||x||_2 + 1e-5)   (spec section 2, eps added to the norm)
inline std::vector<double> ovq_unit(const double* x, long n) {
  const double den = std::sqrt(ovq_dot(x, x, n)) + 1e-5;
  std::vector<double> out(x, x + n);
  for (double& e : out) e /= den;
  return out;
}

// Dictionary of one head: N rows, of which the first `size` (kept by the caller) are live.
struct OvqDict {
  long N = 0, D = 0, Dv = 0;
  std::vector<double> keys;     // [N, D]
  std::vector<double> values;   // [N, Dv]
  std::vector<double> counts;   // [N]
  OvqDict(long n, long d, long dv)
      : N(n), D(d), Dv(dv), keys(n * d, 0.0), values(n * dv, 0.0), counts(n, 0.0) {}
  double* key(long i) { return &keys[i * D]; }
  double* value(long i) { return &values[i * Dv]; }
  const double* key(long i) const { return &keys[i * D]; }
  const double* value(long i) const { return &values[i * Dv]; }
};

// Spec section 5: commit one full chunk of n tokens (khat [n, D] already normalized, v [n, Dv])
// into a dictionary whose live size is m; num_new rows (m, m+1, ...) are created.
// Returns the assignment a_j of every token.
inline std::vector<long> commit(OvqDict& d, long m, long num_new, const double* khat,
                                const double* v, long n, bool normalize) {
  assert(n >= 1 && m >= 0 && num_new >= 0 && num_new <= n && m + num_new <= d.N);
  std::vector<long> a(n, 0);
  std::vector<long> order(n);
  for (long j = 0; j < n; ++j) order[j] = j;
  if (m == 0) {
    // All tokens -> row 0; the num_new - 1 tokens least similar to the chunk's first token get
    // ids 1 .. num_new-1 in ascending-similarity order. (num_new == 0: quirk, row 0 anyway.)
    if (num_new > 1) {
      std::vector<double> sim0(n);
      for (long j = 0; j < n; ++j) sim0[j] = ovq_dot(khat + j * d.D, khat, d.D);
      sim0[0] = std::numeric_limits<double>::infinity();
      std::sort(order.begin(), order.end(), [&](long x, long y) {
        if (sim0[x] != sim0[y]) return sim0[x] < sim0[y];
        return x < y;
      });
      for (long r = 0; r < num_new - 1; ++r) a[order[r]] = r + 1;
    }
  } else {
    std::vector<double> best(n);
    for (long j = 0; j < n; ++j) {
      long arg = 0;
      double bv = ovq_dot(khat + j * d.D, d.key(0), d.D);
      for (long i = 1; i < m; ++i) {
        const double s = ovq_dot(khat + j * d.D, d.key(i), d.D);
        if (s > bv) { bv = s; arg = i; }   // strict: ties keep the lowest index
      }
      a[j] = arg;
      best[j] = bv;
    }
    if (num_new > 0) {
      std::sort(order.begin(), order.end(), [&](long x, long y) {
        if (best[x] != best[y]) return best[x] < best[y];
        return x < y;
      });
      for (long r = 0; r < num_new; ++r) a[order[r]] = m + r;
    }
  }
  // Counts after the whole chunk, then lr_j = 1 / counts[a_j]; updates from the pre-chunk snapshot.
  std::vector<double> new_counts = d.counts;
  for (long j = 0; j < n; ++j) new_counts[a[j]] += 1.0;
  const OvqDict old = d;
  for (long j = 0; j < n; ++j) {
    const long i = a[j];
    const double lr = 1.0 / new_counts[i];
    for (long c = 0; c < d.D; ++c) d.key(i)[c] += lr * (khat[j * d.D + c] - old.key(i)[c]);
    for (long c = 0; c < d.Dv; ++c) d.value(i)[c] += lr * (v[j * d.Dv + c] - old.value(i)[c]);
  }
  d.counts = new_counts;
  if (normalize) {
    for (long i = 0; i < d.N; ++i) {
      const double nk = std::max(std::sqrt(ovq_dot(d.key(i), d.key(i), d.D)), 1e-12);
      for (long c = 0; c < d.D; ++c) d.key(i)[c] /= nk;
      const double nv = std::max(std::sqrt(ovq_dot(d.value(i), d.value(i), d.Dv)), 1e-12);
      for (long c = 0; c < d.Dv; ++c) d.value(i)[c] /= nv;
    }
  }
  return a;
}

// Spec section 4: softmax over the m live centroids (bias log count) and the given raw tokens
// (bias 0); y [Dv]. Returns the log-sum-exp of the logits.
inline double ovq_attend(const OvqDict& d, long m, const std::vector<double>& qs,
                       const std::vector<const double*>& tok_keys,
                       const std::vector<const double*>& tok_vals, bool count_bias, double* y) {
  std::vector<double> logits;
  std::vector<const double*> vals;
  for (long i = 0; i < m; ++i) {
    const double bias = count_bias ? std::log(d.counts[i]) : 0.0;   // log 0 = -inf: weight 0
    logits.push_back(ovq_dot(qs.data(), d.key(i), d.D) + bias);
    vals.push_back(d.value(i));
  }
  for (std::size_t j = 0; j < tok_keys.size(); ++j) {
    logits.push_back(ovq_dot(qs.data(), tok_keys[j], d.D));
    vals.push_back(tok_vals[j]);
  }
  assert(!tok_keys.empty());
  double mx = -std::numeric_limits<double>::infinity();
  for (double l : logits) mx = std::max(mx, l);
  double sum = 0.0;
  for (double& l : logits) { l = std::exp(l - mx); sum += l; }
  for (long c = 0; c < d.Dv; ++c) {
    double acc = 0.0;
    for (std::size_t i = 0; i < logits.size(); ++i) acc += logits[i] * vals[i][c];
    y[c] = acc / sum;
  }
  return mx + std::log(sum);
}

// Normalized keys khat [T, D] and scaled queries qs [T, D] of head h.
struct OvqHeadInputs {
  std::vector<std::vector<double>> khat, qs;
  OvqHeadInputs(const OvqSequence& s, long h) {
    const double scale = s.beta[h] * std::sqrt(static_cast<double>(s.D));
    for (long t = 0; t < s.T; ++t) {
      khat.push_back(ovq_unit(&s.k[(h * s.T + t) * s.D], s.D));
      std::vector<double> q = ovq_unit(&s.q[(h * s.T + t) * s.D], s.D);
      for (double& e : q) e *= scale;
      qs.push_back(q);
    }
  }
};

inline void ovq_check(const OvqSequence& s, const OvqParams& p) {
  assert(p.chunk >= 1 && p.max_centroids >= 1);
  assert(s.T >= 0 && s.D >= 1 && s.Dv >= 1 && s.H >= 0);
  assert(static_cast<long>(s.q.size()) == s.H * s.T * s.D);
  assert(static_cast<long>(s.k.size()) == s.H * s.T * s.D);
  assert(static_cast<long>(s.v.size()) == s.H * s.T * s.Dv);
  assert(static_cast<long>(s.beta.size()) == s.H);
  (void)s; (void)p;
}

inline void ovq_store(OvqResult& r, const OvqDict& d, long rows, long h) {
  if (h == 0) r.rows = rows;
  assert(r.rows == rows);
  for (long i = 0; i < rows; ++i) {
    r.centroid_keys.insert(r.centroid_keys.end(), d.key(i), d.key(i) + d.D);
    r.centroid_values.insert(r.centroid_values.end(), d.value(i), d.value(i) + d.Dv);
    r.counts.push_back(d.counts[i]);
  }
}

}  // namespace detail

// sizes[0 .. ceil(T/C)] of spec section 3 (sizes[c] = live rows while processing chunk c).
inline std::vector<long> ovq_sizes(const OvqParams& p, long T) {
  assert(p.chunk >= 1 && p.max_centroids >= 1 && T >= 0);
  const long C = p.chunk;
  const long n = (T + C - 1) / C;
  std::vector<long> sizes(n + 1, 0);
  for (long c = 1; c <= n; ++c)
    sizes[c] = detail::ovq_next_size(p, sizes[c - 1], std::min(T, c * C));
  return sizes;
}

// Spec sections 4-5: chunk by chunk; attend first, then commit the chunk if it is full.
inline OvqResult ovq_prefill(const OvqSequence& s, const OvqParams& p) {
  detail::ovq_check(s, p);
  const long T = s.T, C = p.chunk;
  const std::vector<long> sizes = ovq_sizes(p, T);
  OvqResult res;
  res.y.assign(s.H * T * s.Dv, 0.0);
  res.lse.assign(s.H * T, 0.0);
  res.rows = sizes[T / C];
  for (long h = 0; h < s.H; ++h) {
    const detail::OvqHeadInputs in(s, h);
    detail::OvqDict dict(p.max_centroids, s.D, s.Dv);
    for (long c = 0; c * C < T; ++c) {
      const long b = c * C, e = std::min(T, b + C), m = sizes[c];
      for (long u = b; u < e; ++u) {
        std::vector<const double*> tk, tv;
        for (long t = b; t <= u; ++t) {   // causal inside the chunk; older raw tokens never seen
          tk.push_back(in.khat[t].data());
          tv.push_back(&s.v[(h * T + t) * s.Dv]);
        }
        res.lse[h * T + u] = detail::ovq_attend(dict, m, in.qs[u], tk, tv, p.count_bias, &res.y[(h * T + u) * s.Dv]);
      }
      if (e - b == C) {                   // only full chunks are committed
        std::vector<double> kh;
        for (long t = b; t < e; ++t) kh.insert(kh.end(), in.khat[t].begin(), in.khat[t].end());
        detail::commit(dict, m, sizes[c + 1] - m, kh.data(), &s.v[(h * T + b) * s.Dv], C,
                       p.normalize_centroids);
      }
    }
    detail::ovq_store(res, dict, sizes[T / C], h);
  }
  return res;
}

// Spec section 6: token by token from an empty cache; append -> attend -> commit if full.
inline OvqResult ovq_decode(const OvqSequence& s, const OvqParams& p) {
  detail::ovq_check(s, p);
  const long T = s.T, C = p.chunk;
  OvqResult res;
  res.y.assign(s.H * T * s.Dv, 0.0);
  res.lse.assign(s.H * T, 0.0);
  if (s.H == 0) res.rows = ovq_sizes(p, T)[T / C];
  for (long h = 0; h < s.H; ++h) {
    detail::OvqDict dict(p.max_centroids, s.D, s.Dv);
    long committed = 0, size = 0;          // size = sizes[committed]
    std::vector<double> pend_k, pend_v;    // pending raw tokens: khat [n, D], v [n, Dv]
    const double scale = s.beta[h] * std::sqrt(static_cast<double>(s.D));
    for (long u = 0; u < T; ++u) {
      std::vector<double> qs = detail::ovq_unit(&s.q[(h * T + u) * s.D], s.D);
      for (double& e : qs) e *= scale;
      const std::vector<double> kh = detail::ovq_unit(&s.k[(h * T + u) * s.D], s.D);
      const double* vu = &s.v[(h * T + u) * s.Dv];
      pend_k.insert(pend_k.end(), kh.begin(), kh.end());
      pend_v.insert(pend_v.end(), vu, vu + s.Dv);
      const long n = static_cast<long>(pend_v.size()) / s.Dv;
      std::vector<const double*> tk, tv;
      for (long j = 0; j < n; ++j) {
        tk.push_back(&pend_k[j * s.D]);
        tv.push_back(&pend_v[j * s.Dv]);
      }
      res.lse[h * T + u] = detail::ovq_attend(dict, size, qs, tk, tv, p.count_bias, &res.y[(h * T + u) * s.Dv]);
      if (n == C) {
        const long next = detail::ovq_next_size(p, size, (committed + 1) * C);
        detail::commit(dict, size, next - size, pend_k.data(), pend_v.data(), C,
                       p.normalize_centroids);
        size = next;
        ++committed;
        pend_k.clear();
        pend_v.clear();
      }
    }
    detail::ovq_store(res, dict, size, h);
  }
  return res;
}

}  // namespace kvmem_ref
