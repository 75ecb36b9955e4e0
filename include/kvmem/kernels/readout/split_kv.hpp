#pragma once
/// \file split_kv.hpp
/// Split-KV decode (flash-decoding) of the readout: whether a decode step runs its key splits in parallel
/// teams (DecodeSplits, splits_decode), the splits of a key list (KeySplit), their partials
/// (DecodeSplitWork) and the launch that computes and merges them (detail::readout_split_kv).

#include <Kokkos_Core.hpp>
#include <type_traits>

#include "../../config.hpp"
#include "../../dtype.hpp"
#include "../../policy/layer_weights.hpp"
#include "../../state/state_rows.hpp"
#include "../common/scratch.hpp"
#include "../common/tile_traits.hpp"
#include "../plan/step_launch.hpp"
#include "../plan/step_plan.hpp"
#include "attend_blocks.hpp"
#include "group_lanes.hpp"
#include "online_softmax.hpp"

namespace kvmem::kernels {

/// How a decode step (one query position) whose keys span more than one split of readout_split_keys keys
/// is scheduled: `automatic` runs its splits in parallel teams (split-KV decode, flash-decoding) where the
/// step has fewer (sequence, kv-head) teams than the backend has threads (a GPU: always; 2 CPU threads:
/// B x Hkv = 1), `always` and `never` force either schedule. The splits sit at the fixed positions that a
/// prefill takes too, so every choice gives the same bits (tests/unit/test_exact_attention.cpp,
/// test_decode_splits.cpp).
enum class DecodeSplits { automatic, always, never };

/// Whether a decode step of `teams` (sequence, kv-head, head group) teams over at most `splits` key splits
/// runs them in parallel teams, as `mode` says (DecodeSplits).
template <class ExecSpace>
[[nodiscard]] bool splits_decode(const ExecSpace& exec, DecodeSplits mode, long splits, long teams) {
  if (splits <= 1 || mode == DecodeSplits::never) return false;
  return mode == DecodeSplits::always || teams < static_cast<long>(exec.concurrency());
}

/// The workspace of a split-KV decode step's readout (DecodeSplits): at most `splits` key splits per
/// (sequence, kv-head) (readout_max_splits), and `partials` [B x Hq, >= splits, Dv + 2] float32, each split's
/// un-normalized output [Dv], max logit and normalizer. splits = 1 (the default): the readout runs unsplit.
template <class MemorySpace>
struct DecodeSplitWork {
  long splits = 1;
  Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> partials;

  /// Whether the partials hold `rows` (B x Hq) x `max_splits` splits of value_dim `dv`.
  [[nodiscard]] bool holds(long rows, long max_splits, int dv) const {
    return static_cast<long>(partials.extent(0)) >= rows && static_cast<long>(partials.extent(1)) >= max_splits &&
           static_cast<long>(partials.extent(2)) >= dv + 2L;
  }
  /// Grows the partials (one allocation on `exec`, contents undefined) unless they hold() already.
  template <class ExecSpace>
  void reserve(const ExecSpace& exec, long rows, long max_splits, int dv) {
    if (holds(rows, max_splits, dv)) return;
    partials = decltype(partials)(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "kvmem::decode_split_partials"),
                                  rows, max_splits, dv + 2L);
  }
};

/// One split of a (sequence, kv-head)'s key list of m state rows and nw window tokens, as attend_blocks
/// splits it: the state at every readout_split_keys rows, the window at every readout_split_keys tokens, the
/// window's first split joined to the state's last (split J = max(ceil(m / S), 1) - 1). Split s reads state
/// rows [row_begin, row_end) then window offsets [window_begin, window_end) (offsets from the window's first
/// position; a split of the window alone has row_begin = row_end = m).
struct KeySplit {
  long row_begin = 0, row_end = 0, window_begin = 0, window_end = 0;

  /// Splits of the key list: J + 1 + max(ceil(nw / S) - 1, 0).
  KOKKOS_INLINE_FUNCTION static long count(long m, long nw) {
    constexpr long S = readout_split_keys;
    const long a = (m + S - 1) / S, c = (nw + S - 1) / S;
    return (a > 1 ? a : 1) + (c > 1 ? c - 1 : 0);
  }
  /// Split s in [0, count(m, nw)).
  KOKKOS_INLINE_FUNCTION static KeySplit of(long s, long m, long nw) {
    constexpr long S = readout_split_keys;
    const long a = (m + S - 1) / S, joined = a > 0 ? a - 1 : 0;
    KeySplit k;
    if (s < joined) {
      k.row_begin = s * S, k.row_end = (s + 1) * S;
    } else if (s == joined) {
      k.row_begin = joined * S, k.row_end = m, k.window_end = nw < S ? nw : S;
    } else {
      const long w = s - joined;
      k.row_begin = k.row_end = m;
      k.window_begin = w * S, k.window_end = nw < (w + 1) * S ? nw : (w + 1) * S;
    }
    return k;
  }
};

/// The most key splits of a decode step's readout over state rows that fit `row_capacity` rows and a
/// window that fits `window_slots` tokens (KeySplit::count at both).
[[nodiscard]] inline long readout_max_splits(long row_capacity, long window_slots) {
  return KeySplit::count(row_capacity, window_slots);
}

namespace detail {

/// The split-KV form of a decode step's readout (readout() with a DecodeSplitWork of splits > 1): one team
/// per (sequence, kv-head, head group, split) folds its split's keys (KeySplit) into an empty softmax and
/// writes its partial to work.partials; splits past a sequence's KeySplit::count do nothing. Then one thread
/// per (sequence, query head, channel) merges the sequence's splits in order (merge_softmax), writes y and,
/// where asked, the log-sum-exp (lse, out_lse as readout()). A split's softmax starts empty at its first key,
/// as after a prefill's close_split, so the step gives the bits of the unsplit readout.
template <class Merge, class ExecSpace, StorageType T, class QueriesIn, class Out, class Lse, class Traits, class OutLse>
void readout_split_kv(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                      const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                      const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                      const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q, const Out& y,
                      const DecodeSplitWork<typename ExecSpace::memory_space>& work, const Lse& lse,
                      const OutLse& out_lse) {
  const long B = static_cast<long>(plan.device.extent(0));
  const long Hq = cfg.query_heads, Hkv = cfg.kv_heads;
  const int D = cfg.head_dim, Dv = cfg.value_dim;
  constexpr int QB = readout_query_block;
  const GroupLanes gl(cfg.group(), 1, 1);
  const long splits = work.splits;
  const auto part = work.partials;
  const auto p = plan.device;
  using policy_t = Kokkos::TeamPolicy<ExecSpace, step_launch>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  constexpr bool packed = !std::is_same_v<T, float>;
  const long floats = QueryBlock::scratch_floats(D, Dv, packed);
  policy_t policy(exec, gl.league(B, Hkv) * splits, Kokkos::AUTO);
  const int level = scratch_level(policy, scratch_t::shmem_size(floats));
  policy = policy.set_scratch_size(level, Kokkos::PerTeam(scratch_t::shmem_size(floats)));
  Kokkos::parallel_for(
      "kvmem::readout_split", policy, KOKKOS_LAMBDA(const member_t& team) {
        const long s = team.league_rank() % splits;
        const auto t = gl.team(team.league_rank() / splits, Hkv);
        const long b = t.b, h = t.h, n = t.heads;
        const long pos = p(b, query_begin);
        if (p(b, query_end) <= pos) return;  // an inactive sequence
        const long m = p(b, read_rows), wb = p(b, window_begin_pos), off = p(b, input_offset);
        const long nw = pos + 1 - wb;
        if (s >= KeySplit::count(m, nw)) return;
        const KeySplit ks = KeySplit::of(s, m, nw);
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blk;
        blk.carve(scratch.data(), static_cast<int>(n), D, Dv, packed);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.read_lanes()), [&](int u) {
          const long hq = t.first_head + u % n;
          const typename QueriesIn::value_type* qu = u < blk.queries ? &q(b, hq, pos - off, 0) : nullptr;
          blk.load(u, qu);
          blk.scales[u] = qu ? Merge::logit_scale(w.tau_state[hq], qu, D) : 0.0f;
          blk.scales[QB + u] = qu ? Merge::logit_scale(w.tau_window[hq], qu, D) : 0.0f;
        });
        team.team_barrier();
        const long r0 = ks.row_begin, rows_read = ks.row_end - ks.row_begin;
        attend_block<Traits::spread>(
            team, blk, blk.scales, rows_read, [&](int) { return rows_read; },
            [&](long i) { return &rows.read_keys(b, h, r0 + i, 0); },
            [&](long i) { return &rows.read_values(b, h, r0 + i, 0); },
            [&](long i) { return Merge::row_bias(rows.row(b, h, r0 + i)); });
        const long first_slot = ring.slot_after(ring.slot(wb), ks.window_begin);
        const long window_read = ks.window_end - ks.window_begin;
        attend_block<Traits::spread>(
            team, blk, blk.scales + QB, window_read, [&](int) { return window_read; },
            [&](long j) { return &ring.keys(b, h, ring.slot_after(first_slot, j), 0); },
            [&](long j) { return &ring.values(b, h, ring.slot_after(first_slot, j), 0); }, NoBias{});
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries),
                             [&](int u) { blk.store_partial(u, &part(b * Hq + t.first_head + u, s, 0)); });
      });
  using out_type = std::remove_cv_t<typename Out::value_type>;
  Kokkos::parallel_for(
      "kvmem::readout_split_merge", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * Hq * Dv), KOKKOS_LAMBDA(const long e) {
        const long bh = e / Dv, b = bh / Hq, hq = bh % Hq;
        const int c = static_cast<int>(e % Dv);
        const long pos = p(b, query_begin), u = pos - p(b, input_offset);
        if (p(b, query_end) <= pos) return;
        const long count = KeySplit::count(p(b, read_rows), pos + 1 - p(b, window_begin_pos));
        float lse_u = 0.0f;
        y(b, hq, u, c) = from_float<out_type>(merge_partials(part, bh, count, c, Dv, c == 0 ? &lse_u : nullptr));
        if (c == 0 && lse.data() != nullptr) lse(b, hq, 0) = lse_u;
        if (c == 0 && out_lse.data() != nullptr) out_lse(b, hq, u) = lse_u;
      });
}

}  // namespace detail

}  // namespace kvmem::kernels
