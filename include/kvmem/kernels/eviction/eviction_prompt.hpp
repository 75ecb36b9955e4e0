#pragma once
/// \file eviction_prompt.hpp
/// A whole prompt into an empty eviction memory that compresses at the end of the prompt
/// (EvictionConfig::chunk = 0; docs/eviction.md "Compression per chunk and at the end of a prompt"): no step
/// of a prompt evicts, so its outputs are exact causal attention (kernels::exact_causal_attention, the tiled
/// readout) and the memory only has to hold the prompt and the statistics its observation window gives.
/// The same meaning as running the prompt through eviction_tokens one token after the other (the tests
/// compare both with the float64 reference), at the cost of exact attention rather than of one decode
/// step per token.

#include <Kokkos_Core.hpp>

#include "../../policy/score/eviction_scorer.hpp"
#include "eviction_params.hpp"
#include "../../math/softmax_exp.hpp"
#include "../plan/step_plan.hpp"
#include "../../math/vector_ops.hpp"

namespace kvmem::kernels {

/// Token j of sequence b's prompt [0, lengths(b)) of an empty memory holds slot j: keys and values [B, Hkv,
/// T, D / Dv] copied into the cache (its storage type), position j, the position order j, live = lengths(b),
/// a merging eviction's count 1, and the scorer's absorb() in token order on one thread per (sequence,
/// kv-head) (a stateful scorer sees the tokens in order). Sequences with lengths(b) = 0 are untouched.
template <class ExecSpace, class Cache, class Scorer, class TokensIn, class Lengths>
void eviction_prompt_append(const ExecSpace& exec, const EvictionParams& p, const Cache& c, const Scorer& scorer,
                            const TokensIn& k, const TokensIn& v, const Lengths& lengths) {
  const long B = static_cast<long>(k.extent(0)), H = static_cast<long>(k.extent(1));
  using policy = Kokkos::TeamPolicy<ExecSpace>;
  Kokkos::parallel_for(
      "kvmem::evict_prompt_append", policy(exec, static_cast<int>(B * H), Kokkos::AUTO),
      KOKKOS_LAMBDA(const typename policy::member_type& team) {
        const long b = team.league_rank() / H, n = lengths(b);
        const int h = static_cast<int>(team.league_rank() % H);
        if (n == 0) return;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](long j) {
          for (int i = 0; i < p.head_dim; ++i) c.keys(b, h, j, i) = k(b, h, j, i);
          for (int i = 0; i < p.value_dim; ++i) c.values(b, h, j, i) = v(b, h, j, i);
          c.positions(b, h, j) = j;
          c.order(b, h, j) = static_cast<int>(j);
          if (p.merge) c.counts(b, h, j) = 1.0f;
        });
        team.team_barrier();
        Kokkos::single(Kokkos::PerTeam(team), [&] {
          for (long j = 0; j < n; ++j) c.stats(b, h, j) = scorer.absorb(b, h, j, &c.keys(b, h, j, 0), &c.values(b, h, j, 0));
          c.live(b, h) = n;
        });
      });
}

/// lse(b, hq, j - first(b)) = log sum_{t <= j} exp(q_j . k_t / sqrt(D)) of the prompt's queries j in
/// [first(b), lengths(b)) (causal over the prompt's own keys; float32 as the readout: max + log(sum of
/// exp(logit - max)) in token order): the log-sum-exp eviction_attend would give the query. lse [B, Hq,
/// >= lengths(b) - first(b)]; entries of other queries untouched.
template <class ExecSpace, class TokensIn, class Lengths, class First, class Lse>
void prompt_lse(const ExecSpace& exec, const EvictionParams& p, const TokensIn& q, const TokensIn& k,
                const Lengths& lengths, const First& first, const Lse& lse) {
  const long B = static_cast<long>(q.extent(0)), Hq = static_cast<long>(q.extent(1));
  const long W = static_cast<long>(lse.extent(2));
  Kokkos::parallel_for(
      "kvmem::evict_prompt_lse", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * Hq * W), KOKKOS_LAMBDA(long idx) {
        const long jj = idx % W, hq = (idx / W) % Hq, b = idx / (W * Hq);
        const long j = first(b) + jj;
        if (j >= lengths(b)) return;
        const auto* qv = &q(b, hq, j, 0);
        const long h = hq / p.group;
        float mx = neg_inf();
        for (long t = 0; t <= j; ++t) {
          const float l = dot(qv, &k(b, h, t, 0), p.head_dim) * p.scale;
          mx = l > mx ? l : mx;
        }
        float sum = 0.0f;
        for (long t = 0; t <= j; ++t) sum += softmax_exp(dot(qv, &k(b, h, t, 0), p.head_dim) * p.scale - mx);
        lse(b, hq, jj) = mx + Kokkos::log(sum);
      });
}

/// The statistics the prompt's observation window gives its tokens: for the queries j in [first(b),
/// lengths(b)) in order (the last observation_window of the prompt; their log-sum-exp `lse` [B, Hq, W] from
/// prompt_lse), every token t <= j takes stat = scorer.attended(stat, sum over the G query heads of
/// exp(q_j . k_t / sqrt(D) - lse), G), restarted from 0 at the first query for a windowed scorer (SnapKV),
/// as eviction_attend does at each observing step. One thread per token; the queries in order.
template <class ExecSpace, class Cache, class Scorer, class TokensIn, class Lengths, class First, class Lse>
void prompt_observation(const ExecSpace& exec, const EvictionParams& p, const Cache& c, const Scorer& scorer,
                        const TokensIn& q, const Lengths& lengths, const First& first, const Lse& lse) {
  const long B = static_cast<long>(c.live.extent(0)), H = static_cast<long>(c.live.extent(1));
  const long T = static_cast<long>(q.extent(2));
  Kokkos::parallel_for(
      "kvmem::evict_prompt_observation", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * H * T), KOKKOS_LAMBDA(long idx) {
        const long t = idx % T, h = (idx / T) % H, b = idx / (T * H);
        const long n = lengths(b);
        if (t >= n) return;
        double stat = c.stats(b, h, t);
        for (long j = first(b) > t ? first(b) : t; j < n; ++j) {
          float prob = 0.0f;
          for (int g = 0; g < p.group; ++g) {
            const long hq = h * p.group + g;
            prob += softmax_exp(dot(&q(b, hq, j, 0), &c.keys(b, h, t, 0), p.head_dim) * p.scale - lse(b, hq, j - first(b)));
          }
          const bool restart = score::windowed_statistic<Scorer> && j == first(b);
          stat = scorer.attended(restart ? 0.0 : stat, static_cast<double>(prob), p.group);
        }
        c.stats(b, h, t) = stat;
      });
}

}  // namespace kvmem::kernels
