#pragma once
/// \file row_eviction.hpp
/// Row eviction for merging memories (score::RowEviction): each state row's attention probability, and the
/// eviction of the rows with the lowest statistic after a fold (a pass of the update kernel, update.hpp).
/// Kernel labels have at most 15 characters: Kokkos copies a label into a std::string at every launch, and
/// a longer one is a heap allocation per decoded token (docs/reliability.md).

#include <Kokkos_Core.hpp>
#include <type_traits>

#include "../../config.hpp"
#include "../../policy/layer_weights.hpp"
#include "../../state/state_rows.hpp"
#include "../common/scratch.hpp"
#include "../../math/simd.hpp"
#include "../../math/softmax_exp.hpp"
#include "../plan/step_launch.hpp"
#include "../plan/step_plan.hpp"
#include "../common/team_select.hpp"
#include "../common/tile_traits.hpp"
#include "../../math/vector_ops.hpp"

namespace kvmem::kernels {

/// State rows per team of the register-tile form of accumulate_row_attention: the rows' read keys in
/// vector lanes (a multiple of the register vector's width).
inline constexpr int row_attention_lanes = 16;

/// stats(b, h, i) = policy.attended(stats, p_u) for every query u of the step in position order and every
/// state row i < read_rows, with p_u = sum over the G query heads hq of the group of
/// softmax_exp(logit(u, i) - lse(b, hq, u - query_begin)) in head order, logit = mul_add(dot(q_u,
/// read_key_i), Merge::logit_scale(tau_state[hq], q_u), Merge::row_bias(row i)) as in readout(), lse [B, Hq,
/// max_queries] the log-sum-exp the readout wrote. The logit, each probability (the readout's exp, within
/// 1 ulp of expf) and p_u are float32, the statistic float64 (it sums a probability per query over a row's
/// lifetime, up to millions: docs/numerics.md), in that fixed order, so prefill (many queries per step) and
/// decode (one) give the same bits, and both forms below give the bits of the per-row loop (tests/unit/
/// test_row_attention.cpp):
/// - Traits::spread (GPUs): one thread per (sequence, kv-head, row), the loop as written above;
/// - register tiles (CPUs): a team per (sequence, kv-head, row_attention_lanes rows), the rows' read keys
///   widened and transposed into team scratch once per step ([D][lanes] floats), then the step's (query,
///   head) pairs in order, a register tile of them at a time against every row of the team
///   (simd::lane_dots: per (row, pair) kernels::dot's chain), the exponentials and sums in vector lanes
///   across the rows (each lane the scalar form's bits).
/// `max_rows` bounds read_rows over the batch (rows, >= 0). Source: H2O (Zhang et al., 2023, Sec. 3) over
/// state rows; the kvm-paper's readout logit (Sec. 4), the ovq-paper's (Sec. 3.2).
template <class Merge, class Policy, class ExecSpace, StorageType T, class QueriesIn, class Lse,
          class Traits = TileTraits<ExecSpace>>
void accumulate_row_attention(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                              const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                              const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q,
                              const Lse& lse, const Policy& policy, long max_rows) {
  const long B = static_cast<long>(rows.keys.extent(0)), H = static_cast<long>(rows.keys.extent(1));
  if (B == 0 || max_rows <= 0) return;
  const int G = cfg.group(), D = cfg.head_dim;
  const auto p = plan.device;
  using q_ptr = std::add_pointer_t<std::add_const_t<typename QueriesIn::value_type>>;
  // The logit's factor for query qu of head hq, and the probability exp(logit - lse) of query u of head hq.
  auto scale_of = [=] KOKKOS_FUNCTION(long hq, q_ptr qu) { return Merge::logit_scale(w.tau_state[hq], qu, D); };
  auto probability = [=] KOKKOS_FUNCTION(float logit, long b, long hq, long u) {
    return softmax_exp(logit - static_cast<float>(lse(b, hq, u - p(b, query_begin))));
  };
  if constexpr (Traits::spread) {
    Kokkos::parallel_for(
        "kvmem::row_attn", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B * H * max_rows), KOKKOS_LAMBDA(long idx) {
          const long i = idx % max_rows, h = (idx / max_rows) % H, b = idx / (max_rows * H);
          if (i >= p(b, read_rows)) return;
          const long first = p(b, query_begin), last = p(b, query_end), off = p(b, input_offset);
          const float bias = Merge::row_bias(rows.row(b, h, i));
          double stat = rows.stats(b, h, i);
          for (long u = first; u < last; ++u) {
            float mass = 0.0f;
            for (int g = 0; g < G; ++g) {
              const long hq = h * G + g;
              const auto* qu = &q(b, hq, u - off, 0);
              mass += probability(mul_add(dot(qu, &rows.read_keys(b, h, i, 0), D), scale_of(hq, qu), bias), b, hq, u);
            }
            stat = policy.attended(stat, mass);
          }
          rows.stats(b, h, i) = stat;
        });
  } else {
    constexpr int L = row_attention_lanes, K = simd::width * 8 / L > 0 ? simd::width * 8 / L : 1;
    static_assert(L % simd::width == 0, "the rows of a team fill whole register vectors");
    const long tiles = (max_rows + L - 1) / L;
    using policy_t = Kokkos::TeamPolicy<ExecSpace, step_launch>;
    int level = 0;
    const auto team_policy = with_float_scratch(policy_t(exec, B * H * tiles, 1), long(D) * L, level);
    Kokkos::parallel_for("kvmem::row_attn", team_policy, KOKKOS_LAMBDA(const typename policy_t::member_type& team) {
      const long idx = team.league_rank();
      const long i0 = (idx % tiles) * L, h = (idx / tiles) % H, b = idx / (tiles * H);
      const int n = static_cast<int>(Kokkos::min(static_cast<long>(L), p(b, read_rows) - i0));
      if (n <= 0) return;
      float* at = static_cast<float*>(team.team_scratch(level).get_shmem(sizeof(float) * D * L));
      for (int c = 0; c < D; ++c)
        for (int r = 0; r < L; ++r) at[c * L + r] = r < n ? to_float(rows.read_keys(b, h, i0 + r, c)) : 0.0f;
      // Every lane of a part-full tile computes (bias 0, statistic 0) and only the first n are stored, so
      // the loops over the L rows below vectorize without masks.
      float bias[L], mass[L], prob[L];
      double stat[L];
      for (int r = 0; r < L; ++r) bias[r] = 0.0f, stat[r] = 0.0, mass[r] = 0.0f;
      for (int r = 0; r < n; ++r) bias[r] = Merge::row_bias(rows.row(b, h, i0 + r)), stat[r] = rows.stats(b, h, i0 + r);
      const long first = p(b, query_begin), off = p(b, input_offset), pairs = (p(b, query_end) - first) * G;
      float dots[K][L];
      for (long e0 = 0; e0 < pairs; e0 += K) {  // pair e: query first + e / G of head h G + e % G
        const int kn = static_cast<int>(Kokkos::min(static_cast<long>(K), pairs - e0));
        q_ptr qs[K];
        for (int k = 0; k < kn; ++k) qs[k] = &q(b, h * G + (e0 + k) % G, first + (e0 + k) / G - off, 0);
        auto keep = [&](int k0) {
          return [&, k0](int k, int x, const simd::vec& s) { simd::store(&dots[k0 + k][x * simd::width], s); };
        };
        if (kn == K)
          simd::lane_dots<L, K>(at, D, qs, keep(0));
        else
          for (int k = 0; k < kn; ++k) simd::lane_dots<L, 1>(at, D, &qs[k], keep(k));
        for (int k = 0; k < kn; ++k) {
          const long e = e0 + k, hq = h * G + e % G, u = first + e / G;
          const float scale = scale_of(hq, qs[k]), lse_u = lse(b, hq, u - first);
          for (int r = 0; r < L; ++r) prob[r] = mul_add(dots[k][r], scale, bias[r]) - lse_u;
          for (int r = 0; r < L; ++r) prob[r] = softmax_exp(prob[r]);
          for (int r = 0; r < L; ++r) mass[r] += prob[r];
          if (e % G == G - 1)
            for (int r = 0; r < L; ++r) stat[r] = policy.attended(stat[r], mass[r]), mass[r] = 0.0f;
        }
      }
      for (int r = 0; r < n; ++r) rows.stats(b, h, i0 + r) = stat[r];
    });
  }
}

/// Channels of one array that a thread of evict_rows_team compacts together (a 64-byte cache line of
/// float32, half of one of a 16-bit read cache).
inline constexpr int evict_rows_channels = 16;

/// After a fold left rows_before + append_count rows of (sequence b, kv-head h), evicts p(b, rows_evicted)
/// of them: the lowest statistic first (ties: the lower index, the older row) among the rows that existed
/// before the fold, then (only if those run out) among the fold's fresh rows; never one of the first
/// cfg.sinks rows. As the serial scan that keeps the first strictly lower statistic: a NaN statistic at the
/// first row still in play is evicted, a NaN elsewhere never. Compacts the rest in their order (keys, values,
/// read caches, decision keys, radius, counts, statistics). New rows of this fold start at statistic 0 (set
/// here). Called by every thread of `team` (any team size, the same result): the search is exact team
/// reductions (the first row in play, then team_lowest from it: CUB's warp reduction on Cuda, with
/// `select`'s shared memory), the compaction gives each thread whole columns (evict_rows_channels channels of one array)
/// walked in row order, so that no row is read after it is overwritten; radius, counts and statistics
/// follow on one thread after a barrier. `p` is the plan's device view (StepPlan::device); p(b, block_count)
/// > 0. Ends with a team barrier. Source: H2O (Zhang et al., 2023, Sec. 3) over state rows (kvmem's
/// combination, score::RowAccumulatedAttention).
template <class Team, class Rows, class Plan>
KOKKOS_INLINE_FUNCTION void evict_rows_team(const Team& team, const MemoryConfig& cfg, const Rows& rows,
                                            const Plan& p, long b, long h, TeamSelectScratch select = {}) {
  const long before = p(b, rows_before), m = before + p(b, append_count), sinks = cfg.sinks;
  // The fold's fresh rows [before, m) have not been read by any query yet (statistic 0): they are exempt
  // while older rows remain, so a fold evicts stale rows, not the tokens it just appended.
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, before, m), [&](long i) { rows.stats(b, h, i) = 0.0; });
  team.team_barrier();
  long evict = p(b, rows_evicted);
  if (evict <= 0) return;
  const double gone = Kokkos::Experimental::infinity_v<double>;  // marks an evicted row
  auto stat = [&](long i) { return rows.stats(b, h, i); };
  for (int pass = 0; pass < 2 && evict > 0; ++pass) {
    const long lo = pass == 0 ? sinks : (before > sinks ? before : sinks), hi = pass == 0 ? before : m;
    while (evict > 0) {
      // (A reduction's result replaces its variable's initial value: this one only documents it.)
      long first = hi;  // the first row still in play
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, lo, hi),
          [&](long i, long& f) {
            if (i < f && stat(i) != gone) f = i;
          },
          Kokkos::Min<long>(first));
      if (first >= hi) break;
      const long worst = team_lowest(team, first, hi, stat, [&](long i) { return stat(i) == gone; }, select);
      KOKKOS_ASSERT(worst >= lo && worst < hi);
      Kokkos::single(Kokkos::PerTeam(team), [&] { rows.stats(b, h, worst) = gone; });
      team.team_barrier();
      --evict;
    }
  }
  // Compaction: each column of an array moves on one thread, rows in order (a row lands at or before
  // its old place), so the columns need no barrier among them.
  constexpr int W = evict_rows_channels;
  const int D = cfg.head_dim, Dv = cfg.value_dim;
  const int kc = (D + W - 1) / W, vc = (Dv + W - 1) / W;
  auto compact = [&](const auto& view, int c0, int c1) {
    long out = 0;
    for (long i = 0; i < m; ++i) {
      if (i >= sinks && stat(i) == gone) continue;
      if (out != i)
        for (int c = c0; c < c1; ++c) view(b, h, out, c) = view(b, h, i, c);
      ++out;
    }
  };
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, 3 * kc + 2 * vc), [&](int x) {
    if (x < 3 * kc) {  // keys, read keys, decision keys
      const int c0 = (x % kc) * W, c1 = Kokkos::min(D, c0 + W);
      if (x / kc == 0) compact(rows.keys, c0, c1);
      if (x / kc == 1) compact(rows.read_keys, c0, c1);
      if (x / kc == 2 && rows.decision_keys.data() != nullptr) compact(rows.decision_keys, c0, c1);
    } else {  // values, read values
      const int y = x - 3 * kc, c0 = (y % vc) * W, c1 = Kokkos::min(Dv, c0 + W);
      if (y / vc == 0) compact(rows.values, c0, c1);
      if (y / vc == 1) compact(rows.read_values, c0, c1);
    }
  });
  team.team_barrier();  // the columns read the statistics' evicted marks, which the last step overwrites
  Kokkos::single(Kokkos::PerTeam(team), [&] {
    long out = 0;
    for (long i = 0; i < m; ++i) {
      if (i >= sinks && stat(i) == gone) continue;
      if (out != i) {
        rows.radius(b, h, out) = rows.radius(b, h, i);
        rows.counts(b, h, out) = rows.counts(b, h, i);
        rows.stats(b, h, out) = rows.stats(b, h, i);
      }
      ++out;
    }
  });
  team.team_barrier();
}

}  // namespace kvmem::kernels
