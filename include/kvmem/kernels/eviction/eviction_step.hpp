#pragma once
/// \file eviction_step.hpp
/// One decode step of the fixed-budget eviction policy for one (sequence, kv-head): append, delayed
/// scoring, eviction of the worst eligible row, one softmax over the cached rows for the G query heads,
/// attention statistics (spec EVICTION.md §1 steps 1-5, §2, §4). Prefill and decode both run tokens
/// through eviction_tokens(), one step after the other, so they compute the same bits.

#include <Kokkos_Core.hpp>
#include <concepts>
#include <type_traits>

#include "../../eviction_config.hpp"
#include "../../policy/score/eviction_scorer.hpp"
#include "../../state/eviction_cache.hpp"
#include "eviction_merge.hpp"
#include "eviction_params.hpp"
#include "../readout/launch.hpp"
#include "../../math/simd.hpp"
#include "../plan/step_launch.hpp"
#include "../common/team_select.hpp"
#include "../../math/vector_ops.hpp"

namespace kvmem::kernels {

/// Effective score of token t at step q on kv-head h (spec EVICTION.md §4), float64: with n = 1 the static
/// key base - t log gamma (the q log gamma shared by all tokens dropped), else base + floor((q - t) / n) log gamma.
template <class Scorer>
KOKKOS_INLINE_FUNCTION double effective_score(const Scorer& scorer, const EvictionParams& p, double stat, long t,
                                              long q, int h) {
  const double base = scorer.base_score(stat, t, q, p.group);
  const double log_gamma = scorer.log_decay(h);
  if (log_gamma == 0.0) return base;
  if (p.decay_interval == 1) return base - static_cast<double>(t) * log_gamma;
  return base + static_cast<double>((q - t) / p.decay_interval) * log_gamma;
}

// Every function below runs on one team per (sequence, kv-head), or per sequence for a layer-wide scorer:
// the work over rows and channels is spread over the team's threads, the sums that order matters for
// (softmax normalizers) are taken by one thread in row order, and each output channel sums its rows in
// row order on one thread. So every team size -- one thread on a CPU core, a warp's worth on a GPU --
// gives the bits of the serial definition.

/// A scorer whose absorb and delayed_score also come in a form that takes the team (every thread of it
/// calls them; the same bits as the one-thread form, ends with a team barrier).
template <class Scorer, class Team, class T>
concept TeamScorer = requires(const Scorer& s, const Team& team, long b, int h, long t, const T* x) {
  { s.absorb(team, b, h, t, x, x) } -> std::same_as<double>;
  { s.delayed_score(team, b, h, t, x, x) } -> std::same_as<double>;
};

/// Steps 1-2 of step q on (b, h): token q (key [D], value [Dv]) enters the first free slot at the end of the
/// position order (one exists: at most B rows are cached before a step, B + 1 slots), the scorer absorbs it,
/// and a delayed scorer scores u = q - w + 1, the oldest token of the window (the live - w-th entry; spec §2).
/// key and value are of the cache's storage type.
template <class Team, class Scorer, class Cache, class T>
KOKKOS_INLINE_FUNCTION void eviction_append(const Team& team, const EvictionParams& p, const Cache& c,
                                            const Scorer& scorer, long b, int h, long q, const T* key,
                                            const T* value) {
  const long slots = static_cast<long>(c.positions.extent(2));
  long slot = slots;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(team, slots),
      [&](long s, long& first) {
        if (c.positions(b, h, s) < 0 && s < first) first = s;
      },
      Kokkos::Min<long>(slot));
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p.head_dim), [&](int i) { c.keys(b, h, slot, i) = key[i]; });
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p.value_dim), [&](int i) { c.values(b, h, slot, i) = value[i]; });
  team.team_barrier();
  const long u = q - p.window + 1;  // the token a delayed scorer scores now, if u >= sinks
  const bool scores = Scorer::delayed && u >= p.sinks && u >= 0;
  if constexpr (TeamScorer<Scorer, Team, T>) {
    const long live = c.live(b, h);  // every thread, before the single below changes it (absorb's barriers)
    // A scorer with team forms (KVPOP's mLSTM) spreads its update and its score over the team's threads.
    const double stat = scorer.absorb(team, b, h, q, &c.keys(b, h, slot, 0), &c.values(b, h, slot, 0));
    Kokkos::single(Kokkos::PerTeam(team), [&] {
      c.positions(b, h, slot) = q;
      c.order(b, h, live) = static_cast<int>(slot);
      c.live(b, h) = live + 1;
      c.stats(b, h, slot) = stat;
      if (p.merge) c.counts(b, h, slot) = 1.0f;
    });
    team.team_barrier();
    if (scores) {
      const int su = c.order(b, h, live + 1 - p.window);
      const double score = scorer.delayed_score(team, b, h, u, &c.keys(b, h, su, 0), &c.values(b, h, su, 0));
      Kokkos::single(Kokkos::PerTeam(team), [&] { c.stats(b, h, su) = score; });
    }
  } else {
    Kokkos::single(Kokkos::PerTeam(team), [&] {
      const long live = c.live(b, h);
      c.positions(b, h, slot) = q;
      c.order(b, h, live) = static_cast<int>(slot);
      c.live(b, h) = live + 1;
      if (p.merge) c.counts(b, h, slot) = 1.0f;
      c.stats(b, h, slot) = scorer.absorb(b, h, q, &c.keys(b, h, slot, 0), &c.values(b, h, slot, 0));
      if (scores) {
        const int su = c.order(b, h, live + 1 - p.window);
        c.stats(b, h, su) = scorer.delayed_score(b, h, u, &c.keys(b, h, su, 0), &c.values(b, h, su, 0));
      }
    });
  }
  team.team_barrier();
}

/// The retained set R = {s <= t <= q - w} of step q as entries [begin, end) of the position order: after
/// the min(s, q + 1) sinks and before the min(w, q + 1 - s) window tokens that are not sinks.
struct RetainedRange {
  long begin, end;
  KOKKOS_INLINE_FUNCTION RetainedRange(const EvictionParams& p, long live, long q) {
    begin = q + 1 < p.sinks ? q + 1 : p.sinks;
    const long window_only = q + 1 - p.sinks < p.window ? q + 1 - p.sinks : p.window;
    end = live - (window_only > 0 ? window_only : 0);
  }
};

/// The entry of [r.begin, r.end) to evict at step q: the lowest sum over kv-heads [h0, h1) of effective
/// scores (one head, or every head of the layer for a layer-wide scorer; they hold the same positions);
/// on a tie the older token (the first entry) loses (spec §4: newer wins). As the serial scan that keeps the
/// first strictly lower score: a NaN score at r.begin keeps r.begin, NaN elsewhere never wins. One exact
/// team reduction (team_lowest: Kokkos::MinFirstLoc, CUB's warp reduction on Cuda): the same entry for
/// every team size and backend. Ends with a team barrier.
template <class Team, class Scorer, class Cache>
KOKKOS_INLINE_FUNCTION long eviction_worst(const Team& team, const EvictionParams& p, const Cache& c,
                                           const Scorer& scorer, long b, int h0, int h1, long q,
                                           const RetainedRange& r, TeamSelectScratch select) {
  auto score = [&](long i) {
    double e = 0.0;
    for (int h = h0; h < h1; ++h) {
      const int si = c.order(b, h, i);
      e += effective_score(scorer, p, c.stats(b, h, si), c.positions(b, h, si), q, h);
    }
    return e;
  };
  return team_lowest(team, r.begin, r.end, score, [](long) { return false; }, select);
}

/// Frees the slot of order entry `index` of (b, h) and closes the gap in the position order: entries
/// (index, live) move down by one. A team of one thread (a CPU core) moves them in one pass; a larger team
/// (a GPU's) copies them into `c.shift` and back, each pass spread over its threads, so no thread walks
/// the budget's entries alone. The same entries either way. Ends with a team barrier.
template <class Team, class Cache>
KOKKOS_INLINE_FUNCTION void eviction_remove(const Team& team, const Cache& c, long b, int h, long index) {
  const long live = c.live(b, h);
  const int slot = c.order(b, h, index);
  if (team.team_size() == 1) {
    for (long i = index; i + 1 < live; ++i) c.order(b, h, i) = c.order(b, h, i + 1);
  } else {
    team.team_barrier();  // every thread has read live and the slot before any entry moves
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, index, live - 1),
                         [&](long i) { c.shift(b, h, i) = c.order(b, h, i + 1); });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, index, live - 1),
                         [&](long i) { c.order(b, h, i) = c.shift(b, h, i); });
  }
  Kokkos::single(Kokkos::PerTeam(team), [&] {
    c.positions(b, h, slot) = -1;
    c.live(b, h) = live - 1;
  });
  team.team_barrier();
}

/// sum() run by one thread of the team, its result given to every thread.
template <class Value, class Team, class Sum>
KOKKOS_INLINE_FUNCTION Value team_single_sum(const Team& team, const Sum& sum) {
  Value total = 0;
  Kokkos::single(Kokkos::PerTeam(team), [&](Value& s) { s = sum(); }, total);
  return total;
}

/// x(0) + x(1) + ... + x(n - 1) added in that order by one thread of the team, the sum given to every thread
/// (a softmax normalizer: its bits must not depend on the team size). The terms are read eight ahead of
/// their adds, so a GPU thread waits on eight loads at once rather than on each in turn.
template <class Value, class Team, class Term>
KOKKOS_INLINE_FUNCTION Value ordered_sum(const Team& team, long n, const Term& x) {
  return team_single_sum<Value>(team, [&]() {
    constexpr int A = 8;
    Value sum = 0;
    long i = 0;
    for (; i + A <= n; i += A) {
      Value t[A];
      for (int k = 0; k < A; ++k) t[k] = x(i + k);
      for (int k = 0; k < A; ++k) sum += t[k];
    }
    for (; i < n; ++i) sum += x(i);
    return sum;
  });
}

/// l[k] = dot(q, rows[k], dim) for k < n <= RW, each in kernels::dot's order: through simd::row_dots (RW
/// rows' chains in vector lanes) for a full group of RW = simd::width rows, one row at a time otherwise
/// (dot_ahead: its loads four channels ahead).
template <int RW, class Q, class Row>
KOKKOS_INLINE_FUNCTION void row_group_dots(const Q* q, int dim, const Row* const* rows, int n, float* l) {
  if constexpr (RW > 1) {
    static_assert(RW == simd::width, "row_dots takes a register's width of rows");
    if (n == RW) {
      simd::row_dots(q, 1, dim, rows, l);
      return;
    }
  }
  for (int k = 0; k < n; ++k) l[k] = dot_ahead(q, 1, rows[k], dim);
}

/// Steps 4-5 on (b, h): out(g) [Dv] = softmax over the cached rows, in position order, of query(g) [D] .
/// k / sqrt(D) (+ log(count) of the row for a merging eviction, p.merge), times the values, for the group's query heads g < G (one softmax; float32, mul_add and
/// softmax_exp as the other readouts); then, for scorers that need them, each row's probability summed over
/// the group goes to Scorer::attended. Logits and exponentials are computed per row across the team, the
/// normalizer by one thread in row order, each output channel by one thread in row order (a thread owns a
/// contiguous range of channels, summed in float32 registers and stored once, rounded to out's storage
/// type). A row's probability is the readout's own float32 weight e_i * (1 / sum), summed over the query
/// heads in head order in float32 (docs/numerics.md: the scorer's running statistic, which takes one such
/// probability per step for as long as the token lives, stays float64). Where a thread has vector
/// registers (simd::vector_registers: CPUs), a thread takes a group of rows at once, each row's dot
/// product still its own chain in channel order (simd::row_dots), so the bits are those of one row at a
/// time; elsewhere (GPUs) a thread takes one row. When lse_of(g) is not null, it receives the softmax's
/// log-sum-exp max + log(normalizer) of query head g. The statistics change only when `role.observe` (an
/// observation query); a windowed scorer's (score::windowed_statistic) restart from 0 when `role.fresh`.
template <class Team, class Scorer, class Cache, class QueryOf, class OutOf, class LseOf>
KOKKOS_INLINE_FUNCTION void eviction_attend(const Team& team, const EvictionParams& p, const Cache& c,
                                            const Scorer& scorer, long b, int h, const QueryOf& query_of,
                                            const OutOf& out_of, const LseOf& lse_of, const StepRole& role = {}) {
  const int D = p.head_dim, Dv = p.value_dim;
  const long live = c.live(b, h);
  for (int g = 0; g < p.group; ++g) {
    const auto* qv = query_of(g);
    auto* y = out_of(g);
    using out_t = std::remove_cv_t<std::remove_pointer_t<decltype(y)>>;
    using key_t = std::remove_cv_t<std::remove_reference_t<decltype(c.keys(b, h, 0, 0))>>;
    auto key_row = [&](long i) -> const key_t* { return &c.keys(b, h, c.order(b, h, i), 0); };
    float max_logit = neg_inf();
    constexpr int RW = simd::vector_registers ? simd::width : 1;  // rows per thread step (row_dots)
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, (live + RW - 1) / RW),
        [&](long r, float& m) {
          const long i0 = r * RW;
          const int n = live - i0 < RW ? static_cast<int>(live - i0) : RW;
          const key_t* rows[RW];
          for (int k = 0; k < RW; ++k) rows[k] = key_row(i0 + (k < n ? k : 0));
          float l[RW];
          row_group_dots<RW>(qv, D, rows, n, l);
          for (int k = 0; k < n; ++k) {
            // A merging eviction's row weighs as many tokens as it holds: + log(count), 0 for one token.
            const float lk = p.merge ? mul_add(l[k], p.scale, Kokkos::log(c.counts(b, h, c.order(b, h, i0 + k))))
                                     : l[k] * p.scale;
            c.logits(b, h, i0 + k) = lk;
            m = lk > m ? lk : m;
          }
        },
        Kokkos::Max<float>(max_logit));
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, live),
                         [&](long i) { c.logits(b, h, i) = softmax_exp(c.logits(b, h, i) - max_logit); });
    team.team_barrier();
    const float normalizer = ordered_sum<float>(team, live, [&](long i) { return c.logits(b, h, i); });
    const float inv = 1.0f / normalizer;
    if (float* lse = lse_of(g)) Kokkos::single(Kokkos::PerTeam(team), [&] { *lse = max_logit + Kokkos::log(normalizer); });
    // The probabilities the scorer reads (spec §6 "needs P"), summed over the group in head order: only for
    // scorers that ask. Each thread writes its own rows; the barrier at the end of the head orders the heads.
    if constexpr (Scorer::needs_probabilities)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, live), [&](long i) {
        const float pi = c.logits(b, h, i) * inv;
        c.probabilities(b, h, i) = g == 0 ? pi : c.probabilities(b, h, i) + pi;
      });
    // Each thread owns a contiguous range of output channels and sums the rows in row order into it: on a
    // CPU core (one thread per team takes every channel) a block of register vectors at a time
    // (simd::add_weighted_rows), and a GPU team spreads the channels over its threads.
    const int per_thread = (Dv + team.team_size() - 1) / team.team_size();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, team.team_size()), [&](int t) {
      const int ch0 = t * per_thread, ch1 = ch0 + per_thread < Dv ? ch0 + per_thread : Dv;
      // Output channels held in registers across the rows: eight vectors' worth on a CPU (eight independent
      // chains keep the multiply-adds in flight), 32 per thread elsewhere.
      constexpr int CW = simd::vector_registers ? 8 * simd::width : 32;
      for (int cb = ch0; cb < ch1; cb += CW) {
        const int n = ch1 - cb < CW ? ch1 - cb : CW;
        if constexpr (simd::vector_registers) {
          if (n == CW) {  // a whole block of register vectors (simd::add_weighted_rows: the same chains)
            simd::vec r[CW / simd::width];
            for (auto& x : r) x = simd::broadcast(0.0f);
            simd::add_weighted_rows(
                r, live, [&](long i) { return c.logits(b, h, i); },
                [&](long i) { return &c.values(b, h, c.order(b, h, i), cb); });
            for (int x = 0; x < CW / simd::width; ++x) {
              float sums[simd::width];
              simd::store(sums, r[x]);
              for (int l = 0; l < simd::width; ++l) y[cb + x * simd::width + l] = from_float<out_t>(sums[l] * inv);
            }
            continue;
          }
        }
        float acc[CW];
        for (int ch = 0; ch < CW; ++ch) acc[ch] = 0.0f;
        // Rows in row order per channel. Without vector registers (a GPU thread, one or a few channels),
        // four rows' weights, slots and values are read before their multiply-adds, so the thread waits on
        // four loads at once; on a CPU core the channels of a row stay one vectorized loop. The same bits.
        constexpr int A = simd::vector_registers ? 1 : 4;
        long i = 0;
        for (; A > 1 && i + A <= live; i += A) {
          float e[A];
          const std::remove_reference_t<decltype(c.values(b, h, 0, 0))>* v[A];
          for (int k = 0; k < A; ++k) e[k] = c.logits(b, h, i + k), v[k] = &c.values(b, h, c.order(b, h, i + k), cb);
          for (int ch = 0; ch < n; ++ch) {
            float x[A];
            for (int k = 0; k < A; ++k) x[k] = to_float(v[k][ch]);
            for (int k = 0; k < A; ++k) acc[ch] = mul_add(e[k], x[k], acc[ch]);
          }
        }
        for (; i < live; ++i) {
          const float e = c.logits(b, h, i);
          const auto* v = &c.values(b, h, c.order(b, h, i), cb);
          for (int ch = 0; ch < n; ++ch) acc[ch] = mul_add(e, to_float(v[ch]), acc[ch]);
        }
        for (int ch = 0; ch < n; ++ch) y[cb + ch] = from_float<out_t>(acc[ch] * inv);
      }
    });
    team.team_barrier();  // the next query head reuses the logits
  }
  // 5. attention statistics (H2O, TOVA, SnapKV) from this step's probabilities, summed over the group.
  if constexpr (Scorer::needs_probabilities) {
    if (role.observe) {
      const bool restart = score::windowed_statistic<Scorer> && role.fresh;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, live), [&](long i) {
        const int si = c.order(b, h, i);
        c.stats(b, h, si) = scorer.attended(restart ? 0.0 : c.stats(b, h, si), c.probabilities(b, h, i), p.group);
      });
    }
    team.team_barrier();
  }
}

/// A compression's pooling (score::pool_width<Scorer> = P > 1, SnapKV's avgpool): the statistic of every
/// entry of the retained range r of (b, h) becomes the sum, over the retained tokens at positions t - P/2 ..
/// t + P/2 (in position order), of their statistics, divided by P (absent neighbours count as 0, as
/// SnapKV's zero pads). Reads every statistic before it writes one (through c.pooled). Ends with a barrier.
template <int P, class Team, class Cache>
KOKKOS_INLINE_FUNCTION void pool_retained(const Team& team, const Cache& c, long b, int h, const RetainedRange& r) {
  constexpr long half = P / 2;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, r.begin, r.end), [&](long i) {
    const long t = c.positions(b, h, c.order(b, h, i));
    const long j0 = i - half > r.begin ? i - half : r.begin, j1 = i + half < r.end - 1 ? i + half : r.end - 1;
    double sum = 0.0;
    for (long j = j0; j <= j1; ++j) {  // entries in position order: every neighbour within half is among them
      const int sj = c.order(b, h, j);
      const long d = c.positions(b, h, sj) - t;
      if (d >= -half && d <= half) sum += c.stats(b, h, sj);
    }
    c.pooled(b, h, i) = sum / static_cast<double>(P);
  });
  team.team_barrier();
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, r.begin, r.end),
                       [&](long i) { c.stats(b, h, c.order(b, h, i)) = c.pooled(b, h, i); });
  team.team_barrier();
}

/// Step q of (b, h) (spec EVICTION.md §1 steps 1-5): append; when `role.compress`, evict the worst retained
/// rows while |R| > k (a merging eviction, p.merge, first folds each into its most similar kept row:
/// eviction_merge; a pooling scorer's statistics pooled first: pool_retained); attend; update attention
/// statistics when `role.observe`. A streaming memory (chunk = 1) gives every step every role. One team;
/// every sum in a fixed order.
template <class Team, class Scorer, class Cache, class T, class QueryOf, class OutOf, class LseOf>
KOKKOS_INLINE_FUNCTION void eviction_step(const Team& team, const EvictionParams& p, const Cache& c,
                                          const Scorer& scorer, long b, int h, long q, const T* key,
                                          const T* value, const QueryOf& query_of, const OutOf& out_of,
                                          const LseOf& lse_of, TeamSelectScratch select = {}, const StepRole& role = {}) {
  eviction_append(team, p, c, scorer, b, h, q, key, value);
  if (role.compress) {
    RetainedRange r(p, c.live(b, h), q);
    if constexpr (score::pool_width<Scorer> > 1)
      if (r.end - r.begin > p.top_k) pool_retained<score::pool_width<Scorer>>(team, c, b, h, r);
    for (; r.end - r.begin > p.top_k; r = RetainedRange(p, c.live(b, h), q)) {
      const long worst = eviction_worst(team, p, c, scorer, b, h, h + 1, q, r, select);
      if (p.merge) eviction_merge(team, p, c, b, h, worst, r.begin, select);
      eviction_remove(team, c, b, h, worst);
    }
  }
  eviction_attend(team, p, c, scorer, b, h, query_of, out_of, lse_of, role);
}

/// Step q of every kv-head of sequence b for a layer-wide scorer (Scorer::layer_wide(): every kv-head
/// evicts the same token, the one with the lowest effective score summed over the kv-heads, as the
/// original TOVA's mean over all heads of the layer; spec EVICTION.md §6).
template <class Team, class Scorer, class Cache, class QueryOf, class OutOf, class LseOf, class KeyOf, class ValueOf>
KOKKOS_INLINE_FUNCTION void eviction_step_layer(const Team& team, const EvictionParams& p, const Cache& c,
                                                const Scorer& scorer, long b, int heads, long q, const KeyOf& key_of,
                                                const ValueOf& value_of, const QueryOf& query_of,
                                                const OutOf& out_of, const LseOf& lse_of, TeamSelectScratch select = {}) {
  for (int h = 0; h < heads; ++h) eviction_append(team, p, c, scorer, b, h, q, key_of(h), value_of(h));
  for (RetainedRange r(p, c.live(b, 0), q); r.end - r.begin > p.top_k; r = RetainedRange(p, c.live(b, 0), q)) {
    const long worst = eviction_worst(team, p, c, scorer, b, 0, heads, q, r, select);
    for (int h = 0; h < heads; ++h) {
      if (p.merge) eviction_merge(team, p, c, b, h, worst, r.begin, select);  // each kv-head into its own nearest row
      eviction_remove(team, c, b, h, worst);
    }
  }
  for (int h = 0; h < heads; ++h)
    eviction_attend(
        team, p, c, scorer, b, h, [&](int g) { return query_of(h, g); }, [&](int g) { return out_of(h, g); },
        [&](int g) { return lse_of(h, g); });
}

/// Runs tokens [0, lengths[b]) of every sequence b through eviction_step, in order, at positions
/// first[b] + i: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] in, y [B, Hq, T, Dv] out (rows past
/// lengths[b] untouched). One team per (sequence, kv-head): the steps of a head are sequential by
/// definition (spec EVICTION.md §1), the heads and sequences independent, the rows and channels of a step
/// spread over the team; one team per sequence for a layer-wide scorer (eviction_step_layer).
/// `team_size`: threads per team, Kokkos::AUTO's choice when 0 (the memory's); every team size gives the
/// same bits (the tests run several). On Cuda each team also gets the shared memory of CUB's selection
/// (team_select_bytes). When `lse` [B, Hq, T] (float32) is not empty, lse(b, hq, i) receives the log-sum-exp
/// of token i's softmax (eviction_attend). Each token's step takes its StepRole from its position, the call's
/// tokens [first[b], first[b] + lengths[b]) and `decode` (the call is a decode step; EvictionConfig::chunk).
template <class Scorer, class ExecSpace, class Cache, class TokensIn, class TokensOut, class Lengths,
          class Lse = Kokkos::View<float***, Kokkos::LayoutStride, typename ExecSpace::memory_space>>
void eviction_tokens(const ExecSpace& exec, const EvictionParams& p, const Cache& cache, const Scorer& scorer,
                     const TokensIn& q, const TokensIn& k, const TokensIn& v, const TokensOut& y, const Lengths& first,
                     const Lengths& lengths, int team_size = 0, const Lse& lse = Lse{}, bool decode = false) {
  const long B = static_cast<long>(k.extent(0)), H = static_cast<long>(k.extent(1));
  const bool layer = scorer.layer_wide();
  using policy = Kokkos::TeamPolicy<ExecSpace, step_launch>;
  const int leagues = static_cast<int>(layer ? B : B * H);
  auto launch = team_size > 0 ? policy(exec, leagues, team_size) : policy(exec, leagues, Kokkos::AUTO);
  if constexpr (team_select_bytes<ExecSpace> > 0) launch.set_scratch_size(0, Kokkos::PerTeam(team_select_bytes<ExecSpace>));
  Kokkos::parallel_for(
      "kvmem::evict", launch, KOKKOS_LAMBDA(const typename policy::member_type& team) {
        const long idx = team.league_rank();
        const TeamSelectScratch select = team_select_scratch(team);
        const bool with_lse = lse.data() != nullptr;
        if (layer) {
          const long b = idx;
          for (long i = 0; i < lengths(b); ++i)
            eviction_step_layer(
                team, p, cache, scorer, b, static_cast<int>(H), first(b) + i, [&](int h) { return &k(b, h, i, 0); },
                [&](int h) { return &v(b, h, i, 0); }, [&](int h, int g) { return &q(b, h * p.group + g, i, 0); },
                [&](int h, int g) { return &y(b, h * p.group + g, i, 0); },
                [&](int h, int g) { return with_lse ? &lse(b, h * p.group + g, i) : nullptr; }, select);
          return;
        }
        const long b = idx / H;
        const int h = static_cast<int>(idx % H);
        const long a = first(b), n = lengths(b);
        for (long i = 0; i < n; ++i) {
          auto query_of = [&](int g) { return &q(b, h * p.group + g, i, 0); };
          auto out_of = [&](int g) { return &y(b, h * p.group + g, i, 0); };
          auto lse_of = [&](int g) { return with_lse ? &lse(b, h * p.group + g, i) : nullptr; };
          eviction_step(team, p, cache, scorer, b, h, a + i, &k(b, h, i, 0), &v(b, h, i, 0), query_of, out_of,
                        lse_of, select, StepRole::of(p, a + i, a, a + n, decode));
        }
      });
}

/// positions [B, Hkv, K] = the cached tokens' positions in increasing order, -1 past rows [B, Hkv] = the
/// cached row count (spec EVICTION.md §1 "Outputs": sinks, window and retained rows after the last step).
template <class ExecSpace, class Cache, class Positions, class Rows>
void eviction_kept(const ExecSpace& exec, const Cache& cache, const Positions& positions, const Rows& rows) {
  const long B = static_cast<long>(cache.live.extent(0)), H = static_cast<long>(cache.live.extent(1));
  const long K = static_cast<long>(positions.extent(2));
  Kokkos::parallel_for(
      "kvmem::evict_kept", Kokkos::RangePolicy<ExecSpace>(exec, 0, B * H), KOKKOS_LAMBDA(long idx) {
        const long b = idx / H, h = idx % H, live = cache.live(b, h);
        rows(b, h) = live;
        for (long i = 0; i < K; ++i) positions(b, h, i) = i < live ? cache.positions(b, h, cache.order(b, h, i)) : -1;
      });
}

}  // namespace kvmem::kernels
