#pragma once
/// \file launch.hpp
/// The portable readout's launch (readout()): one softmax over [state rows ; block sliding window], online
/// (flash-style), a team per (sequence, kv-head, head group, position blocks), unsplit or split-KV, writing
/// the step's window tokens itself where one team reads a window (readout_writes_window).

#include <Kokkos_Core.hpp>
#include <stdexcept>
#include <type_traits>

#include "../../config.hpp"
#include "../../policy/layer_weights.hpp"
#include "../../state/state_rows.hpp"
#include "../common/scratch.hpp"
#include "../common/tile_traits.hpp"
#include "../plan/step_launch.hpp"
#include "../plan/step_plan.hpp"
#include "attend_blocks.hpp"
#include "group_lanes.hpp"
#include "online_softmax.hpp"
#include "query_block.hpp"
#include "split_kv.hpp"
#include "window_write.hpp"

namespace kvmem::kernels {

/// Whether readout() over at most `max_queries` queries per sequence (tokens) runs one team per (sequence,
/// kv-head): G <= readout_query_block and the queries fit one team's blocks (a decode step, or a prefill
/// step of at most readout_query_block x Traits::blocks_per_team / G tokens). Only then can the readout
/// write the step's tokens into the window itself (WindowTokens), as no other team reads that window.
template <class ExecSpace, class Traits = TileTraits<ExecSpace>>
[[nodiscard]] bool readout_writes_window(const MemoryConfig& cfg, long max_queries) {
  const GroupLanes gl(cfg.group(), max_queries > 0 ? max_queries : 1, Traits::blocks_per_team);
  return gl.head_groups == 1 && gl.team_blocks == 1;
}

/// Attention output for the queries of every (sequence b, query head hq) at positions
/// [query_begin, query_end) of plan row b (spec KVM.md §3, OVQ.md §4):
///   logit(u, i) = q_u · read_keys_i * Merge::logit_scale(tau_state[hq], q_u) + Merge::row_bias(row i)
///                 for state rows i < read_rows,
///   logit(u, p) = q_u · k_p * Merge::logit_scale(tau_window[hq], q_u) for window positions
///                 window_begin <= p <= u (k_p as Merge::window_key stored it),
///   y_u = softmax(logits) · [read_values ; v].
/// q [B, Hq, T, D] and y [B, Hq, T, Dv] are indexed by position - input_offset and need unit channel
/// stride; their element type, that of the state's read caches and of the window (the storage type T) may
/// be float, bfloat16 or float16, read as float32, with float32 logits, softmax and sums (docs/numerics.md).
/// Query head hq reads kv-head hq / G (GQA). `max_queries` bounds query_end - query_begin.
/// The state rows and the window are two segments of the key list, each split every readout_split_keys
/// keys (attend_blocks); the window's first split continues the state's last one, so a query that reads at
/// most readout_split_keys rows and window tokens reads them in one online softmax.
/// A team computes Traits::blocks_per_team consecutive blocks of readout_query_block queries of one kv-head's
/// group (GroupLanes: the query heads that share the kv-head, at consecutive positions; QueryBlock,
/// attend_blocks: one pass over the keys for all of them), in a fixed order: the same bits on every run of
/// a backend, for any block layout and on any thread count.
/// When `lse` [B, Hq, >= max_queries] is not empty, lse(b, hq, u - query_begin) also receives each query's
/// log-sum-exp max + log(normalizer) (for row eviction, score::RowEviction); otherwise nothing is paid.
/// When `out_lse` [B, Hq, T] (float32, any layout) is not empty, out_lse(b, hq, u - input_offset) receives the
/// same log-sum-exp, indexed as y (the readout's log-sum-exp an engine asked for: AttentionMemory).
/// `Traits` (TileTraits<ExecSpace>) picks how a team covers a key tile; it changes no bit.
/// With `split_work` of splits > 1 (a decode step: max_queries = 1, and no `fresh`; std::logic_error
/// otherwise) the step runs split-KV (detail::readout_split_kv) with the same bits.
/// With `fresh` a WindowTokens (only where readout_writes_window(cfg, max_queries); std::logic_error
/// otherwise), each team first writes the tokens [write_begin, write_end) of its (sequence, kv-head) into
/// the window ring (write_window_token, the bits write_window stores), then reads them: a decode step
/// without write_window's launch.
template <class Merge, class ExecSpace, StorageType T, class QueriesIn, class Out,
          class Lse = Kokkos::View<float***, Kokkos::LayoutRight, typename ExecSpace::memory_space>,
          class Traits = TileTraits<ExecSpace>, class Fresh = NoWindowTokens,
          class OutLse = Kokkos::View<float***, Kokkos::LayoutStride, typename ExecSpace::memory_space>>
void readout(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
             const state::StateRows<typename ExecSpace::memory_space, T>& rows,
             const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
             const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q, const Out& y,
             long max_queries, const Lse& lse = Lse{}, const Fresh& fresh = Fresh{}, const OutLse& out_lse = OutLse{},
             const DecodeSplitWork<typename ExecSpace::memory_space>& split_work = {}) {
  const long B = static_cast<long>(plan.device.extent(0));
  if constexpr (Fresh::writes)
    if (!readout_writes_window<ExecSpace, Traits>(cfg, max_queries) || split_work.splits > 1)
      throw std::logic_error("kvmem::kernels::readout: WindowTokens where a kv-head's window has several teams");
  if (max_queries <= 0 || B == 0) return;
  if (split_work.splits > 1) {
    if (max_queries != 1 || !split_work.holds(B * cfg.query_heads, split_work.splits, cfg.value_dim))
      throw std::logic_error("kvmem::kernels::readout: split-KV outside a decode step, or partials too small");
    detail::readout_split_kv<Merge, ExecSpace, T, QueriesIn, Out, Lse, Traits, OutLse>(exec, cfg, w, rows, ring, plan, q, y,
                                                                                  split_work, lse, out_lse);
    return;
  }
  constexpr int QB = readout_query_block, NB = Traits::blocks_per_team;
  const int Hkv = cfg.kv_heads, D = cfg.head_dim, Dv = cfg.value_dim;
  const GroupLanes gl(cfg.group(), max_queries, NB);
  const auto p = plan.device;
  // Dynamic schedule: a causal query block's work grows with its position, so equal shares of the league
  // are unequal work (with a static split over 2 threads of one head, one thread did 3/4 of it). Each team
  // writes only its own outputs, so the schedule cannot change a bit.
  using policy_t = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>, step_launch>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  constexpr bool packed = !std::is_same_v<T, float>;  // room for a widened key tile (QueryBlock::packs)
  // Room for closed splits where the state rows or the window (positions that fit the ring) may pass
  // readout_split_keys.
  const bool split = QueryBlock::needs_split_room(rows.capacity() > ring.slots() ? rows.capacity() : ring.slots());
  const long floats = QueryBlock::team_floats(NB, D, Dv, packed, split);
  policy_t policy(exec, gl.league(B, Hkv), Kokkos::AUTO);
  const int level = scratch_level(policy, scratch_t::shmem_size(floats));
  policy = policy.set_scratch_size(level, Kokkos::PerTeam(scratch_t::shmem_size(floats)));
  Kokkos::parallel_for(
      "kvmem::readout", policy, KOKKOS_LAMBDA(const member_t& team) {
        const auto t = gl.team(team.league_rank(), Hkv);
        const long b = t.b, h = t.h, n = t.heads;
        const long begin = p(b, query_begin), end = p(b, query_end);
        // Named outside the if constexpr: nvcc's extended lambdas cannot first-capture inside one.
        [[maybe_unused]] const Fresh& tokens = fresh;
        [[maybe_unused]] const MemoryConfig& config = cfg;
        [[maybe_unused]] const auto& window = ring;
        if constexpr (Fresh::writes)  // the only team of (b, h): a barrier below orders it before the reads
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p(b, write_begin), p(b, write_end)), [&](long pos) {
            write_window_token<Merge>(config, window, p, tokens.k, tokens.v, tokens.gate, b, h, pos);
          });
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blks[NB];
        long firsts[NB] = {};
        int nb = 0;  // the team's blocks that hold queries of row b
        for (; nb < NB && begin + (t.block + nb) * gl.positions < end; ++nb) {
          const long first = begin + (t.block + nb) * gl.positions, last = Kokkos::min(end, first + gl.positions);
          firsts[nb] = first;
          blks[nb].carve_in_team(scratch.data(), nb, static_cast<int>((last - first) * n), D, Dv, packed, split);
        }
        if (nb == 0) return;
        const long m = p(b, read_rows), wb = p(b, window_begin_pos), off = p(b, input_offset);
        const long wb_slot = ring.slot(wb);  // the window's positions [wb, last) fit the ring's slots
        for (int i = 0; i < nb; ++i)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blks[i].read_lanes()), [&](int u) {
            const long hq = t.first_head + u % n;
            const typename QueriesIn::value_type* qu =
                u < blks[i].queries ? &q(b, hq, firsts[i] + u / n - off, 0) : nullptr;
            blks[i].load(u, qu);
            blks[i].scales[u] = qu ? Merge::logit_scale(w.tau_state[hq], qu, D) : 0.0f;
            blks[i].scales[QB + u] = qu ? Merge::logit_scale(w.tau_window[hq], qu, D) : 0.0f;
          });
        team.team_barrier();
        attend_blocks<Traits::spread, NB>(
            team, blks, nb, [&](int i) { return blks[i].scales; }, m, [&](int, int) { return m; },
            [&](long i) { return &rows.read_keys(b, h, i, 0); }, [&](long i) { return &rows.read_values(b, h, i, 0); },
            [&](long i) { return Merge::row_bias(rows.row(b, h, i)); });
        const long last = firsts[nb - 1] + blks[nb - 1].queries / n;  // one past the team's last position
        attend_blocks<Traits::spread, NB>(
            team, blks, nb, [&](int i) { return blks[i].scales + QB; }, last - wb,
            [&](int i, int u) { return firsts[i] + u / n + 1 - wb; },
            [&](long j) { return &ring.keys(b, h, ring.slot_after(wb_slot, j), 0); },
            [&](long j) { return &ring.values(b, h, ring.slot_after(wb_slot, j), 0); }, NoBias{});
        settle_splits(team, blks, nb);
        for (int i = 0; i < nb; ++i) {
          const QueryBlock& blk = blks[i];
          const long first = firsts[i];
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries),
                               [&](int u) { blk.finish(u, &y(b, t.first_head + u % n, first + u / n - off, 0)); });
          if (lse.data() != nullptr || out_lse.data() != nullptr)
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries), [&](int u) {
              const long hq = t.first_head + u % n, pos = first + u / n;
              const float l = blk.max_logit[u] + Kokkos::log(blk.normalizer[u]);
              if (lse.data() != nullptr) lse(b, hq, pos - begin) = l;
              if (out_lse.data() != nullptr) out_lse(b, hq, pos - off) = l;
            });
        }
      });
}

}  // namespace kvmem::kernels
