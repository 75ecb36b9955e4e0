#pragma once
/// \file eviction_config.hpp
/// Runtime parameters of a fixed-budget eviction memory: sinks + protected window + top-k
/// (kvpop-paper Sec. 2; spec EVICTION.md §1, §4).

#include <string>

#include "errors.hpp"

namespace kvmem {

/// Shape and budget of one layer's eviction memory (spec EVICTION.md §1).
///
/// Units: `sinks`, `window` and `top_k` are tokens (one cache row each) per (sequence, kv-head); the
/// budget is B = sinks + window + top_k rows. `decay_interval` is tokens (n of §4). `head_dim` and
/// `value_dim` are channels.
struct EvictionConfig {
  int head_dim = 0;         ///< D: channels of a query and a key.
  int value_dim = 0;        ///< Dv: channels of a value.
  int query_heads = 0;      ///< Hq: a multiple of kv_heads; query head hq reads kv-head hq / G.
  int kv_heads = 0;         ///< Hkv: kv-heads, each with its own cache and scorer state.
  int sinks = 4;            ///< s: the first s tokens, never evicted (StreamingLLM's attention sinks).
  int window = 64;          ///< w >= 1: the protected window of the last w tokens, the current one included.
  int top_k = 448;          ///< k >= 0: retained rows among the tokens that left the window.
  int decay_interval = 1;   ///< n >= 1 of eff_t(q) = score_t + floor((q - t) / n) log gamma (§4); 1 recommended.
  /// Merge where eviction forgets: an evicted row is folded into the kept row (sinks excepted) whose key is
  /// most similar to its own by cosine similarity, as count-weighted means of keys and values, and every
  /// row is read with the logit bias log(count) (kernels::eviction_merge; docs/eviction.md "Merging
  /// eviction"). The budget in rows is the same; each row also holds a float32 count.
  bool merge_evicted = false;

  /// Budget B = s + w + k: the most rows a (sequence, kv-head) holds after a step.
  [[nodiscard]] long budget() const { return static_cast<long>(sinks) + window + top_k; }
  /// GQA group size G = Hq / Hkv.
  [[nodiscard]] int group() const { return query_heads / kv_heads; }

  /// Throws kvmem::invalid_argument naming the first bad field (spec EVICTION.md §1 "Edge cases":
  /// w < 1 and k < 0 are invalid).
  void validate() const {
    require(head_dim >= 1, "head_dim", head_dim, "must be >= 1");
    require(value_dim >= 1, "value_dim", value_dim, "must be >= 1");
    require(kv_heads >= 1, "kv_heads", kv_heads, "must be >= 1");
    require(query_heads >= 1 && query_heads % kv_heads == 0, "query_heads", query_heads,
            "must be a positive multiple of kv_heads (" + std::to_string(kv_heads) + ")");
    require(sinks >= 0, "sinks", sinks, "must be >= 0");
    require(window >= 1, "window", window, "must be >= 1 (the window holds the current token: a query sees itself)");
    require(top_k >= 0, "top_k", top_k, "must be >= 0");
    require(budget() <= (1L << 30), "sinks + window + top_k", budget(), "must be at most 2^30 rows");
    require(decay_interval >= 1, "decay_interval", decay_interval, "must be >= 1 (n of spec EVICTION.md §4)");
  }
};

}  // namespace kvmem
