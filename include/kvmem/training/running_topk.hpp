#pragma once
/// \file running_topk.hpp
/// The Fenwick-tree running top-k of KVPOP's training masks (kvpop-paper App. C; spec EVICTION.md §5).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <numeric>
#include <span>
#include <vector>

#include "../errors.hpp"

namespace kvmem::training {

/// The attention mask the decode policy applies to one head of one sequence of S tokens, for static
/// scores and decay interval n = 1, in O(S log S) time and O(S) memory (spec EVICTION.md §5):
///   Mask[q, t] = t <= q and (t < s or q - t < w or (s <= t <= q - w and rank(t) <= threshold(q))),
/// rank(t) = position of (kappa_t, t) in decreasing order (higher key first; on equal keys the newer token
/// first), threshold(q) = the k-th smallest rank among the eligible tokens {s <= t <= q - w}: -1 when k = 0,
/// +infinity (S) when at most k are eligible. Each row holds at most s + w + k ones. Equal to the decode
/// state machine of EvictionMemory with the static key kappa (spec §4: kappa_t = score_t - t log gamma).
class RunningTopK {
 public:
  /// Builds rank and threshold for keys `kappa` [S] (float64; NaN not allowed) and the policy (s, w, k).
  /// Throws kvmem::invalid_argument for w < 1, k < 0, s < 0 or a NaN key (naming the token).
  RunningTopK(std::span<const double> kappa, int sinks, int window, int top_k)
      : sinks_(sinks), window_(window), top_k_(top_k), rank_(kappa.size()), threshold_(kappa.size()) {
    require(sinks >= 0, "sinks", sinks, "must be >= 0");
    require(window >= 1, "window", window, "must be >= 1");
    require(top_k >= 0, "top_k", top_k, "must be >= 0");
    const long S = static_cast<long>(kappa.size());
    for (long t = 0; t < S; ++t)
      require(kappa[t] == kappa[t], "kappa[" + std::to_string(t) + "]", kappa[t], "must not be NaN");
    std::vector<long> by_rank(S);
    std::iota(by_rank.begin(), by_rank.end(), 0L);
    std::sort(by_rank.begin(), by_rank.end(), [&](long a, long b) {
      return kappa[a] != kappa[b] ? kappa[a] > kappa[b] : a > b;
    });
    for (long r = 0; r < S; ++r) rank_[by_rank[r]] = r;
    // Fenwick tree over ranks (1-based): tree[i] counts inserted ranks in (i - lowbit(i), i].
    std::vector<long> tree(S + 1, 0);
    const long top = S > 0 ? static_cast<long>(std::bit_floor(static_cast<unsigned long>(S))) : 0;
    long count = 0;
    for (long q = 0; q < S; ++q) {
      const long t_new = q - window;
      if (t_new >= sinks) {
        for (long i = rank_[t_new] + 1; i <= S; i += i & -i) ++tree[i];
        ++count;
      }
      if (top_k == 0) threshold_[q] = -1;
      else if (count <= top_k) threshold_[q] = S;
      else {  // binary lifting: the largest pos with prefix count < k, so rank pos is the k-th smallest
        long pos = 0, rem = top_k;
        for (long step = top; step >= 1; step >>= 1)
          if (pos + step <= S && tree[pos + step] < rem) pos += step, rem -= tree[pos];
        threshold_[q] = pos;
      }
    }
  }

  /// Whether query q attends key t (0 <= q, t < S).
  [[nodiscard]] bool kept(long q, long t) const {
    if (t > q) return false;
    if (t < sinks_ || q - t < window_) return true;
    return rank_[t] <= threshold_[q];
  }
  /// rank(t) [S] and threshold(q) [S] of the spec.
  [[nodiscard]] std::span<const long> rank() const { return rank_; }
  [[nodiscard]] std::span<const long> threshold() const { return threshold_; }
  [[nodiscard]] long tokens() const { return static_cast<long>(rank_.size()); }

 private:
  int sinks_, window_, top_k_;
  std::vector<long> rank_, threshold_;
};

}  // namespace kvmem::training
