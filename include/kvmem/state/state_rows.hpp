#pragma once
/// \file state_rows.hpp
/// Device storage of the state rows of every (sequence, kv-head), with their readout caches.

#include <Kokkos_Core.hpp>
#include <algorithm>

#include "../policy/merge/row.hpp"

namespace kvmem::state {

/// State rows of a batch, LayoutRight, float32 (spec KVM.md §2 "State"):
/// - `keys`        [B, Hkv, capacity, D]  running sums K_i of gated memory keys (not normalized)
/// - `values`      [B, Hkv, capacity, Dv] running sums V_i of gated values
/// - `radius`      [B, Hkv, capacity]     rho_i, the value radius fixed when the row was created (KVM)
/// - `counts`      [B, Hkv, capacity]     tokens folded into the row (OVQ's k-means counts)
/// - `read_keys`   [B, Hkv, capacity, D]  LN_s(K_i), refreshed after every change of K_i
/// - `read_values` [B, Hkv, capacity, Dv] rho_i * V_i / max(||V_i||, eps), refreshed likewise
/// - `stats`       [B, Hkv, capacity]     float64 row-eviction statistic (score::RowEviction; allocated
///                                        only when rows are evicted)
/// Rows [0, rows) of a (sequence, kv-head) are live; `rows` is tracked on the host (SequenceCursor).
/// `capacity` grows by doubling on the host (grow()), never inside a kernel.
template <class MemorySpace>
struct StateRows {
  using matrix4 = Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace>;
  using matrix3 = Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace>;
  matrix4 keys, values, read_keys, read_values;
  matrix3 radius, counts;
  Kokkos::View<double***, Kokkos::LayoutRight, MemorySpace> stats;

  /// Allocates zeroed rows for `batch` sequences x `kv_heads` kv-heads x `capacity` rows.
  void allocate(int batch, int kv_heads, long capacity, int head_dim, int value_dim) {
    keys = matrix4("kvmem::state_keys", batch, kv_heads, capacity, head_dim);
    values = matrix4("kvmem::state_values", batch, kv_heads, capacity, value_dim);
    read_keys = matrix4("kvmem::state_read_keys", batch, kv_heads, capacity, head_dim);
    read_values = matrix4("kvmem::state_read_values", batch, kv_heads, capacity, value_dim);
    radius = matrix3("kvmem::state_radius", batch, kv_heads, capacity);
    counts = matrix3("kvmem::state_counts", batch, kv_heads, capacity);
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
    Kokkos::resize(radius, b, h, cap);
    Kokkos::resize(counts, b, h, cap);
    if (stats.data() != nullptr) Kokkos::resize(stats, b, h, cap);
  }
  /// Row i of kv-head h of sequence b as the merge hooks see it.
  KOKKOS_INLINE_FUNCTION merge::Row row(long b, long h, long i) const {
    return {&keys(b, h, i, 0), &values(b, h, i, 0), &radius(b, h, i), &counts(b, h, i)};
  }
};

/// The block sliding window of every (sequence, kv-head) as a ring over token positions:
/// token p lives in slot p % slots, slots = L + C, enough for the window [window_begin(n), n) plus the
/// overflow block still being merged (spec KVM.md §6: up to L + 1 tokens right before a drop).
/// - `keys` [B, Hkv, slots, D] raw (RoPE'd) keys; `values` [B, Hkv, slots, Dv]; `gates` [B, Hkv, slots]
///   merge-gate pre-activations z.
template <class MemorySpace>
struct WindowRing {
  using matrix4 = Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace>;
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
};

}  // namespace kvmem::state
