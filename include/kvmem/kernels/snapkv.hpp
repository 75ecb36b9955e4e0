#pragma once
/// \file snapkv.hpp
/// SnapKV's one-shot selection at the end of prefill (Li et al. 2024; spec EVICTION.md §6 "SnapKV").

#include <Kokkos_Core.hpp>

namespace kvmem::kernels {

/// Work space of snapkv_keep for B sequences of at most T tokens: lse [B, Hq, W] and scores [B, Hkv, T],
/// float64.
template <class MemorySpace>
struct SnapKvScratch {
  Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> lse, raw, pooled;
  void allocate(long B, long Hq, long Hkv, long T, long window) {
    lse = decltype(lse)("kvmem::snapkv_lse", B, Hq, window);
    raw = decltype(raw)("kvmem::snapkv_raw", B, Hkv, T);
    pooled = decltype(pooled)("kvmem::snapkv_pooled", B, Hkv, T);
  }
};

/// Which tokens SnapKV keeps after a prompt of L = lengths[b] tokens, per (sequence, kv-head): with the
/// observation window of the last W = `window` queries and capacity C_max = window + `top_k`,
///   score_t = mean_g avgpool5( sum_{i in [L-W, L)} p^{(g)}_{i -> t} ),  t < L - W,
/// p the dense causal softmax of q_i . k_t / sqrt(D), avgpool5 the average over [t-2, t+2] that counts zero
/// pads (always / 5), g the G query heads of the kv-head; the top `top_k` prefix tokens by score (ties: the
/// newer token) and the window [L-W, L) are kept; every token when L <= C_max. Inputs q [B, Hq, T, D],
/// k [B, Hkv, T, D], lengths [B] (device, each <= T); outputs positions [B, Hkv, K] (increasing, -1 past
/// rows; K >= min(T, C_max)) and rows [B, Hkv]. float64 arithmetic, one fixed order: deterministic.
template <class ExecSpace, class TokensIn, class Lengths, class Positions, class Rows>
void snapkv_keep(const ExecSpace& exec, const TokensIn& q, const TokensIn& k, const Lengths& lengths, int window,
                 int top_k, const SnapKvScratch<typename ExecSpace::memory_space>& s, const Positions& positions,
                 const Rows& rows) {
  const long B = static_cast<long>(k.extent(0)), Hkv = static_cast<long>(k.extent(1));
  const long Hq = static_cast<long>(q.extent(1)), T = static_cast<long>(k.extent(2));
  const int D = static_cast<int>(k.extent(3));
  const long G = Hq / Hkv, W = window, K = static_cast<long>(positions.extent(2));
  const double scale = 1.0 / Kokkos::sqrt(static_cast<double>(D));
  auto logit = KOKKOS_LAMBDA(long b, long hq, long i, long t) {
    double acc = 0.0;
    for (int c = 0; c < D; ++c) acc += static_cast<double>(q(b, hq, i, c)) * k(b, hq / G, t, c);
    return acc * scale;
  };
  using range = Kokkos::RangePolicy<ExecSpace>;
  // log-sum-exp of every observation query's causal row
  Kokkos::parallel_for("kvmem::snapkv_lse", range(exec, 0, B * Hq * W), KOKKOS_LAMBDA(long idx) {
    const long j = idx % W, hq = (idx / W) % Hq, b = idx / (W * Hq);
    const long L = lengths(b), i = L - W + j;
    if (i < 0) return;
    double mx = -Kokkos::Experimental::infinity_v<double>;
    for (long t = 0; t <= i; ++t) mx = Kokkos::fmax(mx, logit(b, hq, i, t));
    double sum = 0.0;
    for (long t = 0; t <= i; ++t) sum += Kokkos::exp(logit(b, hq, i, t) - mx);
    s.lse(b, hq, j) = mx + Kokkos::log(sum);
  });
  // attention of the window to every prefix token, summed over the window, averaged over the group
  Kokkos::parallel_for("kvmem::snapkv_vote", range(exec, 0, B * Hkv * T), KOKKOS_LAMBDA(long idx) {
    const long t = idx % T, h = (idx / T) % Hkv, b = idx / (T * Hkv);
    const long L = lengths(b);
    double total = 0.0;
    if (t < L - W)
      for (long g = 0; g < G; ++g)
        for (long j = 0; j < W; ++j) total += Kokkos::exp(logit(b, h * G + g, L - W + j, t) - s.lse(b, h * G + g, j));
    s.raw(b, h, t) = total / static_cast<double>(G);
  });
  Kokkos::parallel_for("kvmem::snapkv_pool", range(exec, 0, B * Hkv * T), KOKKOS_LAMBDA(long idx) {
    const long t = idx % T, h = (idx / T) % Hkv, b = idx / (T * Hkv);
    const long prefix = lengths(b) - W;
    double sum = 0.0;
    for (long d = -2; d <= 2; ++d)
      if (t + d >= 0 && t + d < prefix) sum += s.raw(b, h, t + d);
    s.pooled(b, h, t) = sum / 5.0;
  });
  // keep the top_k prefix tokens (higher score first, then the newer token) and the window, in order
  Kokkos::parallel_for("kvmem::snapkv_select", range(exec, 0, B * Hkv), KOKKOS_LAMBDA(long idx) {
    const long h = idx % Hkv, b = idx / Hkv, L = lengths(b), prefix = L - W;
    long n = 0;
    for (long t = 0; t < L; ++t) {
      bool keep = L <= W + top_k || t >= prefix;
      if (!keep) {
        long better = 0;
        const double st = s.pooled(b, h, t);
        for (long u = 0; u < prefix && better < top_k; ++u) {
          const double su = s.pooled(b, h, u);
          better += su > st || (su == st && u > t);
        }
        keep = better < top_k;
      }
      if (keep) {
        if (n < K) positions(b, h, n) = t;
        ++n;
      }
    }
    rows(b, h) = n;
    for (long i = n; i < K; ++i) positions(b, h, i) = -1;
  });
}

}  // namespace kvmem::kernels
