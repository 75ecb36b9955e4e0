#pragma once
/// \file config.hpp
/// Runtime parameters of a memory that do not depend on the merge policy or budget schedule.

#include <cstdint>

#include "errors.hpp"

namespace kvmem {

/// Shape and window parameters of one attention layer's memory (kvm-paper Sec. 4, spec KVM.md §1-§2).
///
/// Units: `chunk` and every window length are tokens; `head_dim`/`value_dim` are channels;
/// `sinks` and `max_rows` are state rows.
struct MemoryConfig {
  int head_dim = 0;        ///< D: channels of a query and a key.
  int value_dim = 0;       ///< Dv: channels of a value.
  int query_heads = 0;     ///< Hq: query heads; a multiple of kv_heads (GQA group G = Hq / Hkv).
  int kv_heads = 0;        ///< Hkv: kv-heads, each with its own state and block sliding window.
  int chunk = 256;         ///< C: tokens per chunk; the first chunk initializes the state.
  int window_chunks = 2;   ///< n_b: chunks in the block sliding window, L = n_b * C tokens.
  int rope_dims = 64;      ///< r: leading key channels zeroed before the memory LayerNorm (0 = none).
  int sinks = 1;           ///< S: leading state rows that are never merge targets.
  long max_rows = 256;     ///< Cap on state rows (KVM code: chunk * n_max_d_chunks; OVQ: max_centroids N).
  float ln_eps = 1e-5f;    ///< epsilon of the state-key LayerNorm LN_s.
  float norm_eps = 1e-12f; ///< epsilon of the norm guards max(||x||, eps) (KVM value readout, OVQ row normalization).
  bool normalize_rows = false;  ///< OVQ `normalize_centroids`: L2-normalize a row's key and value after each fold.

  /// Block sliding window length L = window_chunks * chunk, in tokens.
  [[nodiscard]] long window() const { return static_cast<long>(window_chunks) * chunk; }
  /// GQA group size Hq / Hkv.
  [[nodiscard]] int group() const { return query_heads / kv_heads; }

  /// Throws kvmem::invalid_argument naming the first bad field. `sinks < chunk` is checked separately
  /// by check_sinks(), because sinks only matter once merges happen (spec KVM.md §9 #6).
  void validate() const {
    require(head_dim >= 1, "head_dim", head_dim, "must be >= 1");
    require(value_dim >= 1, "value_dim", value_dim, "must be >= 1");
    require(kv_heads >= 1, "kv_heads", kv_heads, "must be >= 1");
    require(query_heads >= 1, "query_heads", query_heads, "must be >= 1");
    require(query_heads % kv_heads == 0, "query_heads", query_heads,
            "must be a multiple of kv_heads (" + std::to_string(kv_heads) + ")");
    require(chunk >= 1, "chunk", chunk, "must be >= 1");
    require(window_chunks >= 1, "window_chunks", window_chunks,
            "must be >= 1 (with 0 a query would not see its own key)");
    require(rope_dims >= 0 && rope_dims <= head_dim, "rope_dims", rope_dims,
            "must be in [0, head_dim = " + std::to_string(head_dim) + "]");
    require(sinks >= 0, "sinks", sinks, "must be >= 0");
    require(max_rows >= 1, "max_rows", max_rows, "must be >= 1");
    require(ln_eps > 0.0f, "ln_eps", ln_eps, "must be > 0");
    require(norm_eps > 0.0f, "norm_eps", norm_eps, "must be > 0");
  }

  /// Merges only happen in a sequence longer than L + C tokens; there the merge needs a non-sink row,
  /// so `sinks < chunk` is required (spec KVM.md §9 #6). Throws kvmem::invalid_argument naming `sinks`.
  /// (Decode calls this every token: the message is built only when it fails, so the check allocates nothing.)
  void check_sinks(long longest_sequence) const {
    if (longest_sequence > window() + chunk && sinks >= chunk)
      throw invalid_argument(detail::describe(
          "sinks", sinks,
          "must be < chunk (" + std::to_string(chunk) + ") when a sequence is longer than window + chunk (" +
              std::to_string(window() + chunk) + " tokens), since merges then need a non-sink row"));
  }
};

}  // namespace kvmem
