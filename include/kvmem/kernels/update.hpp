#pragma once
/// \file update.hpp
/// State update with one block of tokens: score, append the winners, route and fold the rest in.
///
/// Five deterministic kernels, each parallel over (sequence, kv-head, token or row), none with float
/// atomics (spec KVM.md §5; kvm-paper Sec. 4 and App. A):
///   1. stage   memory keys of the block (and their scores when the scorer must choose),
///   2. select  which tokens become rows: the `append_count` lowest scores, ties to the lower index,
///   3. append  selected tokens as new rows, in token order,
///   4. route   every other token to its best row i >= sinks against one post-append snapshot,
///   5. fold    per row, the routed tokens in token order, then refresh the row's read caches.
/// The same kernels serve the first chunk's direct copy (append_count == block_count), so prefill and
/// decode produce identical bits.

#include <Kokkos_Core.hpp>

#include "../config.hpp"
#include "../policy/layer_weights.hpp"
#include "../policy/merge/concept.hpp"
#include "../policy/score/concept.hpp"
#include "../state/state_rows.hpp"
#include "step_plan.hpp"
#include "vector_ops.hpp"

namespace kvmem::kernels {

/// Scratch of one update for a batch: memory keys [B, Hkv, C, D], scores, append flags and routes
/// [B, Hkv, C] of the block's tokens.
template <class MemorySpace>
struct UpdateScratch {
  Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace> keys;
  Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> scores;
  Kokkos::View<int***, Kokkos::LayoutRight, MemorySpace> appended;
  Kokkos::View<long***, Kokkos::LayoutRight, MemorySpace> routes;

  void allocate(int batch, int kv_heads, int chunk, int head_dim) {
    keys = decltype(keys)("kvmem::block_keys", batch, kv_heads, chunk, head_dim);
    scores = decltype(scores)("kvmem::block_scores", batch, kv_heads, chunk);
    appended = decltype(appended)("kvmem::block_appended", batch, kv_heads, chunk);
    routes = decltype(routes)("kvmem::block_routes", batch, kv_heads, chunk);
  }
};

/// Folds the block [block_begin, block_begin + block_count) of every plan row into that sequence's
/// state (all kv-heads): `append_count` tokens become rows rows_before.. (lowest Scorer score first,
/// ties to lower token index; all tokens if append_count == block_count), the others are routed to
/// argmax_{i >= min(sinks, rows)} (g_j * memory_key_j) · read_key_i (ties to the lower row) and folded
/// with weight g_j = Merge::gate(z_j). Rows of plan rows with block_count == 0 are untouched.
/// `max_block` bounds block_count over the batch (<= chunk).
template <merge::MergePolicy Merge, score::EvictionScorer Scorer, class ExecSpace>
void update_state(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                  const state::StateRows<typename ExecSpace::memory_space>& st,
                  const state::WindowRing<typename ExecSpace::memory_space>& ring,
                  const UpdateScratch<typename ExecSpace::memory_space>& scratch,
                  const StepPlan<typename ExecSpace::memory_space>& plan, long max_block, long max_rows_after) {
  const long B = static_cast<long>(st.keys.extent(0)), H = static_cast<long>(st.keys.extent(1));
  if (max_block <= 0 || B == 0) return;
  const int D = cfg.head_dim, Dv = cfg.value_dim;
  const long C = max_block;
  const auto p = plan.device;
  const auto keys = scratch.keys;
  const auto scores = scratch.scores;
  const auto appended = scratch.appended;
  const auto routes = scratch.routes;
  using range = Kokkos::RangePolicy<ExecSpace>;

  // 1. stage: memory keys, and scores where the scorer must choose.
  Kokkos::parallel_for("kvmem::update_stage", range(exec, 0, B * H * C), KOKKOS_LAMBDA(long idx) {
    const long j = idx % C, h = (idx / C) % H, b = idx / (C * H);
    const long count = p(b, block_count), app = p(b, append_count);
    if (j >= count) return;
    const long s = ring.slot(p(b, block_begin) + j);
    float* kbar = &keys(b, h, j, 0);
    Merge::memory_key(cfg, w, &ring.keys(b, h, s, 0), kbar);
    if (app > 0 && app < count) scores(b, h, j) = Scorer::score(kbar, &st.read_keys(b, h, 0, 0), p(b, rows_before), D);
  });
  // 2. select: rank by (score asc, token index asc); append the first append_count.
  Kokkos::parallel_for("kvmem::update_select", range(exec, 0, B * H * C), KOKKOS_LAMBDA(long idx) {
    const long j = idx % C, h = (idx / C) % H, b = idx / (C * H);
    const long count = p(b, block_count), app = p(b, append_count);
    if (j >= count) return;
    if (app == 0 || app == count) {
      appended(b, h, j) = app == count ? 1 : 0;
      return;
    }
    const float sj = scores(b, h, j);
    long rank = 0;
    for (long i = 0; i < count; ++i) {
      const float si = scores(b, h, i);
      rank += (si < sj || (si == sj && i < j)) ? 1 : 0;
    }
    appended(b, h, j) = rank < app ? 1 : 0;
  });
  // 3. append selected tokens as rows, in token order (ungated, spec KVM.md §5.4).
  Kokkos::parallel_for("kvmem::update_append", range(exec, 0, B * H * C), KOKKOS_LAMBDA(long idx) {
    const long j = idx % C, h = (idx / C) % H, b = idx / (C * H);
    if (j >= p(b, block_count) || !appended(b, h, j)) return;
    long row = p(b, rows_before);
    for (long i = 0; i < j; ++i) row += appended(b, h, i);
    const float* kbar = &keys(b, h, j, 0);
    const float* v = &ring.values(b, h, ring.slot(p(b, block_begin) + j), 0);
    for (int c = 0; c < D; ++c) st.keys(b, h, row, c) = kbar[c];
    for (int c = 0; c < Dv; ++c) st.values(b, h, row, c) = v[c];
    const float radius = norm2(v, Dv);
    st.radius(b, h, row) = radius;
    Merge::read_key(cfg, w, kbar, &st.read_keys(b, h, row, 0));
    Merge::read_value(cfg, v, radius, &st.read_values(b, h, row, 0));
  });
  // 4. route merged tokens against the post-append snapshot (batched, spec KVM.md §5.5, §9 #2-#3).
  const long sinks = cfg.sinks;
  Kokkos::parallel_for("kvmem::update_route", range(exec, 0, B * H * C), KOKKOS_LAMBDA(long idx) {
    const long j = idx % C, h = (idx / C) % H, b = idx / (C * H);
    const long count = p(b, block_count), app = p(b, append_count);
    if (j >= count || app == count || appended(b, h, j)) return;
    const long rows_now = p(b, rows_before) + app;
    const long first = Kokkos::min(sinks, rows_now);
    const float g = Merge::gate(ring.gates(b, h, ring.slot(p(b, block_begin) + j)));
    const float* kbar = &keys(b, h, j, 0);
    long best_row = first;
    float best = neg_inf();
    for (long i = first; i < rows_now; ++i) {
      const float* khat = &st.read_keys(b, h, i, 0);
      float s = 0.0f;
      for (int c = 0; c < D; ++c) s += (g * kbar[c]) * khat[c];
      if (s > best || i == first) {
        best = s;
        best_row = i;
      }
    }
    routes(b, h, j) = best_row;
  });
  // 5. fold routed tokens into their rows in token order, then refresh the rows' read caches.
  Kokkos::parallel_for("kvmem::update_fold", range(exec, 0, B * H * max_rows_after), KOKKOS_LAMBDA(long idx) {
    const long i = idx % max_rows_after, h = (idx / max_rows_after) % H, b = idx / (max_rows_after * H);
    const long count = p(b, block_count), app = p(b, append_count);
    if (count == 0 || app == count || i >= p(b, rows_before) + app) return;
    bool touched = false;
    for (long j = 0; j < count; ++j) {
      if (appended(b, h, j) || routes(b, h, j) != i) continue;
      const long s = ring.slot(p(b, block_begin) + j);
      const float g = Merge::gate(ring.gates(b, h, s));
      Merge::fold(&st.keys(b, h, i, 0), &keys(b, h, j, 0), g, D);
      Merge::fold(&st.values(b, h, i, 0), &ring.values(b, h, s, 0), g, Dv);
      touched = true;
    }
    if (touched) {
      Merge::read_key(cfg, w, &st.keys(b, h, i, 0), &st.read_keys(b, h, i, 0));
      Merge::read_value(cfg, &st.values(b, h, i, 0), st.radius(b, h, i), &st.read_values(b, h, i, 0));
    }
  });
}

}  // namespace kvmem::kernels
