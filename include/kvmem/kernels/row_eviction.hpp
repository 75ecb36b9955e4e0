#pragma once
/// \file row_eviction.hpp
/// Row eviction for merging memories (score::RowEviction): each state row's attention probability, and the
/// eviction of the rows with the lowest statistic after a fold. Kernel labels have at most 15 characters:
/// Kokkos copies a label into a std::string at every launch, and a longer one is a heap allocation per
/// decoded token (docs/reliability.md).

#include <Kokkos_Core.hpp>

#include "../config.hpp"
#include "../policy/layer_weights.hpp"
#include "../state/state_rows.hpp"
#include "step_plan.hpp"
#include "vector_ops.hpp"

namespace kvmem::kernels {

/// stats(b, h, i) = policy.attended(stats, p_u) for every query u of the step in position order and every
/// state row i < read_rows, with p_u = sum over the G query heads hq of the group of
/// exp(logit(u, i) - lse(b, hq, u - query_begin)), logit as in readout() (Merge::logit_scale and
/// Merge::row_bias), lse [B, Hq, max_queries] the log-sum-exp the readout wrote. float64 sums in a fixed
/// order, so prefill (many queries per step) and decode (one) give the same bits.
template <class Merge, class Policy, class ExecSpace, StorageType T, class QueriesIn, class Lse>
void accumulate_row_attention(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                              const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                              const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q,
                              const Lse& lse, const Policy& policy, long max_rows) {
  const long B = static_cast<long>(rows.keys.extent(0)), H = static_cast<long>(rows.keys.extent(1));
  if (B == 0 || max_rows <= 0) return;
  const int G = cfg.group(), D = cfg.head_dim;
  const auto p = plan.device;
  Kokkos::parallel_for(
      "kvmem::row_attn", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * H * max_rows), KOKKOS_LAMBDA(long idx) {
        const long i = idx % max_rows, h = (idx / max_rows) % H, b = idx / (max_rows * H);
        if (i >= p(b, read_rows)) return;
        const long first = p(b, query_begin), last = p(b, query_end), off = p(b, input_offset);
        const float bias = Merge::row_bias(rows.row(b, h, i));
        double stat = rows.stats(b, h, i);
        for (long u = first; u < last; ++u) {
          double mass = 0.0;
          for (int g = 0; g < G; ++g) {
            const long hq = h * G + g;
            const auto* qu = &q(b, hq, u - off, 0);
            const float logit = mul_add(dot(qu, &rows.read_keys(b, h, i, 0), D),
                                        Merge::logit_scale(w.tau_state[hq], qu, D), bias);
            mass += Kokkos::exp(static_cast<double>(logit) - static_cast<double>(lse(b, hq, u - first)));
          }
          stat = policy.attended(stat, mass);
        }
        rows.stats(b, h, i) = stat;
      });
}

/// After a fold left rows_before + append_count rows, evicts p(b, rows_evicted) of them per (b, h): the
/// lowest statistic first (ties: the lower index, the older row) among the rows that existed before the
/// fold, then (only if those run out) among the fold's fresh rows; never one of the first cfg.sinks rows.
/// Compacts the rest in their order (keys, values, read caches, radius, counts, statistics). New rows of
/// this fold start at statistic 0 (set here). One thread per (sequence, kv-head).
template <class ExecSpace, StorageType T>
void evict_rows(const ExecSpace& exec, const MemoryConfig& cfg,
                const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                const StepPlan<typename ExecSpace::memory_space>& plan) {
  const long B = static_cast<long>(rows.keys.extent(0)), H = static_cast<long>(rows.keys.extent(1));
  const int D = cfg.head_dim, Dv = cfg.value_dim;
  const long sinks = cfg.sinks;
  const auto p = plan.device;
  Kokkos::parallel_for(
      "kvmem::rowevict", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * H), KOKKOS_LAMBDA(long idx) {
        const long h = idx % H, b = idx / H;
        if (p(b, block_count) == 0) return;
        const long before = p(b, rows_before), m = before + p(b, append_count);
        for (long i = before; i < m; ++i) rows.stats(b, h, i) = 0.0;
        // The fold's fresh rows [before, m) have not been read by any query yet (statistic 0): they are
        // exempt while older rows remain, so a fold evicts stale rows, not the tokens it just appended.
        long evict = p(b, rows_evicted);
        const double gone = Kokkos::Experimental::infinity_v<double>;  // marks an evicted row
        for (int pass = 0; pass < 2 && evict > 0; ++pass) {
          const long lo = pass == 0 ? sinks : (before > sinks ? before : sinks), hi = pass == 0 ? before : m;
          while (evict > 0) {
            long worst = -1;
            for (long i = lo; i < hi; ++i) {
              const double s = rows.stats(b, h, i);
              if (s != gone && (worst < 0 || s < rows.stats(b, h, worst))) worst = i;
            }
            if (worst < 0) break;
            rows.stats(b, h, worst) = gone;
            --evict;
          }
        }
        long out = 0;
        for (long i = 0; i < m; ++i) {
          if (i >= sinks && rows.stats(b, h, i) == gone) continue;
          if (out != i) {
            for (int c = 0; c < D; ++c) rows.keys(b, h, out, c) = rows.keys(b, h, i, c);
            for (int c = 0; c < D; ++c) rows.read_keys(b, h, out, c) = rows.read_keys(b, h, i, c);
            if (rows.decision_keys.data() != nullptr)
              for (int c = 0; c < D; ++c) rows.decision_keys(b, h, out, c) = rows.decision_keys(b, h, i, c);
            for (int c = 0; c < Dv; ++c) rows.values(b, h, out, c) = rows.values(b, h, i, c);
            for (int c = 0; c < Dv; ++c) rows.read_values(b, h, out, c) = rows.read_values(b, h, i, c);
            rows.radius(b, h, out) = rows.radius(b, h, i);
            rows.counts(b, h, out) = rows.counts(b, h, i);
            rows.stats(b, h, out) = rows.stats(b, h, i);
          }
          ++out;
        }
      });
}

}  // namespace kvmem::kernels
