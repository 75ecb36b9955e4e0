/// \file custom_policy.cpp
/// Writing your own merge policy: an exponential-moving-average merge, composed with OVQ's plateau
/// budget and KVM's novelty scorer — a memory no paper tried — and measured against exact attention.
///
/// The policy derives from kvmem::merge::Defaults and overrides only what differs. The compiler checks it
/// against the kvmem::merge::MergePolicy concept; docs/writing-a-policy.md walks through every hook.

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <kvmem/kvmem.hpp>

/// Each routed token pulls its row toward itself by a fixed fraction: row <- (1 - rate) row + rate token.
/// Rows remember recent tokens more than old ones, unlike KVM's sums or OVQ's means.
struct ExponentialMovingAverage : kvmem::merge::Defaults {
  static constexpr std::string_view name = "ema";
  static constexpr bool first_chunk_verbatim = true;  // the first chunk's tokens become rows as they arrive
  static constexpr float rate = 0.25f;

  KOKKOS_INLINE_FUNCTION static void fold(const kvmem::MemoryConfig& cfg, const kvmem::merge::Row& row,
                                          const float* key, const float* value, float /*gate*/) {
    for (int c = 0; c < cfg.head_dim; ++c) row.key[c] += rate * (key[c] - row.key[c]);
    for (int c = 0; c < cfg.value_dim; ++c) row.value[c] += rate * (value[c] - row.value[c]);
  }
};
static_assert(kvmem::merge::MergePolicy<ExponentialMovingAverage>);

int main() {
  Kokkos::ScopeGuard guard;
  using exec = Kokkos::DefaultHostExecutionSpace;
  using space = exec::memory_space;
  using view4 = Kokkos::View<float****, Kokkos::LayoutRight, space>;

  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = 32;
  cfg.query_heads = cfg.kv_heads = 2;
  cfg.chunk = 32;
  cfg.window_chunks = 2;
  cfg.rope_dims = 0;
  cfg.sinks = 1;
  cfg.max_rows = 128;
  const long T = 1024;

  // Keys drawn around 16 topics so that merging has structure to find.
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  view4 q("q", 1, 2, T, 32), k("k", 1, 2, T, 32), v("v", 1, 2, T, 32), y("y", 1, 2, T, 32), exact("exact", 1, 2, T, 32);
  std::vector<float> topics(16 * 32);
  for (auto& x : topics) x = normal(rng);
  for (long h = 0; h < 2; ++h)
    for (long t = 0; t < T; ++t) {
      const long topic = std::uniform_int_distribution<long>(0, 15)(rng);
      for (long c = 0; c < 32; ++c) {
        k(0, h, t, c) = topics[topic * 32 + c] + 0.3f * normal(rng);
        q(0, h, t, c) = topics[topic * 32 + c] + 0.3f * normal(rng);
        v(0, h, t, c) = normal(rng);
      }
    }
  Kokkos::View<float*, space> tau("tau", 2);
  Kokkos::deep_copy(tau, 1.0f);

  kvmem::Memory<exec, ExponentialMovingAverage, kvmem::budget::Plateau, kvmem::score::Novelty> memory(
      cfg, kvmem::budget::Plateau{128}, {{}, {}, tau, tau}, 1);
  memory.prefill(q, k, v, {}, y);
  kvmem::kernels::exact_causal_attention(exec(), q, k, v, exact);

  double err = 0.0, norm = 0.0;
  for (long h = 0; h < 2; ++h)
    for (long t = 0; t < T; ++t)
      for (long c = 0; c < 32; ++c) {
        err += std::pow(y(0, h, t, c) - exact(0, h, t, c), 2);
        norm += std::pow(exact(0, h, t, c), 2);
      }
  const long full = T * 2 * 64 * 4;
  std::printf("ema x plateau x novelty: %ld tokens -> %ld state rows + %ld window tokens\n", T, memory.cursor(0).rows,
              memory.window_tokens(0));
  std::printf("memory held %ld bytes = %.1f%% of the full KV cache; relative L2 error vs exact attention %.4f\n",
              memory.held_bytes(), 100.0 * memory.held_bytes() / full, std::sqrt(err / norm));
  return memory.cursor(0).rows > 0 && std::isfinite(err) ? 0 : 1;
}
