#pragma once
/// \file snapkv.hpp
/// SnapKV's one-shot selection at the end of prefill (Li et al. 2024; spec EVICTION.md §6 "SnapKV").

#include <Kokkos_Core.hpp>
#include <Kokkos_NestedSort.hpp>
#include <type_traits>

#include "../../backend/cuda/snapkv_rank.hpp"

namespace kvmem::kernels {

/// Work space of snapkv_keep for B sequences of at most T tokens: lse [B, Hq, W] and scores [B, Hkv, T],
/// float64; the ranking `order` [B, Hkv, T] (token indices) and `keep` flags [B, Hkv, T]; on Cuda, the
/// buffers of the CUB ranking (backend/cuda/snapkv_rank.hpp). Everything is sized here: a selection
/// allocates nothing.
template <class MemorySpace>
struct SnapKvScratch {
  Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> lse, raw, pooled;
  Kokkos::View<long***, Kokkos::LayoutRight, MemorySpace> order;
  Kokkos::View<unsigned char***, Kokkos::LayoutRight, MemorySpace> keep;
  backend::cuda::SnapKvSortScratch<MemorySpace> sort;
  void allocate(long B, long Hq, long Hkv, long T, long window) {
    lse = decltype(lse)("kvmem::snapkv_lse", B, Hq, window);
    raw = decltype(raw)("kvmem::snapkv_raw", B, Hkv, T);
    pooled = decltype(pooled)("kvmem::snapkv_pooled", B, Hkv, T);
    order = decltype(order)("kvmem::snapkv_order", B, Hkv, T);
    keep = decltype(keep)("kvmem::snapkv_keep", B, Hkv, T);
    sort.allocate(B * Hkv, T);
  }
};

/// SnapKV's ranking of prefix tokens: a higher pooled score first, on equal scores the newer token; a NaN
/// score ranks as -inf. A strict total order on token indices, so every correct sort gives one result.
template <class Pooled>
struct HigherScoreFirst {
  Pooled pooled;  ///< [T] scores of one (sequence, kv-head)
  KOKKOS_INLINE_FUNCTION static double key(double x) { return x != x ? -Kokkos::Experimental::infinity_v<double> : x; }
  KOKKOS_INLINE_FUNCTION bool operator()(long a, long b) const {
    const double sa = key(pooled(a)), sb = key(pooled(b));
    return sa > sb || (sa == sb && a > b);
  }
};

/// order(b, h, i), i < L_b - W: the prefix tokens of every (sequence, kv-head) in HigherScoreFirst order,
/// for the heads that drop tokens (L_b > W + top_k); others are untouched. The portable path: one team per
/// (sequence, kv-head) sorts its prefix with Kokkos' team bitonic sort.
template <class ExecSpace, class Pooled, class Lengths, class Order>
void snapkv_rank_portable(const ExecSpace& exec, const Pooled& pooled, const Lengths& lengths, long window,
                          long top_k, const Order& order) {
  const long H = static_cast<long>(pooled.extent(1)), B = static_cast<long>(pooled.extent(0));
  using policy = Kokkos::TeamPolicy<ExecSpace>;
  Kokkos::parallel_for(
      "kvmem::snapkv_rank", policy(exec, static_cast<int>(B * H), Kokkos::AUTO),
      KOKKOS_LAMBDA(const typename policy::member_type& team) {
        const long h = team.league_rank() % H, b = team.league_rank() / H, L = lengths(b);
        if (L <= window + top_k) return;
        const long prefix = L - window;
        const auto ord = Kokkos::subview(order, b, h, Kokkos::pair<long, long>(0, prefix));
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, prefix), [&](long t) { ord(t) = t; });
        team.team_barrier();
        const auto scores = Kokkos::subview(pooled, b, h, Kokkos::ALL);
        Kokkos::Experimental::sort_team(team, ord, HigherScoreFirst<decltype(scores)>{scores});
      });
}

/// The ranking of snapkv_rank_portable, by CUB's segmented radix sort on Kokkos::Cuda (the same order).
template <class ExecSpace, class Pooled, class Lengths, class Order>
void snapkv_rank(const ExecSpace& exec, const Pooled& pooled, const Lengths& lengths, long window, long top_k,
                 const Order& order, const SnapKvScratch<typename ExecSpace::memory_space>& s) {
#ifdef KOKKOS_ENABLE_CUDA
  if constexpr (std::is_same_v<ExecSpace, Kokkos::Cuda> &&
                std::is_same_v<typename ExecSpace::memory_space, Kokkos::CudaSpace>) {
    backend::cuda::snapkv_rank(exec, pooled, lengths, window, top_k, order, s.sort);
    return;
  }
#endif
  (void)s;
  snapkv_rank_portable(exec, pooled, lengths, window, top_k, order);
}

/// Which tokens SnapKV keeps after a prompt of L = lengths[b] tokens, per (sequence, kv-head): with the
/// observation window of the last W = `window` queries and capacity C_max = window + `top_k`,
///   score_t = mean_g avgpool5( sum_{i in [L-W, L)} p^{(g)}_{i -> t} ),  t < L - W,
/// p the dense causal softmax of q_i . k_t / sqrt(D), avgpool5 the average over [t-2, t+2] that counts zero
/// pads (always / 5), g the G query heads of the kv-head; the top `top_k` prefix tokens by score (ties: the
/// newer token) and the window [L-W, L) are kept; every token when L <= C_max. Inputs q [B, Hq, T, D],
/// k [B, Hkv, T, D], lengths [B] (device, each <= T); outputs positions [B, Hkv, K] (increasing, -1 past
/// rows; K >= min(T, C_max)) and rows [B, Hkv]. float64 arithmetic, one fixed order: deterministic. The
/// ranking sorts each (sequence, kv-head)'s prefix (snapkv_rank: a team bitonic sort, or CUB's segmented
/// radix sort on Cuda) and a team scan compacts the kept tokens: no thread walks a head serially.
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
  // keep the top_k prefix tokens (higher score first, then the newer token) and the window, in order:
  // rank the prefix, flag the first top_k of the ranking and the window, compact the flags in token order.
  snapkv_rank(exec, s.pooled, lengths, W, top_k, s.order, s);
  const auto order = s.order;
  const auto keep = s.keep;
  using policy = Kokkos::TeamPolicy<ExecSpace>;
  Kokkos::parallel_for(
      "kvmem::snapkv_keep", policy(exec, static_cast<int>(B * Hkv), Kokkos::AUTO),
      KOKKOS_LAMBDA(const typename policy::member_type& team) {
        const long h = team.league_rank() % Hkv, b = team.league_rank() / Hkv, L = lengths(b), prefix = L - W;
        const bool all = L <= W + top_k;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, L),
                             [&](long t) { keep(b, h, t) = all || t >= prefix ? 1 : 0; });
        team.team_barrier();
        if (!all) Kokkos::parallel_for(Kokkos::TeamThreadRange(team, top_k), [&](long i) { keep(b, h, order(b, h, i)) = 1; });
        team.team_barrier();
        long n = 0;
        Kokkos::parallel_scan(
            Kokkos::TeamThreadRange(team, L),
            [&](long t, long& before, bool final) {
              if (!keep(b, h, t)) return;
              if (final && before < K) positions(b, h, before) = t;
              ++before;
            },
            n);
        Kokkos::single(Kokkos::PerTeam(team), [&] { rows(b, h) = n; });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n < K ? n : K, K), [&](long i) { positions(b, h, i) = -1; });
      });
}

}  // namespace kvmem::kernels
