#pragma once
/// \file readout.hpp
/// Block attention readout: one softmax over [state rows ; block sliding window], online (flash-style).

#include <Kokkos_Core.hpp>

#include "../config.hpp"
#include "../policy/layer_weights.hpp"
#include "../state/state_rows.hpp"
#include "step_plan.hpp"
#include "vector_ops.hpp"

namespace kvmem::kernels {

/// Keys processed per online-softmax tile.
inline constexpr int readout_key_tile = 32;
/// Queries handled by one team.
inline constexpr int readout_query_block = 16;

/// Running online-softmax state of one query: max logit, normalizer and the un-normalized output
/// (acc [Dv], in scratch). `add_tile` folds a tile of logits and values in; the tiles' order and
/// boundaries fix the bits, so prefill and decode, which walk the same tiles, agree exactly.
struct OnlineSoftmax {
  float max_logit = neg_inf();
  float normalizer = 0.0f;
  float* acc = nullptr;
  int value_dim = 0;

  /// Starts an empty softmax whose output accumulator is `acc` [dim] (zeroed here).
  KOKKOS_INLINE_FUNCTION void reset(float* accumulator, int dim) {
    max_logit = neg_inf();
    normalizer = 0.0f;
    acc = accumulator;
    value_dim = dim;
    for (int c = 0; c < dim; ++c) acc[c] = 0.0f;
  }
  /// Writes acc / normalizer to out [value_dim].
  KOKKOS_INLINE_FUNCTION void finish(float* out) const {
    const float inv = 1.0f / normalizer;
    for (int c = 0; c < value_dim; ++c) out[c] = acc[c] * inv;
  }

  template <class ValueOf>
  KOKKOS_INLINE_FUNCTION void add_tile(const float* logits, int n, ValueOf value_of) {
    float tile_max = neg_inf();
    for (int j = 0; j < n; ++j) tile_max = logits[j] > tile_max ? logits[j] : tile_max;
    const float new_max = tile_max > max_logit ? tile_max : max_logit;
    const float correction = Kokkos::exp(max_logit - new_max);
    normalizer *= correction;
    for (int c = 0; c < value_dim; ++c) acc[c] *= correction;
    for (int j = 0; j < n; ++j) {
      const float pj = Kokkos::exp(logits[j] - new_max);
      normalizer += pj;
      const float* vj = value_of(j);
      for (int c = 0; c < value_dim; ++c) acc[c] += pj * vj[c];
    }
    max_logit = new_max;
  }
};

/// No logit bias (window tokens, exact attention).
struct NoBias {
  KOKKOS_INLINE_FUNCTION float operator()(long) const { return 0.0f; }
};

/// Folds keys [0, count) into `sm` tile by tile: logit_j = q · key_of(j) * scale + bias_of(j) over `dim`
/// channels, values value_of(j). `logits` is scratch of readout_key_tile floats. Tiles start at 0, so two
/// calls over the same keys give the same bits whatever else the caller does.
template <class KeyOf, class ValueOf, class BiasOf = NoBias>
KOKKOS_INLINE_FUNCTION void attend(OnlineSoftmax& sm, const float* q, int dim, long count, float scale, float* logits,
                                   KeyOf key_of, ValueOf value_of, BiasOf bias_of = {}) {
  constexpr int KT = readout_key_tile;
  for (long j0 = 0; j0 < count; j0 += KT) {
    const int n = static_cast<int>(count - j0 < KT ? count - j0 : KT);
    for (int j = 0; j < n; ++j) logits[j] = dot(q, key_of(j0 + j), dim) * scale + bias_of(j0 + j);
    sm.add_tile(logits, n, [&](int j) { return value_of(j0 + j); });
  }
}

/// Attention output for the queries of every (sequence b, query head hq) at positions
/// [query_begin, query_end) of plan row b (spec KVM.md §3, OVQ.md §4):
///   logit(u, i) = q_u · read_keys_i * Merge::logit_scale(tau_state[hq], q_u) + Merge::row_bias(row i)
///                 for state rows i < read_rows,
///   logit(u, p) = q_u · k_p * Merge::logit_scale(tau_window[hq], q_u) for window positions
///                 window_begin <= p <= u (k_p as Merge::window_key stored it),
///   y_u = softmax(logits) · [read_values ; v].
/// q [B, Hq, T, D] and y [B, Hq, T, Dv] are indexed by position - input_offset and need unit channel
/// stride. Query head hq reads kv-head hq / G (GQA). `max_queries` bounds query_end - query_begin.
/// Each query is computed by one thread in a fixed order: the same bits on every run of a backend.
template <class Merge, class ExecSpace, class QueriesIn, class Out>
void readout(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
             const state::StateRows<typename ExecSpace::memory_space>& rows,
             const state::WindowRing<typename ExecSpace::memory_space>& ring,
             const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q, const Out& y,
             long max_queries) {
  const long B = static_cast<long>(plan.device.extent(0));
  if (max_queries <= 0 || B == 0) return;
  constexpr int QB = readout_query_block, KT = readout_key_tile;
  const long blocks = (max_queries + QB - 1) / QB;
  const int Hq = cfg.query_heads, G = cfg.group(), D = cfg.head_dim, Dv = cfg.value_dim;
  const auto p = plan.device;
  using policy_t = Kokkos::TeamPolicy<ExecSpace>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  const size_t per_thread = scratch_t::shmem_size(KT + Dv);
  policy_t policy(exec, B * Hq * blocks, Kokkos::AUTO);
  policy = policy.set_scratch_size(0, Kokkos::PerThread(per_thread));
  Kokkos::parallel_for(
      "kvmem::readout", policy, KOKKOS_LAMBDA(const member_t& team) {
        const long league = team.league_rank();
        const long blk = league % blocks, hq = (league / blocks) % Hq, b = league / (blocks * Hq);
        const long h = hq / G;
        const long first = p(b, query_begin) + blk * QB;
        const long last = Kokkos::min(p(b, query_end), first + QB);
        if (first >= last) return;
        scratch_t scratch(team.thread_scratch(0), KT + Dv);
        float* logits = scratch.data();
        const long m = p(b, read_rows), wb = p(b, window_begin_pos), off = p(b, input_offset);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, first, last), [&](long u) {
          const float* qu = &q(b, hq, u - off, 0);
          OnlineSoftmax sm;
          sm.reset(scratch.data() + KT, Dv);
          attend(sm, qu, D, m, Merge::logit_scale(w.tau_state[hq], qu, D), logits,
                 [&](long i) { return &rows.read_keys(b, h, i, 0); },
                 [&](long i) { return &rows.read_values(b, h, i, 0); },
                 [&](long i) { return Merge::row_bias(rows.row(b, h, i)); });
          attend(sm, qu, D, u + 1 - wb, Merge::logit_scale(w.tau_window[hq], qu, D), logits,
                 [&](long j) { return &ring.keys(b, h, ring.slot(wb + j), 0); },
                 [&](long j) { return &ring.values(b, h, ring.slot(wb + j), 0); });
          sm.finish(&y(b, hq, u - off, 0));
        });
      });
}

}  // namespace kvmem::kernels
