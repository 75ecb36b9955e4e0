#pragma once
/// \file eviction_mask.hpp
/// Training masks of the eviction policy for whole sequences (kvpop-paper App. C; spec EVICTION.md §5).

#include <Kokkos_Core.hpp>
#include <span>
#include <string>
#include <vector>

#include "../errors.hpp"
#include "../eviction_config.hpp"
#include "../kernels/eviction/eviction_scores.hpp"
#include "../policy/score/eviction_scorer.hpp"
#include "running_topk.hpp"

namespace kvmem::training {

/// The sparse attention mask that EvictionMemory<ExecSpace, Scorer> applies while decoding each sequence,
/// for every (sequence b, kv-head h), as RunningTopK objects in b-major order (index b * Hkv + h), each over
/// lengths[b] tokens: per query, which keys are cached (spec EVICTION.md §5). k [B, Hkv, T, D] and
/// v [B, Hkv, T, Dv] (float32, unit channel stride, any other strides), `lengths` [B] (each in [0, T];
/// empty: all T). O(T log T) per head after the scores (one pass of the scorer per head).
/// `scorer` is copied and bound afresh. Throws kvmem::invalid_argument for a bad config, decay_interval
/// other than 1 (the order then depends on q, spec §4 Q1), or mismatched shapes or lengths; a scorer that
/// needs attention probabilities (H2O, TOVA) is rejected at compile time: its scores are not static.
template <class ExecSpace, score::EvictionScorer Scorer, class TokensIn>
std::vector<RunningTopK> eviction_masks(const ExecSpace& exec, const EvictionConfig& cfg, Scorer scorer,
                                        const TokensIn& k, const TokensIn& v, std::span<const long> lengths = {}) {
  static_assert(!Scorer::needs_probabilities, "eviction_masks needs a static scorer (None, KeyNorm, MLstm)");
  cfg.validate();
  require(cfg.decay_interval == 1, "decay_interval", cfg.decay_interval,
          "training masks need n = 1 (with n > 1 the order depends on the query; spec EVICTION.md §4)");
  const long B = static_cast<long>(k.extent(0)), H = static_cast<long>(k.extent(1)), T = static_cast<long>(k.extent(2));
  require(H == cfg.kv_heads, "k.extent(1)", H, "must equal kv_heads = " + std::to_string(cfg.kv_heads));
  require(static_cast<long>(k.extent(3)) == cfg.head_dim, "k.extent(3)", k.extent(3),
          "must equal head_dim = " + std::to_string(cfg.head_dim));
  require(v.extent(0) == k.extent(0) && v.extent(1) == k.extent(1) && v.extent(2) == k.extent(2) &&
              static_cast<long>(v.extent(3)) == cfg.value_dim,
          "v extents", std::to_string(v.extent(0)) + " x " + std::to_string(v.extent(1)) + " x " + std::to_string(v.extent(2)) +
              " x " + std::to_string(v.extent(3)),
          "must be [B, Hkv, T] of k and value_dim = " + std::to_string(cfg.value_dim));
  require(lengths.empty() || static_cast<long>(lengths.size()) == B, "lengths.size()", lengths.size(),
          "must equal the batch size " + std::to_string(B));
  using mem = typename ExecSpace::memory_space;
  Kokkos::View<long*, mem> len("kvmem::mask_lengths", B);
  auto len_host = Kokkos::create_mirror_view(len);
  for (long b = 0; b < B; ++b) {
    len_host(b) = lengths.empty() ? T : lengths[b];
    require(len_host(b) >= 0 && len_host(b) <= T, "lengths[" + std::to_string(b) + "]", len_host(b),
            "must be in [0, T = " + std::to_string(T) + "]");
  }
  Kokkos::deep_copy(len, len_host);
  scorer.bind(B, cfg);
  scorer.reset();
  Kokkos::View<double***, Kokkos::LayoutRight, mem> scores("kvmem::mask_scores", B, H, T);
  kernels::static_scores(exec, kernels::EvictionParams::of(cfg), scorer, k, v, len, scores);
  exec.fence();
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), scores);
  std::vector<RunningTopK> masks;
  masks.reserve(B * H);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h)
      masks.emplace_back(std::span<const double>(&host(b, h, 0), len_host(b)), cfg.sinks, cfg.window, cfg.top_k);
  return masks;
}

}  // namespace kvmem::training
