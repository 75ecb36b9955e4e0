#pragma once
/// \file eviction_scorer.hpp
/// The EvictionScorer concept: which rows of a fixed-budget cache lose when it is over budget
/// (kvpop-paper Sec. 2; spec EVICTION.md §1, §2, §4, §6), and score::EvictionDefaults, its default hooks.

#include <Kokkos_Core.hpp>
#include <concepts>
#include <string_view>

#include "../../dtype.hpp"
#include "../../eviction_config.hpp"

namespace kvmem::score {

/// Default hooks of an eviction scorer. A scorer derives from this struct and replaces what it needs.
///
/// Every token of a (sequence b, kv-head h) holds one double `stat` while it is cached. The memory calls,
/// on one device thread per (b, h), in this order at every step q (spec EVICTION.md §1; a scorer may also
/// give absorb and delayed_score a form that takes the step's team as its first argument, which every
/// thread of the team then calls: kernels::TeamScorer, as score::MLstm does):
/// 1. `stat = absorb(b, h, q, key, value)` when token q enters (key [D], value [Dv], as cached);
///    stateful scorers update their state here;
/// 2. if `delayed`: `stat_u = delayed_score(b, h, u, key_u, value_u)` for the token u = q - w + 1 about to
///    leave the window (u >= sinks), read from the state after absorbing q (spec §2);
/// 3. evicts the eligible row with the lowest effective score (below), ties to the older token;
/// 4. if `needs_probabilities`: after the attention of step q,
///    `stat = attended(stat, p, G)` for every attended token, p = sum over the G query heads of the
///    group of its softmax probability (the step's float32 weights summed in float32, passed as double).
/// Effective score of token t at step q (spec §4): base = `base_score(stat, t, q, G)`, then
///   n = 1: base - t * log_decay(h)  (q * log_decay(h) is the same for every token and is left out);
///   n > 1: base + floor((q - t) / n) * log_decay(h).
/// Keys and values reach absorb and delayed_score as the memory caches them, in its storage type
/// (kvmem/dtype.hpp; the concept checks float32): a scorer used with bfloat16 or float16 storage takes them
/// as templates and reads them through kvmem::to_float, as the scorers here do.
/// Higher is better. `bind` (host) is called once by the memory with its batch size and config, and may
/// allocate state or throw kvmem::invalid_argument; `reset` (host) returns the state to that of an empty
/// cache, `reset_sequence(b)` (host) that of sequence b alone.
struct EvictionDefaults {
  /// The scorer reads attention probabilities: the memory computes them (and pays for them) only then.
  static constexpr bool needs_probabilities = false;
  /// The score is read when the token leaves the window, not at insertion (spec §2).
  static constexpr bool delayed = false;
  /// The statistic is that of one observation window: it restarts from 0 at the first observation query of
  /// each chunk (SnapKV; EvictionConfig::chunk, observation_window), where the others carry on.
  static constexpr bool windowed = false;
  /// Width of the average pooling over neighbouring eligible positions that a compression applies to the
  /// statistics before it ranks them (SnapKV's avgpool, zero pads counted); 1: none.
  static constexpr int pool = 1;
  /// log gamma of the effective score for every kv-head; 0 (no decay) for the training-free scorers
  /// unless the user opts in (spec §4).
  double log_gamma = 0.0;

  void bind(long /*batch*/, const EvictionConfig& /*cfg*/) {}
  void reset() const {}
  /// Returns the state of sequence b alone to that of an empty cache (the memory's reset_sequence(b)); the
  /// other sequences' state stays bit for bit.
  void reset_sequence(long /*b*/) const {}
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION double absorb(long, int, long, const K*, const V*) const {
    return 0.0;
  }
  template <class K, class V>
  KOKKOS_INLINE_FUNCTION double delayed_score(long, int, long, const K*, const V*) const {
    return 0.0;
  }
  KOKKOS_INLINE_FUNCTION double attended(double stat, double, int) const { return stat; }
  KOKKOS_INLINE_FUNCTION double base_score(double stat, long, long, int) const { return stat; }
  KOKKOS_INLINE_FUNCTION double log_decay(int) const { return log_gamma; }
  /// Every kv-head of a sequence evicts the same token (the lowest effective score summed over the
  /// kv-heads) instead of its own: the original TOVA's layer mean (spec §6). False: per kv-head.
  KOKKOS_INLINE_FUNCTION bool layer_wide() const { return false; }
};

/// Scorer::windowed, false for a scorer without it (EvictionDefaults::windowed).
template <class S>
inline constexpr bool windowed_statistic = [] {
  if constexpr (requires { S::windowed; }) return static_cast<bool>(S::windowed);
  else return false;
}();
/// Scorer::pool, 1 for a scorer without it (EvictionDefaults::pool).
template <class S>
inline constexpr int pool_width = [] {
  if constexpr (requires { S::pool; }) return static_cast<int>(S::pool);
  else return 1;
}();

/// An eviction scorer: a copyable value type (copied into kernels; state lives in Kokkos views it owns)
/// with `name`, the flags `needs_probabilities` and `delayed`, and the hooks of EvictionDefaults.
template <class S>
concept EvictionScorer =
    std::copy_constructible<S> &&
    requires(S s, const S cs, long b, int h, long t, const float* x, double stat, int g, const EvictionConfig& cfg) {
      { S::name } -> std::convertible_to<std::string_view>;
      { S::needs_probabilities } -> std::convertible_to<bool>;
      { S::delayed } -> std::convertible_to<bool>;
      s.bind(b, cfg);
      cs.reset();
      cs.reset_sequence(b);
      { cs.absorb(b, h, t, x, x) } -> std::same_as<double>;
      { cs.delayed_score(b, h, t, x, x) } -> std::same_as<double>;
      { cs.attended(stat, stat, g) } -> std::same_as<double>;
      { cs.base_score(stat, t, t, g) } -> std::same_as<double>;
      { cs.log_decay(h) } -> std::same_as<double>;
      { cs.layer_wide() } -> std::convertible_to<bool>;
    };

}  // namespace kvmem::score
