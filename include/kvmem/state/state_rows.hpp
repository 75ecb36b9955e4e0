#pragma once
/// \file state_rows.hpp
/// Device storage of the state rows of every (sequence, kv-head), with their readout caches.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <type_traits>

#include "../dtype.hpp"
#include "../policy/merge/row.hpp"

namespace kvmem::state {

/// State rows of a batch, LayoutRight (spec KVM.md §2 "State"). The merge accumulators (keys, values,
/// radius, counts, stats) are float32 whatever the memory's storage type T; the read caches, which every
/// readout streams, are held in T (docs/numerics.md):
/// - `keys`        [B, Hkv, capacity, D]  running sums K_i of gated memory keys (not normalized)
/// - `values`      [B, Hkv, capacity, Dv] running sums V_i of gated values
/// - `radius`      [B, Hkv, capacity]     rho_i, the value radius fixed when the row was created (KVM)
/// - `counts`      [B, Hkv, capacity]     tokens folded into the row (OVQ's k-means counts)
/// - `read_keys`   [B, Hkv, capacity, D]  LN_s(K_i) in T, refreshed after every change of K_i
/// - `read_values` [B, Hkv, capacity, Dv] rho_i * V_i / max(||V_i||, eps) in T, refreshed likewise
/// - `stats`       [B, Hkv, capacity]     float64 row-eviction statistic (score::RowEviction; allocated
///                                        only when rows are evicted)
/// - `decision_keys` [B, Hkv, capacity, D] LN_s(K_i) in float32 for a 16-bit T (empty for float, whose
///                                        read_keys are float32): the keys the update scores and routes
///                                        against, so that a 16-bit memory makes the float32 memory's merge
///                                        decisions and keeps its sums bit for bit (docs/numerics.md)
/// Rows [0, rows) of a (sequence, kv-head) are live; `rows` is tracked on the host (SequenceCursor).
/// `capacity` grows by doubling on the host (grow()), never inside a kernel.
template <class MemorySpace, StorageType T = float>
struct StateRows {
  using storage_type = T;
  using matrix4 = Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace>;
  using matrix3 = Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace>;
  using read4 = Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace>;
  matrix4 keys, values, decision_keys;
  read4 read_keys, read_values;
  matrix3 radius, counts;
  Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> stats;

  /// Allocates zeroed rows for `batch` sequences x `kv_heads` kv-heads x `capacity` rows.
  void allocate(int batch, int kv_heads, long capacity, int head_dim, int value_dim) {
    keys = matrix4("kvmem::state_keys", batch, kv_heads, capacity, head_dim);
    values = matrix4("kvmem::state_values", batch, kv_heads, capacity, value_dim);
    read_keys = read4("kvmem::state_read_keys", batch, kv_heads, capacity, head_dim);
    read_values = read4("kvmem::state_read_values", batch, kv_heads, capacity, value_dim);
    radius = matrix3("kvmem::state_radius", batch, kv_heads, capacity);
    counts = matrix3("kvmem::state_counts", batch, kv_heads, capacity);
    if constexpr (!std::is_same_v<T, float>)
      decision_keys = matrix4("kvmem::state_decision_keys", batch, kv_heads, capacity, head_dim);
  }
  /// Allocates the zeroed row-eviction statistics (same rows as the state).
  void allocate_stats() {
    stats = decltype(stats)("kvmem::state_stats", keys.extent(0), keys.extent(1), keys.extent(2));
  }
  /// Rows allocated per (sequence, kv-head).
  [[nodiscard]] long capacity() const { return static_cast<long>(keys.extent(2)); }
  /// Makes room for at least `rows` rows per (sequence, kv-head), keeping the live rows (host call).
  void grow(long rows) {
    if (rows <= capacity()) return;
    const long cap = std::max(rows, 2 * capacity());
    const auto b = keys.extent(0), h = keys.extent(1);
    Kokkos::resize(keys, b, h, cap, keys.extent(3));
    Kokkos::resize(values, b, h, cap, values.extent(3));
    Kokkos::resize(read_keys, b, h, cap, read_keys.extent(3));
    Kokkos::resize(read_values, b, h, cap, read_values.extent(3));
    if (decision_keys.data() != nullptr) Kokkos::resize(decision_keys, b, h, cap, decision_keys.extent(3));
    Kokkos::resize(radius, b, h, cap);
    Kokkos::resize(counts, b, h, cap);
    if (stats.data() != nullptr) Kokkos::resize(stats, b, h, cap);
  }
  /// The float32 key [D] of row i that scores and routes compare with: LN_s(K_i) unrounded, whatever T.
  KOKKOS_INLINE_FUNCTION const float* decision_key(long b, long h, long i) const {
    if constexpr (std::is_same_v<T, float>)
      return &read_keys(b, h, i, 0);
    else
      return &decision_keys(b, h, i, 0);
  }
  /// Refreshes the read caches of row i from its sums (Merge::read_key, Merge::read_value): computed in
  /// float32 and stored in T, the float32 key also kept as the decision key when T is 16-bit.
  template <class Merge, class Config, class Weights>
  KOKKOS_INLINE_FUNCTION void refresh(const Config& cfg, const Weights& w, long b, long h, long i) const {
    const merge::Row r = row(b, h, i);
    if constexpr (std::is_same_v<T, float>) {
      Merge::read_key(cfg, w, r, &read_keys(b, h, i, 0));
    } else {
      float* key = &decision_keys(b, h, i, 0);
      Merge::read_key(cfg, w, r, key);
      for (int c = 0; c < cfg.head_dim; ++c) read_keys(b, h, i, c) = from_float<T>(key[c]);
    }
    Merge::read_value(cfg, r, &read_values(b, h, i, 0));
  }
  /// Row i of kv-head h of sequence b as the merge hooks see it.
  KOKKOS_INLINE_FUNCTION merge::Row row(long b, long h, long i) const {
    return {&keys(b, h, i, 0), &values(b, h, i, 0), &radius(b, h, i), &counts(b, h, i)};
  }
};

/// The block sliding window of every (sequence, kv-head) as a ring over token positions:
/// token p lives in slot p % slots, slots = L + C, enough for the window [window_begin(n), n) plus the
/// overflow block still being merged (spec KVM.md §6: up to L + 1 tokens right before a drop).
/// - `keys` [B, Hkv, slots, D] raw (RoPE'd) keys as Merge::window_key stored them; `values` [B, Hkv, slots,
///   Dv]; both in the memory's storage type T; `gates` [B, Hkv, slots] merge-gate pre-activations z
///   (float32).
template <class MemorySpace, StorageType T = float>
struct WindowRing {
  using storage_type = T;
  using matrix4 = Kokkos::View<T****, Kokkos::LayoutRight, MemorySpace>;
  using matrix3 = Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace>;
  matrix4 keys, values;
  matrix3 gates;

  void allocate(int batch, int kv_heads, long slots, int head_dim, int value_dim) {
    keys = matrix4("kvmem::window_keys", batch, kv_heads, slots, head_dim);
    values = matrix4("kvmem::window_values", batch, kv_heads, slots, value_dim);
    gates = matrix3("kvmem::window_gates", batch, kv_heads, slots);
  }
  [[nodiscard]] KOKKOS_INLINE_FUNCTION long slots() const { return static_cast<long>(keys.extent(2)); }
  [[nodiscard]] KOKKOS_INLINE_FUNCTION long slot(long position) const { return position % slots(); }
  /// slot(first + j) for 0 <= j < slots(), given first_slot = slot(first): one compare instead of a
  /// division (a readout walks the window's positions in order).
  [[nodiscard]] KOKKOS_INLINE_FUNCTION long slot_after(long first_slot, long j) const {
    const long s = first_slot + j;
    return s < slots() ? s : s - slots();
  }
};

}  // namespace kvmem::state
