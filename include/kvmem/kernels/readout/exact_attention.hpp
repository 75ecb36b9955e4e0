#pragma once
/// \file exact_attention.hpp
/// Exact causal attention over the whole KV cache: the baseline every memory is measured against.

#include <Kokkos_Core.hpp>

#include "../../errors.hpp"
#include "flashinfer.hpp"
#include "launch.hpp"
#include "../common/scratch.hpp"

namespace kvmem::kernels {

namespace detail {

/// Split-KV decode of exact attention (flash-decoding): the keys [0, P0] of each (sequence, kv-head) in
/// `splits` splits of readout_split_keys keys, one team per split and query-head group, each writing its
/// partial softmax (un-normalized output [Dv], max logit, normalizer) to `work`'s partials [>= B x Hq,
/// >= splits, >= Dv + 2] (float32; allocated here when they are smaller); then one thread per (sequence,
/// query head, channel) merges the splits in order (merge_softmax) and writes y. A split's softmax starts
/// empty at its first key, as after a prefill's close_split, so the step gives the prompt's bits.
template <class ExecSpace, class In, class Out, class InKV, class Traits>
void exact_decode_splits(const ExecSpace& exec, const In& q, const InKV& k, const InKV& v, const Out& y,
                         const float* tau, long P0, long splits, DecodeSplitWork<typename ExecSpace::memory_space>& work) {
  const long B = static_cast<long>(q.extent(0)), Hq = static_cast<long>(q.extent(1));
  const long Hkv = static_cast<long>(k.extent(1));
  const int D = static_cast<int>(q.extent(3)), Dv = static_cast<int>(v.extent(3));
  const GroupLanes gl(Hq / Hkv, 1, 1);
  const float sqrt_d = Kokkos::sqrt(static_cast<float>(D));
  work.reserve(exec, B * Hq, splits, Dv);
  const auto part = work.partials;
  using policy_t = Kokkos::TeamPolicy<ExecSpace>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  constexpr bool packed = !std::is_same_v<std::remove_cv_t<typename InKV::value_type>, float>;
  const long floats = QueryBlock::scratch_floats(D, Dv, packed);
  int level = 0;
  const policy_t policy =
      with_float_scratch(policy_t(exec, gl.league(B, Hkv) * splits, Kokkos::AUTO), floats, level);
  const long keys = P0 + 1;
  Kokkos::parallel_for(
      "kvmem::exact_decode_split", policy, KOKKOS_LAMBDA(const member_t& team) {
        const long s = team.league_rank() % splits;
        const auto t = gl.team(team.league_rank() / splits, Hkv);
        const long b = t.b, h = t.h, n = t.heads;
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blk;
        blk.carve(scratch.data(), static_cast<int>(n), D, Dv, packed);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.read_lanes()), [&](int u) {
          const long hq = t.first_head + u % n;
          blk.load(u, u < blk.queries ? &q(b, hq, 0, 0) : nullptr);
          blk.scales[u] = (tau ? tau[hq] : 1.0f) / sqrt_d;  // as exact_causal_attention
        });
        team.team_barrier();
        const long first = s * readout_split_keys;
        const long count = keys - first < readout_split_keys ? keys - first : readout_split_keys;
        attend_block<Traits::spread>(
            team, blk, blk.scales, count, [&](int) { return count; }, [&](long j) { return &k(b, h, first + j, 0); },
            [&](long j) { return &v(b, h, first + j, 0); }, NoBias{});
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries),
                             [&](int u) { blk.store_partial(u, &part(b * Hq + t.first_head + u, s, 0)); });
      });
  using out_type = std::remove_cv_t<typename Out::value_type>;
  Kokkos::parallel_for(
      "kvmem::exact_decode_merge", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * Hq * Dv), KOKKOS_LAMBDA(const long e) {
        const long bh = e / Dv;
        const int c = static_cast<int>(e % Dv);
        y(bh / Hq, bh % Hq, 0, c) = from_float<out_type>(merge_partials(part, bh, splits, c, Dv, nullptr));
      });
}

}  // namespace detail

/// y[b, hq, u] = softmax_{p <= P0 + u}(q_u · k_p * scale[hq]) · v_p with scale[hq] = tau[hq] / sqrt(D)
/// (tau = 1 when `tau` is null), query head hq reading kv-head hq / (Hq / Hkv) (GQA): the queries of
/// positions [P0, P0 + Tq) against a KV cache holding positions [0, Tk), Tk >= P0 + Tq, P0 =
/// `first_position` (0: causal attention over a prompt; Tq = 1: a decode step at position P0; cached
/// positions past the last query are masked, so Tk may be a cache's capacity).
/// q [B, Hq, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv], y [B, Hq, Tq, Dv], unit channel stride; `tau`
/// [Hq] device pointer or null. Same query blocks (GroupLanes: a kv-head's query heads share one pass over
/// its keys) and online-softmax tiles as the memories' readout, so a memory whose window holds every token
/// returns the same bits, and a query's output does not depend on P0 or Tq (a decode step gives the
/// prompt's row bit for bit). Keys are read in splits of readout_split_keys positions (attend_blocks); a
/// decode step (Tq = 1) over more than one split may run them in parallel teams (`splits`, DecodeSplits:
/// split-KV decode) with the same bits; its partial softmaxes go to `work` (DecodeSplitWork; grown here when
/// too small: pass the same one every step so that a step allocates nothing). Throws kvmem::invalid_argument for mismatched shapes, first_position < 0 or
/// Tk < P0 + Tq (B, Hq, D, Dv and Tk are element counts, P0 and Tq token positions). `Traits`
/// (TileTraits<ExecSpace>) picks how a team covers a key tile; it changes no bit.
template <class ExecSpace, class In, class Out, class InKV = In, class Traits = TileTraits<ExecSpace>>
void exact_causal_attention(const ExecSpace& exec, const In& q, const InKV& k, const InKV& v, const Out& y,
                            const float* tau = nullptr, long first_position = 0,
                            DecodeSplits splits = DecodeSplits::automatic,
                            DecodeSplitWork<typename ExecSpace::memory_space>&& work = {}) {
  exact_causal_attention<ExecSpace, In, Out, InKV, Traits>(exec, q, k, v, y, tau, first_position, splits, work);
}

/// The buffers of exact attention on tensor cores for keys of storage type InKV::value_type
/// (FlashInferWork; unused where flashinfer_exact_applies is false).
template <class ExecSpace, class InKV>
using ExactTensorCoreWork =
    FlashInferWork<typename ExecSpace::memory_space, std::remove_const_t<typename InKV::value_type>>;

/// exact_causal_attention above with a caller's split-KV workspace `work` (kept between decode steps).
template <class ExecSpace, class In, class Out, class InKV = In, class Traits = TileTraits<ExecSpace>>
void exact_causal_attention(const ExecSpace& exec, const In& q, const InKV& k, const InKV& v, const Out& y,
                            const float* tau, long first_position, DecodeSplits splits,
                            DecodeSplitWork<typename ExecSpace::memory_space>& work) {
  ExactTensorCoreWork<ExecSpace, InKV> tensor_cores;
  exact_causal_attention<ExecSpace, In, Out, InKV, Traits>(exec, q, k, v, y, tau, first_position, splits, work,
                                                           tensor_cores, ReadoutPath::automatic);
}

/// exact_causal_attention above with a caller's workspaces kept between decode steps: `work` for split-KV
/// decode, `tensor_cores` for FlashInfer's tensor cores, which run the attention under `path`
/// (ReadoutPath::automatic) wherever flashinfer_exact_applies (Kokkos::Cuda, 16-bit storage, a build with
/// kvmem::flashinfer; docs/cuda.md "Tensor cores"; numerics: docs/numerics.md "The readout on tensor
/// cores"), and the portable kernels elsewhere or under ReadoutPath::portable.
template <class ExecSpace, class In, class Out, class InKV = In, class Traits = TileTraits<ExecSpace>>
void exact_causal_attention(const ExecSpace& exec, const In& q, const InKV& k, const InKV& v, const Out& y,
                            const float* tau, long first_position, DecodeSplits splits,
                            DecodeSplitWork<typename ExecSpace::memory_space>& work,
                            ExactTensorCoreWork<ExecSpace, InKV>& tensor_cores, ReadoutPath path) {
  const long B = static_cast<long>(q.extent(0)), Hq = static_cast<long>(q.extent(1)), T = static_cast<long>(q.extent(2));
  const long Hkv = static_cast<long>(k.extent(1));
  const int D = static_cast<int>(q.extent(3)), Dv = static_cast<int>(v.extent(3));
  require(Hkv >= 1 && Hq % Hkv == 0, "k.extent(1)", Hkv, "must divide q.extent(1) = " + std::to_string(Hq));
  require(k.extent(0) == q.extent(0) && v.extent(0) == q.extent(0) && y.extent(0) == q.extent(0), "k/v/y.extent(0)",
          k.extent(0), "must equal q.extent(0) = " + std::to_string(B));
  require(first_position >= 0, "first_position", first_position, "must be >= 0");
  require(static_cast<long>(k.extent(2)) >= first_position + T, "k.extent(2)", k.extent(2),
          "must hold first_position + q.extent(2) = " + std::to_string(first_position + T) + " positions");
  require(v.extent(2) == k.extent(2) && y.extent(2) == q.extent(2), "v/y.extent(2)", v.extent(2),
          "v must match k.extent(2) = " + std::to_string(k.extent(2)) + " and y q.extent(2) = " + std::to_string(T));
  require(k.extent(3) == q.extent(3), "k.extent(3)", k.extent(3), "must equal q.extent(3) = " + std::to_string(D));
  require(v.extent(1) == k.extent(1) && y.extent(1) == q.extent(1) && y.extent(3) == v.extent(3), "v/y extents",
          v.extent(1), "v must match k's heads and y must be [B, Hq, T, Dv]");
  if (B == 0 || T == 0) return;
  if (flashinfer_exact_applies<ExecSpace>(path, q, k, v)) {
    flashinfer_exact_attention(exec, q, k, v, y, tau, first_position, tensor_cores);
    return;
  }
  constexpr int NB = Traits::blocks_per_team;
  const GroupLanes gl(Hq / Hkv, T, NB);
  const long key_splits = (first_position + T + readout_split_keys - 1) / readout_split_keys;
  if (T == 1 && splits_decode(exec, splits, key_splits, gl.league(B, Hkv))) {
    detail::exact_decode_splits<ExecSpace, In, Out, InKV, Traits>(exec, q, k, v, y, tau, first_position, key_splits,
                                                                  work);
    return;
  }
  const float sqrt_d = Kokkos::sqrt(static_cast<float>(D));
  // Dynamic schedule: a causal query block's work grows with its position, so equal shares of the league
  // are unequal work (with a static split over 2 threads of one head, one thread did 3/4 of it). Each team
  // writes only its own outputs, so the schedule cannot change a bit.
  using policy_t = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  // Room for a widened key tile where keys are stored in 16 bits (QueryBlock::packs).
  constexpr bool packed = !std::is_same_v<std::remove_cv_t<typename InKV::value_type>, float>;
  const bool split = QueryBlock::needs_split_room(first_position + T);  // a query reads up to P0 + T keys
  const long floats = QueryBlock::team_floats(NB, D, Dv, packed, split);
  policy_t policy(exec, gl.league(B, Hkv), Kokkos::AUTO);
  const int level = scratch_level(policy, scratch_t::shmem_size(floats));
  policy = policy.set_scratch_size(level, Kokkos::PerTeam(scratch_t::shmem_size(floats)));
  const long P0 = first_position;
  Kokkos::parallel_for(
      "kvmem::exact_causal_attention", policy, KOKKOS_LAMBDA(const member_t& team) {
        const auto t = gl.team(team.league_rank(), Hkv);
        const long b = t.b, h = t.h, n = t.heads;
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blks[NB];
        long firsts[NB] = {};
        int nb = 0;  // the team's blocks that hold queries
        for (; nb < NB && (t.block + nb) * gl.positions < T; ++nb) {
          const long first = (t.block + nb) * gl.positions, last = Kokkos::min(T, first + gl.positions);
          firsts[nb] = first;
          blks[nb].carve_in_team(scratch.data(), nb, static_cast<int>((last - first) * n), D, Dv, packed, split);
        }
        if (nb == 0) return;  // none: the league holds no empty team
        for (int i = 0; i < nb; ++i)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blks[i].read_lanes()), [&](int u) {
            const long hq = t.first_head + u % n;
            blks[i].load(u, u < blks[i].queries ? &q(b, hq, firsts[i] + u / n, 0) : nullptr);
            blks[i].scales[u] = (tau ? tau[hq] : 1.0f) / sqrt_d;  // as merge::Defaults::logit_scale
          });
        team.team_barrier();
        const long last_key = P0 + firsts[nb - 1] + blks[nb - 1].queries / n;  // keys of the team's last query
        attend_blocks<Traits::spread, NB>(
            team, blks, nb, [&](int i) { return blks[i].scales; }, last_key,
            [&](int i, int u) { return P0 + firsts[i] + u / n + 1; }, [&](long j) { return &k(b, h, j, 0); },
            [&](long j) { return &v(b, h, j, 0); }, NoBias{});
        settle_splits(team, blks, nb);
        for (int i = 0; i < nb; ++i)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blks[i].queries), [&](int u) {
            blks[i].finish(u, &y(b, t.first_head + u % n, firsts[i] + u / n, 0));
          });
      });
}

}  // namespace kvmem::kernels
