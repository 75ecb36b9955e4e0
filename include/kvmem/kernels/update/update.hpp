#pragma once
/// \file update.hpp
/// State update with one block of tokens: score, append the winners, route and fold the rest in.
///
/// Deterministic passes, each parallel over the tokens or rows of a (sequence, kv-head), no float atomics
/// (kvm-paper Sec. 4, App. A; ovq-paper Sec. 3.2; specs KVM.md §5, OVQ.md §5):
///   1. stage   memory keys of the block,
///   2. score   tokens against the rows that exist (or, when none exist and the policy commits its first
///              block like any other, against the block's first token: OVQ's seeding),
///   3. select  which tokens become rows: the lowest scores, ties to the lower token index,
///   4. append  selected tokens as new rows (in token or score order, per policy),
///   5. route   every other token to its best row (argmax of the memory key's dot product with the read
///              keys, ties to the lower row) among the rows before or after the append, per policy; with
///              a max-similarity scorer the score pass finds the best row that existed before the append
///              and the route only continues over the appended rows,
///   6. group   the routed tokens by row (each row's tokens one run, in token order),
///   7. fold    per row, its routed tokens in token order, then refresh the row's read caches;
///   8. evict   with row eviction (score::RowEviction), the rows over the cap, lowest statistic first
///              (evict_rows_team, row_eviction.hpp).
/// One kernel runs them all (update_state): a team per (sequence, kv-head), each pass split over the team's
/// threads with a team barrier after it; score runs only where a block is ranked, select and append only
/// where tokens found rows. Select and group rank through kernels::team_rank (CUB's block radix sort on
/// Cuda, rank counting elsewhere: the same ranks). The same kernel serves KVM's first-chunk copy (every token appended), so
/// prefill and decode produce identical bits. Its Kokkos label, kvmem::update, has at most 15 characters,
/// which a std::string holds without a heap allocation (Kokkos copies the label at every launch; decode
/// must not allocate).

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <type_traits>

#include "../../config.hpp"
#include "../../policy/layer_weights.hpp"
#include "../../policy/merge/concept.hpp"
#include "../../policy/score/append_scorer.hpp"
#include "../../state/state_rows.hpp"
#include "row_eviction.hpp"
#include "../common/scratch.hpp"
#include "../../math/simd.hpp"
#include "../plan/step_launch.hpp"
#include "../plan/step_plan.hpp"
#include "../common/team_select.hpp"
#include "../common/team_size.hpp"
#include "../../math/vector_ops.hpp"

namespace kvmem::kernels {

/// Scratch of one update for a batch: memory keys [B, Hkv, C, D]; scores, the score of each token's best
/// row so far while routing (route_scores), score ranks, new-row index or -1, routes (the row a token folds
/// into; the largest long for a token that found a row), and the routed tokens grouped by row (token
/// indices ordered by (route, token), tokens that found rows last) [B, Hkv, C] of the block's tokens.
template <class MemorySpace>
struct UpdateScratch {
  Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace> keys;
  Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> scores, route_scores;
  Kokkos::View<long***, Kokkos::LayoutRight, MemorySpace> ranks, new_rows, routes, grouped;

  void allocate(int batch, int kv_heads, int chunk, int head_dim) {
    keys = decltype(keys)("kvmem::block_keys", batch, kv_heads, chunk, head_dim);
    scores = decltype(scores)("kvmem::block_scores", batch, kv_heads, chunk);
    route_scores = decltype(route_scores)("kvmem::route_scores", batch, kv_heads, chunk);
    ranks = decltype(ranks)("kvmem::block_ranks", batch, kv_heads, chunk);
    new_rows = decltype(new_rows)("kvmem::block_new_rows", batch, kv_heads, chunk);
    routes = decltype(routes)("kvmem::block_routes", batch, kv_heads, chunk);
    grouped = decltype(grouped)("kvmem::block_grouped", batch, kv_heads, chunk);
  }
  [[nodiscard]] long bytes() const {
    return static_cast<long>((keys.span() + scores.span() + route_scores.span()) * sizeof(float) +
                             (ranks.span() + new_rows.span() + routes.span() + grouped.span()) * sizeof(long));
  }
};

/// Tokens per register tile of the score and route products (token_rows_max): a multiple of the
/// register vector's width.
inline constexpr int update_lanes = 16;

/// Whether the update scores and routes a block on the host through register tiles (tokens in vector
/// lanes, rows broadcast: token_rows_max) rather than one thread per token with dot products of rows.
/// Both give the same bits; the tiles are for CPU threads, one thread per token for GPUs.
template <class ExecSpace>
inline constexpr bool update_in_lanes = runs_on_host<ExecSpace> && simd::width <= update_lanes;

/// Whether Scorer::score is max_i dot(key, row_i) over the rows in row order from -inf (score::Novelty),
/// declared by `static constexpr bool max_similarity = true`: the update then scores a block in
/// register tiles (token_rows_max), the same bits as the per-token hook.
template <class Scorer>
inline constexpr bool scores_max_similarity = [] {
  if constexpr (requires { Scorer::max_similarity; })
    return static_cast<bool>(Scorer::max_similarity);
  else
    return false;
}();

/// The running maxima of L token lanes (register vectors of scores and of their rows) over rows visited
/// in row order: keep() replaces a lane's maximum where the row's score is greater (`>`: ties and NaN keep
/// the earlier row), or takes the row as it is (`take`: the route's first row, even with a NaN score).
template <int L>
struct LaneArgmax {
  static constexpr int W = simd::width, V = L / W;
  simd::vec best[V];
  simd::ivec row[V];
  /// Every lane at score `value` and row `first`.
  KOKKOS_INLINE_FUNCTION void start(float value, long first) {
    for (int x = 0; x < V; ++x) best[x] = simd::broadcast(value), row[x] = simd::broadcast_int(static_cast<int>(first));
  }
  /// Lane u at score best_in[u] and row row_in[u] (u < L): a scan that continues an earlier one.
  KOKKOS_INLINE_FUNCTION void start(const float* best_in, const int* row_in) {
    for (int x = 0; x < V; ++x) best[x] = simd::load(best_in + x * W), row[x] = simd::load_int(row_in + x * W);
  }
  /// Row i's scores s of lanes [x W, (x + 1) W).
  KOKKOS_INLINE_FUNCTION void keep(long i, int x, const simd::vec& s, bool take) {
    const simd::ivec m = take ? simd::broadcast_int(-1) : simd::greater(s, best[x]);
    best[x] = simd::select(m, s, best[x]);
    row[x] = simd::select(m, simd::broadcast_int(static_cast<int>(i)), row[x]);
  }
  /// best_out [L], row_out [L].
  KOKKOS_INLINE_FUNCTION void store(float* best_out, int* row_out) const {
    for (int x = 0; x < V; ++x) simd::store(best_out + x * W, best[x]), simd::store(row_out + x * W, row[x]);
  }
};

/// on_row(i, x, s) for the rows i of [first, end) in row order, s the scores dot(at_u, row_of(i)) of lanes
/// u in [x W, (x + 1) W) (`at` [dim][L]: L tokens transposed), K rows per register tile so that K x L / W
/// = 8 independent multiply-add chains keep both FMA pipes busy: per lane the operations of kernels::dot,
/// so the bits of one thread per token (key_rows_scan).
template <int L, class RowOf, class OnRow>
KOKKOS_INLINE_FUNCTION void token_rows_scan(const float* at, int dim, long first, long end, RowOf row_of,
                                            OnRow on_row) {
  constexpr int V = L / simd::width, K = 8 / V > 0 ? 8 / V : 1;
  using row_ptr = decltype(row_of(first));
  long i = first;
  for (; i + K <= end; i += K) {
    row_ptr rows[K];
    for (int k = 0; k < K; ++k) rows[k] = row_of(i + k);
    simd::lane_dots<L, K>(at, dim, rows, [&](int k, int x, const simd::vec& s) { on_row(i + k, x, s); });
  }
  for (; i < end; ++i) {
    row_ptr rows[1] = {row_of(i)};
    simd::lane_dots<L, 1>(at, dim, rows, [&](int, int x, const simd::vec& s) { on_row(i, x, s); });
  }
}

/// on_row(i, s) for the rows i of [first, end) in row order, s = dot(key, row_of(i)) over dim channels: one
/// thread per token, eight rows at a time as independent chains (dot_rows; rows equally spaced in
/// memory), the bits of kernels::dot per row.
template <class RowOf, class OnRow>
KOKKOS_INLINE_FUNCTION void key_rows_scan(const float* key, int dim, long first, long end, RowOf row_of,
                                          OnRow on_row) {
  constexpr int NR = 8;
  const long stride = end - first > 1 ? row_of(first + 1) - row_of(first) : 0;
  float s[NR];
  for (long i = first; i < end; i += NR) {
    const long n = Kokkos::min(static_cast<long>(NR), end - i);
    if (n == NR)
      dot_rows<NR>(key, 1.0f, row_of(i), stride, dim, s);
    else
      for (long r = 0; r < n; ++r) dot_rows<1>(key, 1.0f, row_of(i + r), 0, dim, &s[r]);
    for (long r = 0; r < n; ++r) on_row(i + r, s[r]);
  }
}

/// For the L tokens of `at` ([dim][L], transposed): best[u] = max over rows [first, end) of
/// dot(at_u, row_of(i)) and best_row[u] its row, rows compared in row order by `>` (ties and NaN keep the
/// earlier row). With `take_first` the first row is taken as it is (route: a NaN score stays), otherwise
/// the maximum starts from -inf and stays there for NaN or -inf scores (score::Novelty). Per lane the same
/// operations as dot_rows and those comparisons, so the same bits as one thread per token (spec KVM.md
/// §5.3 and §5.5).
template <int L, class RowOf>
KOKKOS_INLINE_FUNCTION void token_rows_max(const float* at, int dim, long first, long end, bool take_first,
                                           RowOf row_of, float* best, int* best_row) {
  LaneArgmax<L> a;
  a.start(neg_inf(), first);
  token_rows_scan<L>(at, dim, first, end, row_of,
                     [&](long i, int x, const simd::vec& s) { a.keep(i, x, s, take_first && i == first); });
  a.store(best, best_row);
}

/// Seeding: the policy commits its first block like any other and no row exists yet (OVQ's m == 0):
/// tokens are scored against the block's first token, row 0 takes the block's first token and every
/// token not selected, and selected tokens found rows 1, 2, ... (spec OVQ.md §5.1).
template <class Merge>
KOKKOS_INLINE_FUNCTION bool seeding(long rows_before) {
  return !Merge::first_chunk_verbatim && rows_before == 0;
}

/// Tokens of sequence b's block that found new rows (the plan `p` [B, plan_fields], its device view or its
/// host mirror): the plan's growth M* - m, or one fewer when seeding (row 0 is founded by the fold).
template <class Merge, class Plan>
KOKKOS_INLINE_FUNCTION long selected_tokens(const Plan& p, long b) {
  const long app = p(b, append_count);
  return seeding<Merge>(p(b, rows_before)) ? (app > 1 ? app - 1 : 0) : app;
}

/// Whether sequence b's block is scored and ranked to choose the tokens that found rows: some but not all
/// of them do, or the rows are founded in score order.
template <class Merge, class Plan>
KOKKOS_INLINE_FUNCTION bool ranks_tokens(const Plan& p, long b) {
  const long n = selected_tokens<Merge>(p, b);
  return n > 0 && (n < p(b, block_count) || Merge::rows_in_score_order);
}

/// Folds the block [block_begin, block_begin + block_count) of every plan row into that sequence's
/// state (all kv-heads). `append_count` is the plan's growth M* - m (spec KVM.md §5.1, OVQ.md §3): that
/// many tokens found rows, lowest Scorer score first (when seeding, row 0 is one of them). Plan rows with
/// block_count == 0 are untouched. `max_block` bounds block_count over the batch (<= chunk). The window and
/// the read caches are in the storage type T, read as float32; memory keys, scores and every merge sum are
/// float32, and scores and routes compare with the rows' float32 decision keys (StateRows::decision_key),
/// so a 16-bit memory takes the float32 memory's decisions on the same window keys (docs/numerics.md).
/// One kernel, kvmem::update: a team per (sequence, kv-head) (head_team_size threads) runs the passes of the
/// file's header in order, each over the block's tokens (or blocks of update_lanes tokens, or positions)
/// split over the team's threads, a team barrier after each; a pass without work in that sequence (score where no block is
/// ranked, select and append where no token founds a row) is skipped by the whole team. `EvictRows` (a
/// memory whose RowEviction evicts): the evict pass follows the fold, evicting p(b, rows_evicted) rows.
template <merge::MergePolicy Merge, score::AppendScorer Scorer, bool EvictRows = false, class ExecSpace,
          StorageType T>
void update_state(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                  const state::StateRows<typename ExecSpace::memory_space, T>& st,
                  const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                  const UpdateScratch<typename ExecSpace::memory_space>& scratch,
                  const StepPlan<typename ExecSpace::memory_space>& plan, long max_block) {
  const long B = static_cast<long>(st.keys.extent(0)), H = static_cast<long>(st.keys.extent(1));
  if (max_block <= 0 || B == 0) return;
  const int D = cfg.head_dim;
  const auto p = plan.device;
  const auto keys = scratch.keys;
  const auto scores = scratch.scores;
  const auto route_scores = scratch.route_scores;
  const auto ranks = scratch.ranks;
  const auto new_rows = scratch.new_rows;
  const auto routes = scratch.routes;
  const auto grouped = scratch.grouped;
  constexpr int L = update_lanes;
  constexpr bool lanes = update_in_lanes<ExecSpace>;
  constexpr bool score_in_lanes = lanes && scores_max_similarity<Scorer>;
  using policy_t = Kokkos::TeamPolicy<ExecSpace, step_launch>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  // The team size before the backend's cap, and the scratch level where that many threads' register-tile
  // buffers (D x L floats each) fit together; the cap below only lowers the size.
  // (On Cuda whole blocks of backend::cuda::rank_team threads, which CUB's block sort of the ranks takes.)
  const int wanted = team_select_bytes<ExecSpace> > 0
                         ? backend::cuda::rank_team
                         : head_team_size(exec, B * H, max_block, Kokkos::Experimental::finite_max_v<int>);
  const std::size_t bytes = lanes ? scratch_t::shmem_size(long(D) * L) : 0;
  const int level =
      bytes * static_cast<std::size_t>(wanted) <= static_cast<std::size_t>(policy_t(exec, 1, 1).scratch_size_max(0)) ? 0 : 1;
  const auto body = KOKKOS_LAMBDA(const member_t& team) {
    // The passes, defined in the kernel so that it captures each view once: its functor stays under the
    // 4 KiB that Cuda takes as a kernel argument (step_launch; a CUDA graph replays such a launch).
    auto selected = [&](long b) { return selected_tokens<Merge>(p, b); };
    auto must_rank = [&](long b) { return ranks_tokens<Merge>(p, b); };

    // 1. stage: the memory key of token j of sequence b's block, into keys(b, h, j).
    auto stage = [&](long b, long h, long j) {
      Merge::memory_key(cfg, w, &ring.keys(b, h, ring.slot(p(b, block_begin) + j), 0), &keys(b, h, j, 0));
    };
    // The rows a token of sequence b may join: [first, end) (step 5).
    const long sinks = cfg.sinks;
    auto route_rows = [&](long b, long& first, long& end) {
      const long m = p(b, rows_before);
      end = Merge::route_after_append ? m + selected(b) : m;
      first = Kokkos::min(sinks, end);
    };
    // Whether the score pass of sequence b also finds each token's best row among the rows it may join
    // that existed before the append: a max-similarity scorer (score::Novelty) computes kbar_j . read key
    // of every row, the very products the route compares, so the route pass only continues over the
    // appended rows (step 5).
    auto routed_in_score = [&](long b) {
      long first, end;
      route_rows(b, first, end);
      const long m = p(b, rows_before);
      return scores_max_similarity<Scorer> && must_rank(b) && !seeding<Merge>(m) && first < m;
    };
    // Tokens [j0, j0 + n) of sequence b's block transposed into `at` [D][L] (zero past n).
    auto transpose_keys = [&](long b, long h, long j0, int n, float* at) {
      for (int c = 0; c < D; ++c)
        for (int u = 0; u < L; ++u) at[c * L + u] = u < n ? keys(b, h, j0 + u, c) : 0.0f;
    };
    // 2. score: against the existing rows' read keys, or (seeding) against the block's first token.
    auto seed_score = [&](long b, long h, long j) {
      return j == 0 ? -neg_inf() : dot(&keys(b, h, j, 0), &keys(b, h, 0, 0), D);
    };
    // In register tiles: tokens [j0, j0 + n) in lanes (`at`: D x L floats of the thread's scratch).
    auto score_block = [&](long b, long h, long j0, int n, float* at) {
      const long m = p(b, rows_before);
      if (seeding<Merge>(m)) {
        for (int u = 0; u < n; ++u) scores(b, h, j0 + u) = seed_score(b, h, j0 + u);
        return;
      }
      transpose_keys(b, h, j0, n, at);
      long first, end;
      route_rows(b, first, end);
      LaneArgmax<L> novelty, route;
      novelty.start(neg_inf(), 0);
      route.start(neg_inf(), first);
      token_rows_scan<L>(at, D, 0, m, [&](long i) { return st.decision_key(b, h, i); }, [&](long i, int x, const simd::vec& sv) {
        novelty.keep(i, x, sv, false);
        if (i >= first) route.keep(i, x, sv, i == first);
      });
      float best[L];
      int row[L];
      novelty.store(best, row);
      for (int u = 0; u < n; ++u) scores(b, h, j0 + u) = best[u];
      if (!routed_in_score(b)) return;
      route.store(best, row);
      for (int u = 0; u < n; ++u) route_scores(b, h, j0 + u) = best[u], routes(b, h, j0 + u) = row[u];
    };
    // One thread per token.
    auto score_token = [&](long b, long h, long j) {
      const long m = p(b, rows_before);
      if (seeding<Merge>(m)) {
        scores(b, h, j) = seed_score(b, h, j);
      } else if (routed_in_score(b)) {  // Scorer::score's maximum and the route's argmax in one scan
        long first, end;
        route_rows(b, first, end);
        float novelty = neg_inf(), best = neg_inf();
        long best_row = first;
        key_rows_scan(&keys(b, h, j, 0), D, 0, m, [&](long i) { return st.decision_key(b, h, i); }, [&](long i, float sc) {
          novelty = sc > novelty ? sc : novelty;
          if (i >= first && (sc > best || i == first)) best = sc, best_row = i;
        });
        scores(b, h, j) = novelty;
        route_scores(b, h, j) = best;
        routes(b, h, j) = best_row;
      } else {
        scores(b, h, j) = Scorer::score(&keys(b, h, j, 0), st.decision_key(b, h, 0), m, D);
      }
    };
    // 3. select: rank by (score asc, token index asc); the first `selected` found rows. NaN scores (from a
    //    non-finite key) rank after every number (order_key), so the ranks stay a permutation of
    //    0..count-1: with plain `<` every NaN would rank 0, more tokens than planned would found rows, past
    //    the rows the host planned and allocated, or several tokens would write one row. Without a ranking
    //    every token is selected in token order.
    auto score_key = [&](long b, long h, long j) { return order_key(scores(b, h, j)); };
    auto token_order = [&](long b, long h, long j) { ranks(b, h, j) = j; };
    // 4. append: selected tokens become rows base.. in token or score order (spec KVM.md §5.4, OVQ.md §5.1).
    auto append = [&](long b, long h, long j) {
      const long n = selected(b), m = p(b, rows_before);
      if (ranks(b, h, j) >= n) {
        new_rows(b, h, j) = -1;
        return;
      }
      long order = ranks(b, h, j);
      if (!Merge::rows_in_score_order) {
        order = 0;
        for (long i = 0; i < j; ++i) order += ranks(b, h, i) < n ? 1 : 0;
      }
      const long row = (seeding<Merge>(m) ? 1 : m) + order;
      new_rows(b, h, j) = row;
      const merge::Row r = st.row(b, h, row);
      Merge::new_row(cfg, r, &keys(b, h, j, 0), &ring.values(b, h, ring.slot(p(b, block_begin) + j), 0));
      st.template refresh<Merge>(cfg, w, b, h, row);
    };
    // 5. route the other tokens: seeding -> row 0; else the argmax over the rows before or after the append,
    //    from the first non-sink row, of the ungated memory key's dot product with the read keys (spec KVM.md
    //    §5.5 and §9 #2-#3, OVQ.md §5.1). The spec's gated key g_j kbar_j has the same argmax for every gate
    //    g_j > 0; the ungated key also keeps it where float32's gate 1 + expm1(z) rounds to 0 (z below about
    //    -17). Where the score pass found the best row among the rows that existed before the append
    //    (routed_in_score), the scan continues from it over the appended rows: the same comparisons in the
    //    same row order as one scan. A token that founded a row (no append pass ran: none did) is not routed.
    auto routed = [&](long b, long h, long j) { return selected(b) == 0 || new_rows(b, h, j) < 0; };
    // The route of a token that found a row (after every row, so such tokens group last).
    constexpr long no_route = Kokkos::Experimental::finite_max_v<long>;
    // In register tiles: tokens [j0, j0 + n) in lanes.
    auto route_block = [&](long b, long h, long j0, int n, float* at) {
      bool any = false;
      for (int u = 0; u < n; ++u) any = any || routed(b, h, j0 + u);
      if (!any || seeding<Merge>(p(b, rows_before))) {
        for (int u = 0; u < n; ++u) routes(b, h, j0 + u) = routed(b, h, j0 + u) ? 0 : no_route;
        return;
      }
      long first, end;
      route_rows(b, first, end);
      LaneArgmax<L> route;
      long from = first;
      if (routed_in_score(b)) {
        float best[L];
        int row[L];
        for (int u = 0; u < L; ++u) {
          best[u] = u < n ? route_scores(b, h, j0 + u) : neg_inf();
          row[u] = static_cast<int>(u < n ? routes(b, h, j0 + u) : first);
        }
        route.start(best, row);
        from = p(b, rows_before);
      } else {
        route.start(neg_inf(), first);
      }
      if (from < end) {
        // Lanes of tokens that found rows or lie past the block are computed and ignored.
        transpose_keys(b, h, j0, n, at);
        token_rows_scan<L>(at, D, from, end, [&](long i) { return st.decision_key(b, h, i); },
                           [&](long i, int x, const simd::vec& sv) { route.keep(i, x, sv, i == first); });
      }
      float best[L];
      int row[L];
      route.store(best, row);
      for (int u = 0; u < n; ++u) routes(b, h, j0 + u) = routed(b, h, j0 + u) ? row[u] : no_route;
    };
    // One thread per token.
    auto route_token = [&](long b, long h, long j) {
      if (!routed(b, h, j)) {
        routes(b, h, j) = no_route;
        return;
      }
      if (seeding<Merge>(p(b, rows_before))) {
        routes(b, h, j) = 0;
        return;
      }
      long first, end;
      route_rows(b, first, end);
      const bool continued = routed_in_score(b);
      long best_row = continued ? routes(b, h, j) : first;
      float best = continued ? route_scores(b, h, j) : neg_inf();
      key_rows_scan(&keys(b, h, j, 0), D, continued ? p(b, rows_before) : first, end, [&](long i) { return st.decision_key(b, h, i); },
                    [&](long i, float sc) {
                      if (sc > best || i == first) best = sc, best_row = i;
                    });
      routes(b, h, j) = best_row;
    };
    // 6. group the routed tokens by row: position of token j = #{i : (route_i, i) < (route_j, j)} (team_rank
    //    of the routes as keys), so each row's tokens are one run in token order (tokens that found rows,
    //    route no_route, come last).
    auto route_key = [&](long b, long h, long j) {
      constexpr long last = static_cast<long>(~std::uint32_t{0});
      const long r = routes(b, h, j);
      KOKKOS_ASSERT(r >= 0);
      return static_cast<std::uint32_t>(r < last ? r : last);
    };
    // 7. fold each row's run of routed tokens into it in token order, then refresh its read caches: one
    //    thread per run, found at the run's first position k.
    auto fold = [&](long b, long h, long k) {
      const long count = p(b, block_count);
      const long i = routes(b, h, grouped(b, h, k));
      if (i == no_route || (k > 0 && routes(b, h, grouped(b, h, k - 1)) == i)) return;
      const merge::Row r = st.row(b, h, i);
      Merge::begin_fold(cfg, r);
      for (long kk = k; kk < count && routes(b, h, grouped(b, h, kk)) == i; ++kk) {
        const long j = grouped(b, h, kk), s = ring.slot(p(b, block_begin) + j);
        Merge::fold(cfg, r, &keys(b, h, j, 0), &ring.values(b, h, s, 0), Merge::gate(ring.gates(b, h, s)));
      }
      Merge::end_fold(cfg, r);
      st.template refresh<Merge>(cfg, w, b, h, i);
    };

    const long h = team.league_rank() % H, b = team.league_rank() / H;
    const long count = p(b, block_count);
    if (count <= 0) return;  // the whole team: no barrier is left waiting
    const TeamSelectScratch select = team_select_scratch(team);
    // (plain `if` on the constexpr flags: nvcc's extended lambdas cannot first-capture inside if constexpr)
    float* at = nullptr;
    if (lanes) at = static_cast<float*>(team.thread_scratch(level).get_shmem(sizeof(float) * D * L));
    // A pass over the block's tokens (or blocks of L tokens), split over the team's threads, then a barrier.
    auto tokens = [&](const auto& body) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, count), [&](long j) { body(b, h, j); });
      team.team_barrier();
    };
    auto token_blocks = [&](const auto& body) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (count + L - 1) / L), [&](long x) {
        const long j0 = x * L;
        body(b, h, j0, static_cast<int>(Kokkos::min(static_cast<long>(L), count - j0)), at);
      });
      team.team_barrier();
    };
    tokens(stage);
    if (must_rank(b)) {
      if (score_in_lanes)
        token_blocks(score_block);
      else
        tokens(score_token);
    }
    if (selected(b) > 0) {
      if (must_rank(b))
        team_rank(team, count, [&](long j) { return score_key(b, h, j); }, [&](long j, long r) { ranks(b, h, j) = r; },
                  select);
      else
        tokens(token_order);
      tokens(append);
    }
    if (lanes)
      token_blocks(route_block);
    else
      tokens(route_token);
    team_rank(team, count, [&](long j) { return route_key(b, h, j); }, [&](long j, long pos) { grouped(b, h, pos) = j; },
              select);
    tokens(fold);
    if (EvictRows) evict_rows_team(team, cfg, st, p, b, h, select);
  };
  const int most = policy_t(exec, B * H, 1).team_size_max(body, Kokkos::ParallelForTag());
  policy_t policy(exec, B * H, Kokkos::min(wanted, most));
  if (bytes > 0) policy.set_scratch_size(level, Kokkos::PerThread(bytes));
  if constexpr (team_select_bytes<ExecSpace> > 0) policy.set_scratch_size(0, Kokkos::PerTeam(team_select_bytes<ExecSpace>));
  static_assert(launches_as_argument<policy_t, std::remove_const_t<decltype(body)>>(),
                "kvmem::update's functor must stay under Cuda's kernel-argument limit (step_launch.hpp)");
  Kokkos::parallel_for("kvmem::update", policy, body);
}

}  // namespace kvmem::kernels
