#pragma once
/// \file exact_attention.hpp
/// Exact causal attention over the whole KV cache: the baseline every memory is measured against.

#include <Kokkos_Core.hpp>

#include "../errors.hpp"
#include "readout.hpp"

namespace kvmem::kernels {

/// y[b, hq, u] = softmax_{p <= u}(q_u · k_p * scale[hq]) · v_p with scale[hq] = tau[hq] / sqrt(D)
/// (tau = 1 when `tau` is null), query head hq reading kv-head hq / (Hq / Hkv) (GQA).
/// q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], y [B, Hq, T, Dv], unit channel stride; `tau`
/// [Hq] device pointer or null. Same query blocks and online-softmax tiles as the memories' readout, so a
/// memory whose window holds every token returns the same bits. Throws kvmem::invalid_argument for
/// mismatched shapes.
template <class ExecSpace, class In, class Out>
void exact_causal_attention(const ExecSpace& exec, const In& q, const In& k, const In& v, const Out& y,
                            const float* tau = nullptr) {
  const long B = static_cast<long>(q.extent(0)), Hq = static_cast<long>(q.extent(1)), T = static_cast<long>(q.extent(2));
  const long Hkv = static_cast<long>(k.extent(1));
  const int D = static_cast<int>(q.extent(3)), Dv = static_cast<int>(v.extent(3));
  require(Hkv >= 1 && Hq % Hkv == 0, "k.extent(1)", Hkv, "must divide q.extent(1) = " + std::to_string(Hq));
  require(k.extent(0) == q.extent(0) && v.extent(0) == q.extent(0) && y.extent(0) == q.extent(0), "k/v/y.extent(0)",
          k.extent(0), "must equal q.extent(0) = " + std::to_string(B));
  require(k.extent(2) == q.extent(2) && v.extent(2) == q.extent(2) && y.extent(2) == q.extent(2), "k/v/y.extent(2)",
          k.extent(2), "must equal q.extent(2) = " + std::to_string(T));
  require(k.extent(3) == q.extent(3), "k.extent(3)", k.extent(3), "must equal q.extent(3) = " + std::to_string(D));
  require(v.extent(1) == k.extent(1) && y.extent(1) == q.extent(1) && y.extent(3) == v.extent(3), "v/y extents",
          v.extent(1), "v must match k's heads and y must be [B, Hq, T, Dv]");
  if (B == 0 || T == 0) return;
  constexpr int QB = readout_query_block;
  const long blocks = (T + QB - 1) / QB, G = Hq / Hkv;
  const float sqrt_d = Kokkos::sqrt(static_cast<float>(D));
  // Dynamic schedule: a causal query block's work grows with its position, so equal shares of the league
  // are unequal work (with a static split over 2 threads of one head, one thread did 3/4 of it). Each team
  // writes only its own outputs, so the schedule cannot change a bit.
  using policy_t = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  const long floats = QueryBlock::scratch_floats(D, Dv);
  policy_t policy(exec, B * Hq * blocks, Kokkos::AUTO);
  const int level = scratch_level(policy, scratch_t::shmem_size(floats));
  policy = policy.set_scratch_size(level, Kokkos::PerTeam(scratch_t::shmem_size(floats)));
  Kokkos::parallel_for(
      "kvmem::exact_causal_attention", policy, KOKKOS_LAMBDA(const member_t& team) {
        const long league = team.league_rank();
        const long blk_index = league % blocks, hq = (league / blocks) % Hq, b = league / (blocks * Hq), h = hq / G;
        const long first = blk_index * QB, last = Kokkos::min(T, first + QB);
        scratch_t scratch(team.team_scratch(level), floats);
        QueryBlock blk;
        blk.carve(scratch.data(), static_cast<int>(last - first), D, Dv);
        const float scale = (tau ? tau[hq] : 1.0f) / sqrt_d;  // as merge::Defaults::logit_scale
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, QB), [&](int u) {
          blk.load(u, u < blk.queries ? &q(b, hq, first + u, 0) : nullptr);
          blk.scales[u] = scale;
        });
        team.team_barrier();
        attend_block(
            team, blk, blk.scales, last, [&](int u) { return first + u + 1; }, [&](long p) { return &k(b, h, p, 0); },
            [&](long p) { return &v(b, h, p, 0); }, NoBias{});
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.queries),
                             [&](int u) { blk.finish(u, &y(b, hq, first + u, 0)); });
      });
}

}  // namespace kvmem::kernels
