#pragma once
/// \file eviction_cache.hpp
/// Device storage of a fixed-budget eviction cache: B + 1 row slots per (sequence, kv-head) and the list of
/// cached tokens in position order (spec EVICTION.md §1 "Physical layout").

#include <Kokkos_Core.hpp>
#include <type_traits>

#include "../dtype.hpp"

namespace kvmem::state {

/// The cache of a batch, LayoutRight. Per (sequence b, kv-head h), `slots` = budget + 1 rows (a step holds
/// B + 1 tokens between its append and its eviction):
/// - `keys` [B, Hkv, slots, D], `values` [B, Hkv, slots, Dv]: key and value of the token in a slot, in the
///   memory's storage type T (kvmem/dtype.hpp), as the input gave them;
/// - `positions` [B, Hkv, slots]: its position (tokens since the start of the sequence), -1 for a free slot;
/// - `stats` [B, Hkv, slots]: the scorer's float64 statistic of the token (score, accumulated attention);
/// - `order` [B, Hkv, slots]: slots of the cached tokens in increasing position, entries [0, live);
/// - `shift` [B, Hkv, slots]: scratch of a team that closes the gap an eviction leaves in `order`;
/// - `counts` [B, Hkv, slots] float32: tokens a row holds (1 when its token enters, more once evicted rows
///   merge into it), only for a merging eviction (EvictionConfig::merge_evicted), else empty; a merged row's
///   `keys` and `values` are the count-weighted means of its tokens', rounded to T;
/// - `live` [B, Hkv]: cached tokens (rows), at most the budget after every step;
/// - `logits` [B, Hkv, slots] and `probabilities` [B, Hkv, slots] float32: per-step scratch of the readout
///   (a row's weights, then the probabilities summed over the group's query heads, only for scorers that
///   need probabilities, else empty);
/// - `pooled` [B, Hkv, slots] float64: a compression's scratch of pooled statistics, only for a scorer that
///   pools (score::pool_width > 1: SnapKV), else empty.
/// A slot's row is written when its token enters and freed when it is evicted: nothing moves in between.
/// `slots` is budget + 1 for a streaming memory, budget + chunk with EvictionConfig::chunk > 1, and grows
/// with the prompt at chunk = 0 (grow()).
template <class MemorySpace, StorageType T = float>
struct EvictionCache {
  using storage_type = T;
  Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace> keys, values;
  Kokkos::View<long***, Kokkos::LayoutRight, MemorySpace> positions;
  Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> stats;
  Kokkos::View<int***, Kokkos::LayoutRight, MemorySpace> order, shift;
  Kokkos::View<long**, Kokkos::LayoutRight, MemorySpace> live;
  Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> logits, probabilities, counts;
  Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> pooled;

  /// Allocates an empty cache (every slot free) of `slots` rows per (sequence, kv-head); `with_counts`
  /// allocates the merge counts, `with_pooled` the pooling scratch.
  void allocate(long batch, int kv_heads, long slots, int head_dim, int value_dim, bool with_probabilities,
                bool with_counts = false, bool with_pooled = false) {
    keys = decltype(keys)("kvmem::evict_keys", batch, kv_heads, slots, head_dim);
    values = decltype(values)("kvmem::evict_values", batch, kv_heads, slots, value_dim);
    positions = decltype(positions)("kvmem::evict_positions", batch, kv_heads, slots);
    stats = decltype(stats)("kvmem::evict_stats", batch, kv_heads, slots);
    order = decltype(order)("kvmem::evict_order", batch, kv_heads, slots);
    shift = decltype(shift)("kvmem::evict_shift", batch, kv_heads, slots);
    live = decltype(live)("kvmem::evict_live", batch, kv_heads);
    logits = decltype(logits)("kvmem::evict_logits", batch, kv_heads, slots);
    if (with_probabilities) probabilities = decltype(probabilities)("kvmem::evict_probs", batch, kv_heads, slots);
    if (with_counts) counts = decltype(counts)("kvmem::evict_counts", batch, kv_heads, slots);
    if (with_pooled) pooled = decltype(pooled)("kvmem::evict_pooled", batch, kv_heads, slots);
    Kokkos::deep_copy(positions, -1L);
  }

  /// Grows every per-slot view to `n` slots per (sequence, kv-head), keeping what the first slots() hold
  /// (rows, positions, statistics, order, counts) and marking the new slots free. Nothing when n <= slots().
  /// Every new view is allocated before any is replaced, so an allocation that throws leaves the cache as it
  /// was. Fences `exec`. The views move: a CUDA graph captured before holds the old addresses (capture
  /// again, or reserve the rows first: EvictionMemory::reserve_prompt).
  template <class ExecSpace>
  void grow(const ExecSpace& exec, long n) {
    const long old = slots();
    if (n <= old) return;
    exec.fence();
    const auto B = positions.extent(0), H = positions.extent(1);
    const auto kept = Kokkos::pair<long, long>(0, old);
    auto grown3 = [&](const auto& view) {  // a view of n slots holding the first `old` of `view`
      std::remove_cvref_t<decltype(view)> out;
      if (view.size() == 0) return out;
      out = decltype(out)(view.label(), B, H, n);
      Kokkos::deep_copy(Kokkos::subview(out, Kokkos::ALL, Kokkos::ALL, kept), view);
      return out;
    };
    auto grown4 = [&](const auto& view) {
      std::remove_cvref_t<decltype(view)> out(view.label(), B, H, n, view.extent(3));
      Kokkos::deep_copy(Kokkos::subview(out, Kokkos::ALL, Kokkos::ALL, kept, Kokkos::ALL), view);
      return out;
    };
    auto k = grown4(keys);
    auto v = grown4(values);
    auto pos = grown3(positions);
    auto st = grown3(stats);
    auto ord = grown3(order);
    auto sh = grown3(shift);
    auto lg = grown3(logits), pr = grown3(probabilities), ct = grown3(counts);
    auto pl = grown3(pooled);
    Kokkos::deep_copy(Kokkos::subview(pos, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(old, n)), -1L);
    Kokkos::fence();
    keys = k, values = v, positions = pos, stats = st, order = ord, shift = sh;
    logits = lg, probabilities = pr, counts = ct, pooled = pl;
  }
  /// Row slots per (sequence, kv-head).
  [[nodiscard]] long slots() const { return static_cast<long>(positions.extent(2)); }
};

}  // namespace kvmem::state
