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
/// budget is B = sinks + window + top_k rows. `decay_interval`, `chunk` and `observation_window` are tokens
/// (queries). `head_dim` and `value_dim` are channels.
///
/// When the memory evicts (docs/eviction.md "Compression per chunk and at the end of a prompt"):
/// - `chunk = 1` (the default): at every token, the streaming eviction of spec EVICTION.md §1;
/// - `chunk = C > 1`: once per chunk of C positions ([iC, (i+1)C) from the sequence's start, whatever the
///   calls): at the chunk's first token the memory evicts down to the budget, scored by the statistics that
///   the previous chunk's last `observation_window` queries gave (SnapKV's observation window; H2O, TOVA
///   and KNorm alike); the chunk's other tokens only append and attend. It holds at most B + C rows;
/// - `chunk = 0`: at the end of the prompt (kvpress's presses, SnapKV): prefill() and extend() only append
///   and attend (exact attention over what the memory holds and the prompt), their last
///   `observation_window` queries of each call score the tokens, and the first decode() step evicts down
///   to the budget; every decode step then evicts as the streaming memory does. It holds at most B + 1 +
///   the prompt's tokens (the rows grow at prefill()).
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
  /// C >= 0: positions per chunk between compressions; 1 streams (every token), 0 compresses at the end
  /// of the prompt (see above).
  int chunk = 1;
  /// W_obs >= 0: the last queries of each chunk (chunk = 0: of each prefill or extend call) whose attention
  /// updates the scorer's statistics (SnapKV's observation window; kvpress uses 64); 0: every query of the
  /// chunk. With chunk = 1 every query observes, whatever its value; with chunk C > 1 it is at most C; with
  /// chunk = 0 a prompt into a sequence that holds nothing must have at least W_obs tokens (a later piece of
  /// a prompt, or a second turn's, may be shorter: all of its queries observe).
  int observation_window = 64;

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
    require(chunk >= 0, "chunk", chunk, "must be >= 0 (1: every token, 0: at the end of the prompt)");
    require(budget() + chunk <= (1L << 30), "sinks + window + top_k + chunk", budget() + chunk, "must be at most 2^30 rows");
    require(observation_window >= 0, "observation_window", observation_window, "must be >= 0 (0: every query of a chunk)");
    require(chunk <= 1 || observation_window <= chunk, "observation_window", observation_window,
            "must be at most chunk = " + std::to_string(chunk) + " (the chunk's last queries observe; 0: all of them)");
  }
};

}  // namespace kvmem
