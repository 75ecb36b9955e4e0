#pragma once
/// \file eviction_shadow.hpp
/// The float64 twin of an eviction memory's attention statistics (H2O, TOVA) for kvmem-soak: it follows the
/// kernel's cache token by token, recomputes each step's probabilities in float64 from the same cached keys
/// and query, and checks the kernel's statistics and eviction choices against the error bound of
/// docs/numerics.md ("Eviction statistics").

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvmem_soak {

/// gamma(m) = m u / (1 - m u), u = 2^-24: the relative error bound of m float32 roundings (Higham).
inline double gamma32(double m) {
  const double u = 0x1p-24;
  return m * u / (1.0 - m * u);
}

/// What an eviction memory's float32 arithmetic did to its float64 statistics, against the float64 twin.
/// Statistics below this are left out of the relative errors: a float32 exponential is 0 below e^-87
/// (1.6e-38) where float64's is not, a relative error of 1 that the bound's absolute term covers.
inline constexpr double kRelativeFloor = 1e-20;

struct ShadowInterval {
  double max_error = 0.0;        ///< max |stat - stat64| / stat64 over the cached rows and steps (stat64 >= 1e-20)
  double max_bound_used = 0.0;   ///< max |stat - stat64| / bound: above 1 is a violation
  double max_f32_sum_error = 0.0;  ///< H2O: max |acc32 - stat64| / stat64 of a float32 running sum (>= 1e-20)
  long violations = 0;           ///< (step, row) pairs whose statistic left the bound
  long decisions = 0;            ///< steps that evicted one token
  long differing = 0;            ///< of them, steps where float64 scores would have evicted another token
  long unexplained = 0;          ///< of those, steps where the two scores differ by more than their bounds, an
                                 ///< ineligible token left, or more than one did
  void merge(const ShadowInterval& o) {
    max_error = std::max(max_error, o.max_error);
    max_bound_used = std::max(max_bound_used, o.max_bound_used);
    max_f32_sum_error = std::max(max_f32_sum_error, o.max_f32_sum_error);
    violations += o.violations, decisions += o.decisions, differing += o.differing, unexplained += o.unexplained;
  }
};

/// The float64 twin of one (sequence, kv-head) of an EvictionMemory whose scorer reads probabilities:
/// accumulated (H2O: stat = sum over the steps that attended the token of the group's probabilities) or
/// last-query (TOVA: stat = the group's mean probability at the last step). Per cache slot it holds the
/// twin's statistic, its error bound and, for H2O, the same probabilities summed in float32.
///
/// Bound (docs/numerics.md): a step over n cached rows with G query heads, head_dim D and
/// A = max over rows and heads of sum_c |q_c k_c| / sqrt(D) gives each kernel probability a relative error
/// of at most eps = 4 gamma(D + 4) A + gamma(n + G + 10) (logit, exponential, normalizer, the group's
/// float32 sum; to first order), plus 2^-120 absolute (exponentials below e^-87 are 0). A float64 sum of N such terms
/// then differs from the twin's by at most sum eps_q p_q + N 2^-52 stat.
class EvictionShadow {
 public:
  enum class Stat { accumulated, last_query };

  EvictionShadow(Stat kind, long slots, long sinks, long window, int group, int head_dim)
      : kind_(kind), sinks_(sinks), window_(window), group_(group), dim_(head_dim),
        pos_(slots, -1), stat_(slots, 0.0), bound_(slots, 0.0), acc32_(slots, 0.0f), adds_(slots, 0),
        p64_(slots, 0.0), logits_(slots, 0.0) {}

  /// Step q, after the kernel's: live rows, order [live] (slots in position order), positions [slots], the
  /// kernel's stats [slots] and probabilities [live] (this step's, summed over the group, in order), each
  /// as an accessor f(i); key(slot) -> const float* [D], query(g) -> const float* [D].
  template <class Order, class Positions, class Stats, class Probs, class Key, class Query>
  void follow(long q, long live, const Order& order, const Positions& positions, const Stats& stats,
              const Probs& probabilities, const Key& key, const Query& query) {
    const long slots = static_cast<long>(pos_.size());
    // 1. The eviction of this step: slots whose token left (the appended token took a slot already free).
    long evicted = -1, count = 0;
    for (long s = 0; s < slots; ++s)
      if (pos_[s] >= 0 && positions(s) != pos_[s]) evicted = s, ++count;
    if (count == 1) check_decision(q, live, order, evicted);
    if (count > 1) ++interval_.decisions, ++interval_.unexplained;  // one token enters a step: one leaves
    for (long s = 0; s < slots; ++s)
      if (pos_[s] >= 0 && positions(s) != pos_[s]) pos_[s] = -1;
    // 2. This step's probabilities in float64, over the cached rows in position order, per query head.
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim_));
    double A = 0.0;
    std::fill(p64_.begin(), p64_.begin() + live, 0.0);
    std::vector<double>& logits = logits_;  // [slots] >= live: no allocation in a step
    for (int g = 0; g < group_; ++g) {
      const float* qv = query(g);
      double mx = -INFINITY;
      for (long i = 0; i < live; ++i) {
        const float* k = key(order(i));
        double d = 0.0, a = 0.0;
        for (int c = 0; c < dim_; ++c) d += double(qv[c]) * double(k[c]), a += std::abs(double(qv[c]) * double(k[c]));
        logits[i] = d * scale;
        A = std::max(A, a * scale);
        mx = std::max(mx, logits[i]);
      }
      double sum = 0.0;
      for (long i = 0; i < live; ++i) sum += (logits[i] = std::exp(logits[i] - mx));
      for (long i = 0; i < live; ++i) p64_[i] += logits[i] / sum;
    }
    const double eps = 4.0 * gamma32(dim_ + 4) * A + gamma32(static_cast<double>(live + group_ + 10));
    // 3. The twin's statistics, their bounds, and the kernel's against them.
    ShadowInterval& r = interval_;
    for (long i = 0; i < live; ++i) {
      const long s = order(i);
      if (pos_[s] != positions(s)) {  // a token new to this slot
        pos_[s] = positions(s);
        stat_[s] = bound_[s] = 0.0, acc32_[s] = 0.0f, adds_[s] = 0;
      }
      const double p = p64_[i], slack = eps * p + 0x1p-120;
      if (kind_ == Stat::accumulated) {
        stat_[s] += p, bound_[s] += slack, ++adds_[s];
        acc32_[s] += static_cast<float>(probabilities(i));
      } else {
        stat_[s] = p / group_, bound_[s] = slack / group_, adds_[s] = 1;
      }
      const double want = stat_[s], err = std::abs(stats(s) - want);
      const double bound = bound_[s] + static_cast<double>(adds_[s]) * 0x1p-52 * want;
      if (!(err <= bound)) ++r.violations;
      if (want >= kRelativeFloor) {
        r.max_error = std::max(r.max_error, err / want);
        if (kind_ == Stat::accumulated)
          r.max_f32_sum_error = std::max(r.max_f32_sum_error, std::abs(double(acc32_[s]) - want) / want);
      }
      r.max_bound_used = std::max(r.max_bound_used, bound > 0.0 ? err / bound : (err > 0.0 ? INFINITY : 0.0));
    }
  }

  /// What happened since the last call (then cleared).
  ShadowInterval take() {
    ShadowInterval r = interval_;
    interval_ = {};
    return r;
  }

 private:
  /// The kernel evicted the token of slot `evicted` at step q, before attending: the float64 scores (the
  /// twin's statistics before this step) of the tokens in the retained range then (spec EVICTION.md §1:
  /// positions in [sinks, q - window]) would evict their lowest, the older on a tie. A different choice is
  /// explained when the two scores lie within their bounds of each other.
  template <class Order>
  void check_decision(long q, long live, const Order& order, long evicted) {
    ++interval_.decisions;
    auto eligible = [&](long s) { return pos_[s] >= sinks_ && q - pos_[s] >= window_; };
    auto lower = [&](long a, long b) { return stat_[a] != stat_[b] ? stat_[a] < stat_[b] : pos_[a] < pos_[b]; };
    if (!eligible(evicted)) {  // a sink or a window token: never the policy's choice
      ++interval_.differing, ++interval_.unexplained;
      return;
    }
    long best = evicted;
    for (long i = 0; i < live; ++i) {
      const long s = order(i);
      if (pos_[s] >= 0 && pos_[s] < q && eligible(s) && lower(s, best)) best = s;
    }
    if (best == evicted) return;
    ++interval_.differing;
    const double gap = stat_[evicted] - stat_[best];
    const double allowed = bound_[evicted] + bound_[best] +
                           static_cast<double>(adds_[evicted] + adds_[best]) * 0x1p-52 * stat_[evicted];
    if (!(gap <= allowed)) ++interval_.unexplained;
  }

  Stat kind_;
  long sinks_, window_;
  int group_, dim_;
  std::vector<long> pos_;       ///< the token each slot held at the last step, -1 for none
  std::vector<double> stat_;    ///< the twin's statistic of that token
  std::vector<double> bound_;   ///< its error bound (sum of eps_q p_q)
  std::vector<float> acc32_;    ///< H2O: the kernel's probabilities summed in float32
  std::vector<long> adds_;      ///< probabilities summed into it
  std::vector<double> p64_, logits_;
  ShadowInterval interval_;
};

}  // namespace kvmem_soak
