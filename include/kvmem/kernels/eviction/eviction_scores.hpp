#pragma once
/// \file eviction_scores.hpp
/// Every token's static eviction score at once, for training masks (spec EVICTION.md §2, §5).

#include <Kokkos_Core.hpp>

#include "eviction_step.hpp"

namespace kvmem::kernels {

/// scores [B, Hkv, T] (float64) = the static key kappa_t = score_t - t log gamma_h of every token t <
/// lengths[b] (spec §4, n = 1), where score_t is what a static scorer gives the token: at insertion, or
/// for a delayed scorer from its state after token t + w - 1 (§2; tokens with t + w - 1 >= lengths[b] are
/// never eligible and get -infinity). The scorer's state must be fresh (bound, reset); it is advanced
/// through every token. k [B, Hkv, T, D], v [B, Hkv, T, Dv]. One thread per (sequence, kv-head).
template <class Scorer, class ExecSpace, class TokensIn, class Lengths, class Scores>
void static_scores(const ExecSpace& exec, const EvictionParams& p, const Scorer& scorer, const TokensIn& k,
                   const TokensIn& v, const Lengths& lengths, const Scores& scores) {
  static_assert(!Scorer::needs_probabilities, "static_scores: the scorer's scores depend on attention (H2O, TOVA)");
  const long B = static_cast<long>(k.extent(0)), H = static_cast<long>(k.extent(1)), T = static_cast<long>(k.extent(2));
  Kokkos::parallel_for(
      "kvmem::evict_scores", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * H), KOKKOS_LAMBDA(long idx) {
        const long b = idx / H;
        const int h = static_cast<int>(idx % H);
        const long L = lengths(b), window = p.window;  // (p is captured here, outside the constexpr-if: nvcc)
        for (long t = 0; t < T; ++t) scores(b, h, t) = -Kokkos::Experimental::infinity_v<double>;
        for (long t = 0; t < L; ++t) {
          const double stat = scorer.absorb(b, h, t, &k(b, h, t, 0), &v(b, h, t, 0));
          if constexpr (!Scorer::delayed) {
            scores(b, h, t) = effective_score(scorer, p, stat, t, t, h);
          } else {
            const long u = t - window + 1;
            if (u >= 0)
              scores(b, h, u) = effective_score(scorer, p, scorer.delayed_score(b, h, u, &k(b, h, u, 0), &v(b, h, u, 0)), u, u, h);
          }
        }
      });
}

}  // namespace kvmem::kernels
