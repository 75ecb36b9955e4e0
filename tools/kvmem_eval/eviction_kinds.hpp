#pragma once
/// \file eviction_kinds.hpp
/// The eviction rows of kvmem-eval (kvpop-paper Sec. 2; spec EVICTION.md; docs/eviction.md): `streaming`
/// (StreamingLLM), `knorm`, `h2o` and `tova`, each a kvmem::EvictionMemory whose budget s + w + k rows per
/// kv-head is the fraction f of the cache (eviction_sizing), `kvm-h2o`, KVM with a growing budget whose
/// state rows H2O evicts down to the rows of kvm-fixed (KvmMemoryWithRowEviction), and the same evictions
/// compressed at the end of the prompt (`snapkv-end`, `h2o-end`, ...: EvictionConfig::chunk = 0) or per
/// chunk of an eighth of it (`snapkv-chunk`, `h2o-chunk`), which run only with --prompt (docs/eviction.md
/// "Compression per chunk and at the end of a prompt"). KVPOP is not a row: its scorer needs trained mLSTM
/// weights, which no public checkpoint provides.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include <kvmem/eviction.hpp>
#include <kvmem/kvmem.hpp>

#include "kvm_kinds.hpp"
#include "memory_kind.hpp"
#include "run_composed.hpp"
#include "sizing.hpp"
#include "timed_prefill.hpp"

namespace kvmem::tools::eval {

/// tau_bswa[h] * q [B, Hq, T, D] in the tokens' storage type T (computed in float32, rounded once):
/// EvictionMemory's logit is q . k / sqrt(D) with no temperature, so this makes it tau q . k / sqrt(D),
/// exact attention's (tau = 1 in every capture: a bitwise copy).
template <StorageType T>
Kokkos::View<T****, Kokkos::LayoutRight, mem_space> tau_scaled_queries(const InputsOf<T>& in) {
  Kokkos::View<T****, Kokkos::LayoutRight, mem_space> q("q_times_tau", in.B, in.Hq, in.T, in.D);
  const auto src = in.q;
  const auto tau = in.weights.tau_window;
  Kokkos::parallel_for(
      "kvmem_eval::tau_scaled_queries",
      Kokkos::MDRangePolicy<exec, Kokkos::Rank<4>>({0, 0, 0, 0}, {in.B, in.Hq, in.T, in.D}),
      KOKKOS_LAMBDA(long b, long h, long t, long c) { q(b, h, t, c) = from_float<T>(tau(h) * to_float(src(b, h, t, c))); });
  return q;
}

/// An EvictionConfig for the inputs' shape with the split of split_eviction (sizing.hpp). Throws
/// kvmem::invalid_argument naming --fractions when f*T rounds to 0 rows.
inline EvictionConfig eviction_sizing(const Inputs& in, const SizingOptions& o, double fraction,
                                      const std::string& label, const std::string& memory) {
  const long T = longest(in);
  const auto e = split_eviction(T, fraction, o);
  require(e.budget >= 1, "--fractions = " + label, fraction,
          "too small for " + memory + ": " + std::to_string(fraction * static_cast<double>(T)) + " tokens of a " +
              std::to_string(T) + "-token sequence round to 0 rows (use a larger fraction)");
  EvictionConfig c;
  c.head_dim = static_cast<int>(in.D);
  c.value_dim = static_cast<int>(in.Dv);
  c.query_heads = static_cast<int>(in.Hq);
  c.kv_heads = static_cast<int>(in.Hkv);
  c.sinks = static_cast<int>(e.sinks);
  c.window = static_cast<int>(e.window);
  c.top_k = static_cast<int>(e.top_k);
  return c;
}

/// Prefills an EvictionMemory<exec, Scorer, T> with tau-scaled queries (not timed) and writes yt [B, Hq, T, Dv]
/// of storage type T, as the tokens `in` (the first `prompt` in one prefill, the rest decode steps, when
/// `prompt` >= 0).
/// rows: cached rows outside the window (sinks + retained) of the fullest kv-head, window: min(n, w).
/// Held memory: the memory's held_bytes() (budget + 1 rows of D + Dv elements of T per kv-head, and a float32
/// count per row for a merging eviction); peak: what it holds at its fullest step, per kv-head min(n, budget
/// + 1) rows (the + 1: the row a step holds between its append and its eviction), budget + C per chunk of C,
/// and at the end of a prompt max(budget, prompt) + 1.
template <StorageType T, class Scorer, class Y>
RunStats prefill_eviction(const EvictionConfig& cfg, const Scorer& scorer, const InputsOf<T>& in, const Y& yt,
                          long prompt = -1) {
  const auto q = tau_scaled_queries(in);
  using memory_t = EvictionMemory<exec, Scorer, T>;
  memory_t mem(cfg, static_cast<int>(in.B), scorer);
  RunStats s = timed_prefill(mem, typename memory_t::inputs{q, in.k, in.v}, yt, in.lengths, prompt);
  Kokkos::View<long***, Kokkos::LayoutRight, mem_space> positions("kept_positions", in.B, in.Hkv, 0);
  Kokkos::View<long**, Kokkos::LayoutRight, mem_space> kept("kept_rows", in.B, in.Hkv);
  mem.kept(positions, kept);
  const auto kh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), kept);
  long units = 0;
  const long longest_n = *std::max_element(in.lengths.begin(), in.lengths.end());
  const long peak_rows = cfg.chunk == 0 ? std::max(cfg.budget(), prompt < 0 ? longest_n : prompt) + 1
                                        : cfg.budget() + std::max(cfg.chunk, 1);
  for (long b = 0; b < in.B; ++b) {
    long most = 0;
    for (long h = 0; h < in.Hkv; ++h) most = std::max(most, kh(b, h));
    const long window = std::min<long>(in.lengths[b], cfg.window);
    s.rows.push_back(most - window);
    s.window.push_back(window);
    units += std::min(in.lengths[b], peak_rows);
  }
  s.peak_bytes = units * in.Hkv * ((in.D + in.Dv) * static_cast<long>(sizeof(T)) +
                                    (cfg.merge_evicted ? static_cast<long>(sizeof(float)) : 0L));
  return s;
}

/// prefill_eviction over the inputs' tokens in storage type T, y widened to float32.
template <StorageType T, class Scorer>
RunStats run_eviction(const EvictionConfig& cfg, const Scorer& scorer, const StoredInputs& stored, const OutView& y) {
  return run_stored<T>(stored, y, [&](const InputsOf<T>& in, const auto& yt) {
    return prefill_eviction(cfg, scorer, in, yt, stored.prompt);
  });
}

/// A plan that runs EvictionMemory with `cfg` and `scorer` (`name`: its kvmem-run evict --scorer).
template <StorageType T, class Scorer>
Plan eviction_plan(const EvictionConfig& cfg, const Scorer& scorer, const std::string& name) {
  nlohmann::json params{{"scorer", name}, {"sinks", cfg.sinks}, {"window", cfg.window}, {"top_k", cfg.top_k},
                        {"budget", cfg.budget()}, {"merge_evicted", cfg.merge_evicted}, {"queries", "tau_bswa * q"}};
  if (cfg.chunk != 1) params["chunk"] = cfg.chunk, params["observation_window"] = cfg.observation_window;
  return {params,
          cfg.chunk == 1 ? fmt("s=%d w=%d k=%d", cfg.sinks, cfg.window, cfg.top_k)
                         : fmt("s=%d w=%d k=%d C=%d obs=%d", cfg.sinks, cfg.window, cfg.top_k, cfg.chunk,
                               cfg.observation_window),
          [cfg, scorer](const StoredInputs& i, const OutView& y) { return run_eviction<T>(cfg, scorer, i, y); }};
}

/// A MemoryKind for the eviction scorer `Scorer` sized by eviction_sizing; `merge`: the merging eviction
/// (EvictionConfig::merge_evicted), whose id and label get "-merge" and " + merge".
template <StorageType T, class Scorer>
MemoryKind eviction_kind(std::string id, std::string label, std::string what, bool merge = false) {
  const std::string scorer = id;
  if (merge) id += "-merge", label += " + merge", what += ", each evicted row merged into its most similar kept row";
  return {id, std::move(label),
          "EvictionMemory, " + what + "; window w = max(1, round(s*f*T)), sinks min(4, f*T - w), top_k = f*T - w - "
          "sinks: the budget s + w + k is f*T rows",
          false, [id, scorer, merge](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
            auto cfg = eviction_sizing(in, o, f, label, id);
            cfg.merge_evicted = merge;
            return eviction_plan<T>(cfg, Scorer{}, scorer);
          }};
}

/// Positions per compression of the per-chunk rows for a prompt of P tokens (--prompt): max(2, round(P / 8)).
inline int chunk_of_prompt(long P) { return static_cast<int>(std::max(2L, std::lround(static_cast<double>(P) / 8.0))); }

/// The observation window of the compressing rows for a prompt of P tokens and chunk C (0: at its end):
/// 64 queries (kvpress's default), at most a quarter of the prompt and the chunk, at least 1.
inline int observation_of_prompt(long P, int chunk) {
  long w = std::min(64L, P / 4);
  if (chunk > 1) w = std::min<long>(w, chunk);
  return static_cast<int>(std::max(1L, w));
}

/// A MemoryKind for the eviction scorer `Scorer` (`scorer`: its kvmem-run evict --scorer) compressed at the
/// end of the prompt (`per_chunk` false: EvictionConfig::chunk = 0) or once per chunk of chunk_of_prompt
/// positions, sized by eviction_sizing, observed by observation_of_prompt queries; id "<scorer>-end" or
/// "<scorer>-chunk" ("-merge" added for the merging eviction). Runs only with --prompt (after_prompt).
template <StorageType T, class Scorer>
MemoryKind compressing_kind(const std::string& scorer, const std::string& label, bool per_chunk, bool merge = false) {
  std::string id = scorer + (per_chunk ? "-chunk" : "-end") + (merge ? "-merge" : "");
  std::string name = label + (per_chunk ? " per chunk" : " at prompt end") + (merge ? " + merge" : "");
  MemoryKind kind{id, std::move(name),
                  "EvictionMemory sized as " + scorer + " (the budget s + w + k is f*T rows), compressed " +
                      (per_chunk ? std::string("once per chunk of C = max(2, round(P/8)) positions (P: --prompt)")
                                 : std::string("at the end of the prompt (--prompt P tokens, then decode steps)")) +
                      ", scored by the last min(64, P/4" + (per_chunk ? ", C" : "") + ") queries" +
                      (merge ? ", each evicted row merged into its most similar kept row" : ""),
                  false,
                  [id, scorer, per_chunk, merge](const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
                    auto cfg = eviction_sizing(in, o, f, label, id);
                    const long P = o.prompt < 0 ? longest(in) : o.prompt;
                    cfg.merge_evicted = merge;
                    cfg.chunk = per_chunk ? chunk_of_prompt(P) : 0;
                    cfg.observation_window = observation_of_prompt(P, cfg.chunk);
                    return eviction_plan<T>(cfg, Scorer{}, scorer);
                  }};
  kind.after_prompt = true;
  return kind;
}

/// The most state rows a kvm-h2o prefill of n tokens holds at any moment. The schedule grants rows as if
/// none were evicted (Memory::plan_block: plan_update on the granted count); a fold appends what it grants
/// on top of the live rows, and the eviction then takes them back to `cap`.
inline long kvm_h2o_peak_rows(const MemoryConfig& cfg, const budget::PowerLaw& b, long cap, long n) {
  long rows = std::min<long>(n, cfg.chunk), granted = rows, peak = rows;
  const long target = std::max(rows, state::window_begin(n, cfg.chunk, cfg.window()));
  for (long cov = rows; cov < target; cov += cfg.chunk) {
    const auto up = state::plan_update(cfg, b, granted, cov);
    granted = up.rows_after();
    rows += up.append;
    peak = std::max(peak, rows);
    rows = std::min(rows, cap);
  }
  return peak;
}

/// KVM (C, window, R of kvm_sizing) with budget::PowerLaw 16*sqrt(ctx) and H2O row eviction down to R after
/// every fold; the row cap of the config (T + C) never binds, so the schedule's growth sets the fresh rows of
/// every fold; storage type T. Peak memory counts the rows a fold holds before its eviction (kvm_h2o_peak_rows).
template <StorageType T>
Plan kvm_h2o_plan(const Inputs& in, const SizingOptions& o, double f, const std::string& label) {
  const auto s = kvm_sizing(in, o, f, label, "kvm-h2o");
  require(s.rows > o.sinks, "--fractions = " + label, f,
          "too small for kvm-h2o: its row cap R = " + std::to_string(s.rows) + " must exceed --sinks = " +
              std::to_string(o.sinks));
  const budget::PowerLaw b{-1, 16.0, 0.5, 1};
  const score::RowAccumulatedAttention evict{.max_rows = s.rows};
  auto cfg = s.cfg;
  cfg.max_rows = longest(in) + cfg.chunk;  // a schedule grants at most the tokens it has seen
  return {{{"config", config_json(cfg)},
           {"budget", {{"kind", "power-law"}, {"min_rows", -1}, {"growth_factor", 16.0}, {"growth_exponent", 0.5},
                       {"round_down", 1}}},
           {"row_eviction", {{"scorer", "h2o"}, {"max_rows", s.rows}}}},
          fmt("C=%d L=%dx%d a=16 cap=%ld", cfg.chunk, cfg.window_chunks, cfg.chunk, s.rows),
          [cfg, b, evict](const StoredInputs& stored, const OutView& y) {
            return run_stored<T>(stored, y, [&](const InputsOf<T>& i, const auto& yt) {
              KvmMemoryWithRowEviction<exec, budget::PowerLaw, score::RowAccumulatedAttention, T> mem(
                  cfg, b, i.weights, static_cast<int>(i.B), evict);
              auto stats = run_composed(mem, i, yt, stored.prompt);
              long bytes = 0;
              for (long n : i.lengths)
                bytes += composed_bytes<T>(kvm_h2o_peak_rows(cfg, b, evict.max_rows, n), std::min(n, cfg.window()), i.D, i.Dv);
              stats.peak_bytes = std::max(stats.peak_bytes, bytes * i.Hkv);
              return stats;
            });
          }};
}

/// streaming, knorm, h2o, tova, their merging forms (-merge), kvm-h2o and the compressing rows (snapkv-end,
/// h2o-end, snapkv-chunk, h2o-chunk, tova-end, knorm-end, streaming-end, snapkv-end-merge) of storage type T,
/// in table order.
template <StorageType T>
std::vector<MemoryKind> eviction_kinds() {
  std::vector<MemoryKind> kinds;
  for (bool merge : {false, true}) {
    kinds.push_back(eviction_kind<T, score::None>("streaming", "StreamingLLM",
                                               "score::None (sinks + the last w + k tokens)", merge));
    kinds.push_back(
        eviction_kind<T, score::KeyNorm>("knorm", "KNorm", "score::KeyNorm (keeps the smallest key norms)", merge));
    kinds.push_back(eviction_kind<T, score::AccumulatedAttention>(
        "h2o", "H2O", "score::AccumulatedAttention (attention summed since insertion, H2O's raw sum)", merge));
    kinds.push_back(eviction_kind<T, score::LastQueryAttention>(
        "tova", "TOVA", "score::LastQueryAttention (the last query's attention, mean over the kv-head's group)", merge));
  }
  kinds.push_back(
      {"kvm-h2o", "KVM + H2O rows",
       "C, window and R as kvm-fixed; budget::PowerLaw 16*sqrt(ctx) (rows grow from C; its growth sets the fresh "
       "rows of each fold), and after every fold score::RowAccumulatedAttention evicts state rows down to R; held "
       "counts the rows a fold holds before its eviction",
       false, kvm_h2o_plan<T>});
  for (bool per_chunk : {false, true}) {
    kinds.push_back(compressing_kind<T, score::ObservationWindow>("snapkv", "SnapKV", per_chunk));
    kinds.push_back(compressing_kind<T, score::AccumulatedAttention>("h2o", "H2O", per_chunk));
  }
  kinds.push_back(compressing_kind<T, score::LastQueryAttention>("tova", "TOVA", false));
  kinds.push_back(compressing_kind<T, score::KeyNorm>("knorm", "KNorm", false));
  kinds.push_back(compressing_kind<T, score::None>("streaming", "StreamingLLM", false));
  kinds.push_back(compressing_kind<T, score::ObservationWindow>("snapkv", "SnapKV", false, true));
  return kinds;
}

}  // namespace kvmem::tools::eval
