#pragma once
// The streams of the decode tests (test_decode_step_counts.cpp, test_decode_async.cpp): a prompt of four
// chunks and 1,000 decode tokens of every sequence, for the attention memories and for Trellis, allocated
// and filled before any step so that a step only takes subviews; the configs and weights they run with.
#include <Kokkos_Random.hpp>
#include <cstdint>
#include <string>

#include <kvmem/kvmem.hpp>

#include "float_bits.hpp"

namespace kvmem_test {

using exec = Kokkos::DefaultExecutionSpace;
using mem = exec::memory_space;
using view4 = Kokkos::View<float****, Kokkos::LayoutRight, mem>;
using view3 = Kokkos::View<float***, Kokkos::LayoutRight, mem>;

constexpr long kSteps = 1000;
constexpr int kBatch = 2, kKvHeads = 2, kGroup = 2, kQueryHeads = kKvHeads * kGroup, kHeadDim = 16, kChunk = 16;
constexpr long kPrompt = 4 * kChunk;

inline view4 random4(const std::string& name, long B, long H, long T, long C, std::uint64_t seed, float lo = -1.0f,
                     float hi = 1.0f) {
  view4 v(name, B, H, T, C);
  Kokkos::Random_XorShift64_Pool<exec> pool(seed);
  Kokkos::fill_random(v, pool, lo, hi);
  return v;
}
inline view3 random3(const std::string& name, long B, long H, long T, std::uint64_t seed, float lo, float hi) {
  view3 v(name, B, H, T);
  Kokkos::Random_XorShift64_Pool<exec> pool(seed);
  Kokkos::fill_random(v, pool, lo, hi);
  return v;
}
/// Tokens [first, first + count) of a (sequence, head, token, channel) view: a subview, no allocation.
inline auto tokens(const view4& v, long first, long count) {
  return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count), Kokkos::ALL);
}
/// Tokens [first, first + count) of a (sequence, head, token) view.
inline auto gates(const view3& v, long first, long count) {
  return Kokkos::subview(v, Kokkos::ALL, Kokkos::ALL, Kokkos::pair<long, long>(first, first + count));
}

/// The prompt and the 1,000 decode tokens of every sequence for the attention memories: queries of
/// kQueryHeads heads (GQA group kGroup), keys, values and merge gates of kKvHeads kv-heads, and the output.
struct Stream {
  long T = kPrompt + kSteps;
  view4 q = random4("q", kBatch, kQueryHeads, T, kHeadDim, 1), k = random4("k", kBatch, kKvHeads, T, kHeadDim, 2),
        v = random4("v", kBatch, kKvHeads, T, kHeadDim, 3), y = view4("y", kBatch, kQueryHeads, T, kHeadDim);
  view3 gate = random3("gate", kBatch, kKvHeads, T, 4, -2.0f, 2.0f);
};

/// The same for Trellis (no GQA: H = kKvHeads heads; latent targets of kSlots slots, forget gates near 1,
/// small steps).
constexpr int kSlots = 8;
struct TrellisStream {
  long T = kPrompt + kSteps;
  view4 q = random4("trellis_q", kBatch, kKvHeads, T, kHeadDim, 11),
        k = random4("trellis_k", kBatch, kKvHeads, T, kHeadDim, 12),
        v = random4("trellis_v", kBatch, kKvHeads, T, kHeadDim, 13),
        alpha = random4("trellis_alpha", kBatch, kKvHeads, T, kSlots, 14),
        y = view4("trellis_y", kBatch, kKvHeads, T, kHeadDim);
  view3 beta1 = random3("beta1", kBatch, kKvHeads, T, 15, 0.9f, 1.0f),
        gamma1 = random3("gamma1", kBatch, kKvHeads, T, 16, 0.0f, 0.1f),
        beta2 = random3("beta2", kBatch, kKvHeads, T, 17, 0.9f, 1.0f),
        gamma2 = random3("gamma2", kBatch, kKvHeads, T, 18, 0.0f, 0.1f);
};

/// Whether the device plans a decode step and advances its counts with a kernel of its own ("kvmem::plan"
/// for a KVM or OVQ memory, "kvmem::advance" for the others): on a GPU; on a host backend the host does it
/// in the memory the kernels read.
constexpr bool device_plans = !kvmem::state::host_is_device<mem>;

inline kvmem::MemoryConfig memory_config(int window_chunks, int sinks) {
  kvmem::MemoryConfig c;
  c.head_dim = c.value_dim = kHeadDim;
  c.query_heads = kQueryHeads;
  c.kv_heads = kKvHeads;
  c.chunk = kChunk;
  c.window_chunks = window_chunks;
  c.rope_dims = 4;
  c.sinks = sinks;
  c.max_rows = 1 << 20;
  return c;
}

inline kvmem::LayerWeights<mem> unit_weights() {
  Kokkos::View<float*, mem> ones("ones", kHeadDim), zeros("zeros", kHeadDim), taus("taus", kQueryHeads);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  return {ones, zeros, taus, taus};
}

/// Random mLSTM weights of the documented shapes (spec EVICTION.md §3); their values do not change the work.
inline kvmem::score::MLstmWeights<mem> random_mlstm_weights() {
  const long X = 2 * kHeadDim, h = kHeadDim / 2;
  auto make3 = [&](const std::string& name, std::uint64_t seed) {
    Kokkos::View<float***, Kokkos::LayoutRight, mem> v(name, kKvHeads, X, h);
    Kokkos::Random_XorShift64_Pool<exec> pool(seed);
    Kokkos::fill_random(v, pool, -0.1f, 0.1f);
    return v;
  };
  auto make2 = [&](const std::string& name, long cols, std::uint64_t seed) {
    Kokkos::View<float**, Kokkos::LayoutRight, mem> v(name, kKvHeads, cols);
    Kokkos::Random_XorShift64_Pool<exec> pool(seed);
    Kokkos::fill_random(v, pool, -0.1f, 0.1f);
    return v;
  };
  auto zeros = [&](const std::string& name) { return Kokkos::View<float*, mem>(name, kKvHeads); };
  kvmem::score::MLstmWeights<mem> w;
  w.w_q = make3("w_q", 21);
  w.w_k = make3("w_k", 22);
  w.w_v = make3("w_v", 23);
  w.w_i = make2("w_i", X, 24);
  w.w_f = make2("w_f", X, 25);
  w.w_s = make2("w_s", h, 26);
  w.b_i = zeros("b_i");
  w.b_f = zeros("b_f");
  w.b_s = zeros("b_s");
  w.theta = zeros("theta");
  return w;
}

/// Elements of y[b, h, t, :] for t in [first, last) whose bits differ between the outputs `a` and `b`.
inline long differing_outputs(const view4& a, const view4& b, long first, long last) {
  const auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, a);
  const auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, b);
  long differ = 0;
  for (long s = 0; s < static_cast<long>(a.extent(0)); ++s)
    for (long h = 0; h < static_cast<long>(a.extent(1)); ++h)
      for (long t = first; t < last; ++t)
        for (long c = 0; c < static_cast<long>(a.extent(3)); ++c) differ += same_bits(ha(s, h, t, c), hb(s, h, t, c)) ? 0 : 1;
  return differ;
}

/// The attention memories the decode tests run, with the budgets that make the stream grow, regrow and
/// (with row eviction) evict: KVM with a power-law budget, OVQ with its plateau, KVM with H2O row eviction.
using KvmPowerLaw = kvmem::KvmMemory<exec, kvmem::budget::PowerLaw>;
using OvqPlateau = kvmem::OvqMemory<exec>;
using KvmRowEviction =
    kvmem::KvmMemoryWithRowEviction<exec, kvmem::budget::PowerLaw, kvmem::score::RowAccumulatedAttention>;
constexpr kvmem::budget::PowerLaw kGrowing{.min_rows = 16, .growth_factor = 4.0};
inline KvmPowerLaw kvm_power_law(const kvmem::LayerWeights<mem>& w) {
  return KvmPowerLaw(memory_config(2, 1), kGrowing, w, kBatch);
}
inline OvqPlateau ovq_plateau(const kvmem::LayerWeights<mem>& w) {
  return OvqPlateau(memory_config(1, 0), {.n = 48.0}, w, kBatch);
}
inline KvmRowEviction kvm_row_eviction(const kvmem::LayerWeights<mem>& w) {
  return KvmRowEviction(memory_config(2, 1), kGrowing, w, kBatch, kvmem::score::RowAccumulatedAttention{.max_rows = 40});
}

}  // namespace kvmem_test
