#pragma once
/// \file metrics.hpp
/// How close a memory's attention output y stays to exact causal attention y*, computed on the host in
/// float64 over the valid tokens (t < lengths[b]) of every sequence and query head.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace kvmem::tools::eval {

using HostOut = Kokkos::View<float****, Kokkos::LayoutRight, Kokkos::HostSpace>;

/// Position buckets: K consecutive ranges [edge_i, edge_{i+1}) of [0, T) with edge_i = round(i * T / K).
inline std::vector<std::pair<long, long>> position_buckets(long T, int K) {
  std::vector<std::pair<long, long>> out;
  for (int i = 0; i < K; ++i) {
    const long b = static_cast<long>(std::llround(static_cast<double>(i) * T / K));
    const long e = static_cast<long>(std::llround(static_cast<double>(i + 1) * T / K));
    if (e > b) out.emplace_back(b, e);
  }
  return out;
}

struct Metrics {
  double rel_l2 = 0;                ///< ||y - y*|| / ||y*|| over all valid tokens and heads
  double cosine_mean = 0;           ///< mean over valid (sequence, head, token) of cos(y_t, y*_t)
  double cosine_min = 0;            ///< smallest of those cosines
  std::vector<double> bucket_rel_l2;  ///< rel_l2 within each position bucket
  std::vector<double> head_rel_l2;    ///< rel_l2 of each query head
  long tokens = 0;                  ///< valid (sequence, head, token) triples compared
};

/// Compares y with y* (both [B, Hq, T, Dv] on the host) over from <= t < lengths[b] (kvmem-eval --prompt: the
/// decoded positions).
inline Metrics compare(const HostOut& y, const HostOut& ref, const std::vector<long>& lengths,
                       const std::vector<std::pair<long, long>>& buckets, long from = 0) {
  const long B = static_cast<long>(ref.extent(0)), Hq = static_cast<long>(ref.extent(1));
  const long Dv = static_cast<long>(ref.extent(3));
  Metrics m;
  std::vector<double> berr(buckets.size(), 0.0), bref(buckets.size(), 0.0), herr(Hq, 0.0), href(Hq, 0.0);
  double err2 = 0, ref2 = 0, cos_sum = 0, cos_min = 1.0;
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < Hq; ++h) {
      std::size_t k = 0;
      for (long t = from; t < lengths[b]; ++t) {
        while (k + 1 < buckets.size() && t >= buckets[k].second) ++k;
        double e = 0, r = 0, yy = 0, dot = 0;
        for (long c = 0; c < Dv; ++c) {
          const double a = y(b, h, t, c), x = ref(b, h, t, c);
          e += (a - x) * (a - x);
          r += x * x;
          yy += a * a;
          dot += a * x;
        }
        err2 += e;
        ref2 += r;
        berr[k] += e;
        bref[k] += r;
        herr[h] += e;
        href[h] += r;
        const double cs = (r == 0 && yy == 0) ? 1.0 : (r == 0 || yy == 0) ? 0.0 : dot / std::sqrt(r * yy);
        cos_sum += cs;
        cos_min = std::min(cos_min, cs);
        ++m.tokens;
      }
    }
  auto rel = [](double e, double r) { return r > 0 ? std::sqrt(e / r) : (e > 0 ? INFINITY : 0.0); };
  m.rel_l2 = rel(err2, ref2);
  m.cosine_mean = m.tokens ? cos_sum / static_cast<double>(m.tokens) : 1.0;
  m.cosine_min = m.tokens ? cos_min : 1.0;
  for (std::size_t i = 0; i < buckets.size(); ++i) m.bucket_rel_l2.push_back(rel(berr[i], bref[i]));
  for (long h = 0; h < Hq; ++h) m.head_rel_l2.push_back(rel(herr[h], href[h]));
  return m;
}

}  // namespace kvmem::tools::eval
