#pragma once
/// \file sizing.hpp
/// Turning a memory fraction f of a T-token KV cache into the parameters of a memory with state rows and a
/// window (KVM, OVQ): the token budget M = f*T split between window and rows, the MemoryConfig that
/// carries it, and the bisection that picks a budget schedule's parameter so the rows reach R at token T;
/// and for eviction memories the split of M into sinks + window + top-k (split_eviction).

#include <algorithm>
#include <cmath>
#include <string>

#include <kvmem/kvmem.hpp>

#include "memory_kind.hpp"

namespace kvmem::tools::eval {

/// A token budget M = f * T (T: longest sequence) split between a window of n_b chunks and state rows:
///   chunk C = max(1, round(s * M / n_b)), window L = n_b * C tokens,
///   rows R = max(floor_rows, round(M) - L)   (floor_rows: rows the memory has anyway, e.g. KVM's first chunk).
struct TokenBudget {
  double tokens = 0;  ///< M, tokens (not rounded)
  int chunk = 1;      ///< C, tokens
  long window = 1;    ///< L = n_b * C, tokens
  long rows = 0;      ///< R, state rows at the end of the longest sequence
};

/// The split above for `window_chunks` = n_b chunks; `first_chunk_rows` sets floor_rows = min(T, C)
/// (KVM: the first chunk always becomes C rows), otherwise 0.
inline TokenBudget split_budget(long T, double fraction, const SizingOptions& o, int window_chunks,
                                bool first_chunk_rows) {
  TokenBudget s;
  s.tokens = fraction * static_cast<double>(T);
  s.chunk = static_cast<int>(std::max(1.0, std::round(o.window_share * s.tokens / window_chunks)));
  s.window = static_cast<long>(window_chunks) * s.chunk;
  const long floor_rows = first_chunk_rows ? std::min(T, static_cast<long>(s.chunk)) : 0;
  s.rows = std::max(floor_rows, static_cast<long>(std::llround(s.tokens)) - s.window);
  return s;
}

/// The eviction budget of a fraction f: M = round(f*T) rows per (sequence, kv-head), T the longest sequence,
/// split as
///   window w = min(M, max(1, round(s*f*T)))   (s = --window-share: the window KVM gets with one chunk),
///   sinks   = min(4, M - w)                   (StreamingLLM's four attention sinks, EvictionConfig's default),
///   top_k   = M - w - sinks;
/// so sinks + w + top_k = M, the same tokens as KVM's rows + window. M = 0 (f*T < 1/2) is left to the caller.
struct EvictionSplit {
  long budget = 0;  ///< M, rows
  long sinks = 0;   ///< s, tokens
  long window = 0;  ///< w, tokens
  long top_k = 0;   ///< k, tokens
};

inline constexpr long eviction_sinks = 4;  ///< sinks of every eviction row (StreamingLLM's)

inline EvictionSplit split_eviction(long T, double fraction, const SizingOptions& o) {
  const auto s = split_budget(T, fraction, o, 1, /*first_chunk_rows=*/false);
  EvictionSplit e;
  e.budget = std::llround(s.tokens);
  e.window = std::min(e.budget, s.window);
  e.sinks = std::max(0L, std::min(eviction_sinks, e.budget - e.window));
  e.top_k = std::max(0L, e.budget - e.window - e.sinks);
  return e;
}

/// A MemoryConfig for the inputs' shape (D, Dv, Hq, Hkv) with chunk and window from `s`; rope_dims, sinks,
/// max_rows and normalize_rows are left at their defaults for the caller to set.
inline MemoryConfig composed_config(const Inputs& in, const TokenBudget& s, int window_chunks) {
  MemoryConfig c;
  c.head_dim = static_cast<int>(in.D);
  c.value_dim = static_cast<int>(in.Dv);
  c.query_heads = static_cast<int>(in.Hq);
  c.kv_heads = static_cast<int>(in.Hkv);
  c.chunk = s.chunk;
  c.window_chunks = window_chunks;
  return c;
}

inline nlohmann::json config_json(const MemoryConfig& c) {
  return {{"chunk", c.chunk}, {"window_chunks", c.window_chunks}, {"window", c.window()}, {"sinks", c.sinks},
          {"rope_dims", c.rope_dims}, {"max_rows", c.max_rows}, {"normalize_rows", c.normalize_rows}};
}

/// The smallest x in [lo, hi] with rows_of(x) >= want, where want is capped at rows_of(hi) (the most the
/// schedule can reach) and rows_of is non-decreasing in x. `integer`: x takes integer values (lo, hi
/// integers); otherwise bisection to a relative 1e-9.
template <class RowsOf>
double smallest_reaching(const RowsOf& rows_of, long want, double lo, double hi, bool integer) {
  want = std::min(want, static_cast<long>(rows_of(hi)));
  if (rows_of(lo) >= want) return lo;
  // rows_of(lo) < want <= rows_of(hi) from here on.
  for (int i = 0; i < 200; ++i) {
    if (integer ? hi - lo <= 1.0 : hi - lo <= 1e-9 * hi) break;
    const double mid = integer ? std::floor(0.5 * (lo + hi)) : 0.5 * (lo + hi);
    (rows_of(mid) >= want ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace kvmem::tools::eval
