#pragma once
/// \file ovq_kinds.hpp
/// The OVQ rows of kvmem-eval (ovq-paper Sec. 3.2; spec OVQ.md): `ovq` sized for each memory fraction with
/// the plateau schedule, `ovq-paper` at the KVM paper's OVQ setting, and `ovq-whole`, OVQ's attention with
/// every token in its open chunk (what its logits alone cost, before any quantization).
///
/// Every OVQ memory here is kvmem::OvqMemory as `kvmem-run ovq` builds it (spec OVQ.md §1): one window chunk
/// (the open chunk), no sinks, rope_dims 0, row cap N = max_centroids, count bias on, centroids not
/// normalized, and beta = the input's tau_bswa per query head (1 in every capture: OVQ's initial value), so
/// a logit is beta * sqrt(D) * cos(q, key) + log(count).

#include <string>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "memory_kind.hpp"
#include "run_composed.hpp"
#include "sizing.hpp"

namespace kvmem::tools::eval {

/// An OVQ config for the inputs: chunk `chunk`, one window chunk, no sinks, row cap N.
inline MemoryConfig ovq_config(const Inputs& in, int chunk, long max_centroids) {
  TokenBudget s;
  s.chunk = chunk;
  auto c = composed_config(in, s, 1);  // OVQ attends to the open chunk only (spec OVQ.md §4)
  c.rope_dims = 0;
  c.sinks = 0;
  c.max_rows = max_centroids;
  return c;
}

/// Builds OvqMemory<exec, Plateau{N}, T> with beta = tau_bswa and runs it (N = cfg.max_rows).
template <StorageType T>
RunStats run_ovq(const MemoryConfig& cfg, const StoredInputs& in, const OutView& y) {
  return run_stored<T>(in, y, [&](const InputsOf<T>& i, const auto& yt) {
    const LayerWeights<mem_space> beta{{}, {}, i.weights.tau_window, i.weights.tau_window};
    OvqMemory<exec, budget::Plateau, T> mem(cfg, budget::Plateau{static_cast<double>(cfg.max_rows)}, beta,
                                            static_cast<int>(i.B));
    return run_composed(mem, i, yt, in.prompt);
  });
}

/// Centroids an OVQ prefill of T tokens ends with: every full chunk is committed as soon as it is complete
/// (spec OVQ.md §3, §5), a partial last chunk never; the same plan_update the memory runs.
inline long ovq_final_rows(const MemoryConfig& cfg, const budget::Plateau& b, long T) {
  long rows = 0;
  for (long first = 0; first + cfg.chunk <= T; first += cfg.chunk)
    rows = state::plan_update(cfg, b, rows, first).rows_after();
  return rows;
}

/// JSON parameters and table summary of an OVQ plan of storage type T with plateau N = cfg.max_rows.
template <StorageType T>
Plan ovq_plan(const MemoryConfig& cfg, long target_rows) {
  return {{{"config", config_json(cfg)},
           {"budget", {{"kind", "plateau"}, {"max_centroids", cfg.max_rows}, {"target_rows", target_rows}}},
           {"beta", "tau_bswa"}},
          fmt("C=%d N=%ld", cfg.chunk, cfg.max_rows),
          [cfg](const StoredInputs& i, const OutView& y) { return run_ovq<T>(cfg, i, y); }};
}

/// ovq, ovq-paper and ovq-whole of storage type T, in table order.
template <StorageType T>
std::vector<MemoryKind> ovq_kinds() {
  std::vector<MemoryKind> kinds;
  kinds.push_back(
      {"ovq", "OVQ plateau",
       "C = round(s*f*T) (the open chunk), R = f*T - C; budget::Plateau tN/(t+N) with N the smallest integer whose "
       "prefill of T tokens ends with R centroids (row cap N)",
       false, [](const Inputs& in, const SizingOptions& o, double f, const std::string&) {
         const long n = longest(in);
         const auto s = split_budget(n, f, o, 1, /*first_chunk_rows=*/false);
         auto cfg = ovq_config(in, s.chunk, 1);
         auto rows_of = [&](double N) {
           auto c = cfg;
           c.max_rows = static_cast<long>(N);
           return ovq_final_rows(c, budget::Plateau{N}, n);
         };
         // N >= n^2 puts floor(tN/(t+N)) at t - 1 for every t <= n: the most the schedule can reach.
         const double hi = static_cast<double>(n) * static_cast<double>(n) + 1.0;
         cfg.max_rows = static_cast<long>(smallest_reaching(rows_of, s.rows, 1.0, hi, /*integer=*/true));
         return ovq_plan<T>(cfg, s.rows);
       }});
  kinds.push_back(
      {"ovq-paper", "OVQ C=256, N=1024",
       "the KVM paper's OVQ runs (spec OVQ.md §1): C = 256, budget::Plateau N = 1024; one point at the memory "
       "that gives",
       true, [](const Inputs& in, const SizingOptions&, double, const std::string&) {
         const auto cfg = ovq_config(in, 256, 1024);
         return ovq_plan<T>(cfg, ovq_final_rows(cfg, budget::Plateau{1024}, longest(in)));
       }});
  kinds.push_back(
      {"ovq-whole", "OVQ, whole cache",
       "C = T (every token in the open chunk, N = 1: no centroid is ever read): OVQ's normalized, beta-scaled "
       "logits over the full cache; one point at about 100% of the cache",
       true, [](const Inputs& in, const SizingOptions&, double, const std::string&) {
         return ovq_plan<T>(ovq_config(in, static_cast<int>(longest(in)), 1), 0);
       }});
  return kinds;
}

}  // namespace kvmem::tools::eval
