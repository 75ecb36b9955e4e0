#pragma once
/// \file mlstm_twin.hpp
/// The float64 twin of KVPOP's float32 mLSTM scorer for kvmem-soak: the same recurrence
/// (kvmem::score::MLstm with Real = double, on the same weights) absorbs every token of the stream beside
/// the memory, scores each token as it leaves the window, and compares the kernel's score and eviction
/// choice with its own (docs/numerics.md, "Eviction statistics").

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <vector>

#include <kvmem/kvmem.hpp>

namespace kvmem_soak {

/// What the float32 mLSTM did against its float64 twin.
struct MLstmInterval {
  double max_error = 0.0;  ///< max |score - score64| / (1 + |score64|) over the scored tokens
  long decisions = 0;      ///< steps that evicted one token
  long differing = 0;      ///< of them, steps where float64 effective scores would have evicted another token
  double max_gap = 0.0;    ///< the largest float64 effective-score gap of such a step, in units of max_error
  long invalid = 0;        ///< steps that evicted an ineligible token (a sink, the window) or more than one
  void merge(const MLstmInterval& o) {
    max_error = std::max(max_error, o.max_error);
    max_gap = std::max(max_gap, o.max_gap);
    decisions += o.decisions, differing += o.differing, invalid += o.invalid;
  }
};

/// Follows one (sequence, kv-head) of an EvictionMemory<..., score::MLstm<Space>> (float32) with
/// score::MLstm<HostSpace, double> on host copies of the same weights. Per cache slot it holds the
/// twin's score of the token there (NaN until the token leaves the window).
class MLstmTwin {
 public:
  MLstmTwin(const kvmem::score::MLstmWeights<Kokkos::HostSpace>& weights, const kvmem::EvictionConfig& cfg)
      : twin_(weights), params_(kvmem::kernels::EvictionParams::of(cfg)), window_(cfg.window), sinks_(cfg.sinks),
        D_(cfg.head_dim), Dv_(cfg.value_dim), slots_(cfg.budget() + 1), ring_(cfg.window * (cfg.head_dim + cfg.value_dim)),
        pos_(slots_, -1), score_(slots_, NAN) {
    twin_.bind(1, cfg);
    twin_.reset();
  }

  /// Step q after the kernel's: key [D] and value [Dv] of token q (as the memory received them); the
  /// kernel's positions [slots] and stats [slots] (accessors f(slot)).
  template <class Positions, class Stats>
  void follow(long q, const float* key, const float* value, const Positions& positions, const Stats& stats) {
    // 1. The kernel's eviction of this step against the twin's effective scores (before this step's score:
    //    the token scored now is in the window and not eligible).
    long evicted = -1, count = 0;
    for (long s = 0; s < slots_; ++s)
      if (pos_[s] >= 0 && positions(s) != pos_[s]) evicted = s, ++count;
    if (count == 1) check_decision(q, evicted);
    if (count > 1) ++interval_.decisions, ++interval_.invalid;  // one token enters a step: one leaves
    for (long s = 0; s < slots_; ++s) {
      if (pos_[s] >= 0 && positions(s) != pos_[s]) pos_[s] = -1, score_[s] = NAN;
      if (positions(s) == q) pos_[s] = q, score_[s] = NAN;
    }
    // 2. Absorb token q; score u = q - w + 1 from the state after token q (spec EVICTION.md §2).
    float* x = &ring_[(q % window_) * (D_ + Dv_)];
    std::copy(key, key + D_, x);
    std::copy(value, value + Dv_, x + D_);
    twin_.absorb(0, 0, q, x, x + D_);
    const long u = q - window_ + 1;
    if (u < sinks_ || u < 0) return;
    const float* xu = &ring_[(u % window_) * (D_ + Dv_)];
    const double want = twin_.delayed_score(0, 0, u, xu, xu + D_);
    for (long s = 0; s < slots_; ++s)
      if (pos_[s] == u) {
        score_[s] = want;
        const double err = std::abs(stats(s) - want) / (1.0 + std::abs(want));
        interval_.max_error = std::max(interval_.max_error, err);
        seen_error_ = std::max(seen_error_, err);
      }
  }

  /// What happened since the last call (then cleared).
  MLstmInterval take() {
    MLstmInterval r = interval_;
    interval_ = {};
    return r;
  }

 private:
  double effective(long s, long q) const {
    return kvmem::kernels::effective_score(twin_, params_, score_[s], pos_[s], q, 0);
  }
  /// The tokens in step q's retained range (positions in [sinks, q - window], scored) would evict the one
  /// of lowest float64 effective score, the older on a tie.
  void check_decision(long q, long evicted) {
    ++interval_.decisions;
    auto eligible = [&](long s) { return pos_[s] >= sinks_ && q - pos_[s] >= window_ && !std::isnan(score_[s]); };
    if (!eligible(evicted)) {  // a sink, a window token or one never scored: never the policy's choice
      ++interval_.invalid;
      return;
    }
    long best = evicted;
    for (long s = 0; s < slots_; ++s) {
      if (!eligible(s)) continue;
      const double a = effective(s, q), b = effective(best, q);
      if (a < b || (a == b && pos_[s] < pos_[best])) best = s;
    }
    if (best == evicted) return;
    ++interval_.differing;
    const double gap = (effective(evicted, q) - effective(best, q)) / (1.0 + std::abs(effective(best, q)));
    interval_.max_gap = std::max(interval_.max_gap, seen_error_ > 0.0 ? gap / seen_error_ : INFINITY);
  }

  kvmem::score::MLstm<Kokkos::HostSpace, double> twin_;
  kvmem::kernels::EvictionParams params_;
  long window_, sinks_;
  int D_, Dv_;
  long slots_;
  std::vector<float> ring_;     ///< the last `window` tokens' [k ; v], by position mod window
  std::vector<long> pos_;       ///< the token each slot held at the last step, -1 for none
  std::vector<double> score_;   ///< the twin's score of that token, NaN until scored
  MLstmInterval interval_;
  double seen_error_ = 0.0;     ///< the largest score error seen so far
};

}  // namespace kvmem_soak
