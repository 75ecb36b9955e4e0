/// \file eviction.cpp
/// Fixed-budget eviction two ways, on an engine's [tokens, heads, head_dim] buffers without copies:
/// 1. EvictionMemory with H2O (sinks + window + top-k, accumulated attention), prefill then decode, and the
///    positions it keeps;
/// 2. KVM merging whose state rows are also evicted by H2O above a cap (KvmMemoryWithRowEviction), next to
///    plain KVM under the same growing budget: the rows stay at the cap.

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <random>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "engine_buffers.hpp"

int main() {
  Kokkos::ScopeGuard guard;
  using exec = Kokkos::DefaultHostExecutionSpace;
  using example::wrap;
  const long prompt = 2000, generated = 200, T = prompt + generated;
  const int D = 64, Hq = 8, Hkv = 2;
  std::mt19937 rng(11);
  std::vector<float> q = example::random_buffer(rng, T, Hq, D), k = example::random_buffer(rng, T, Hkv, D),
                     v = example::random_buffer(rng, T, Hkv, D), y(T * Hq * D);

  // 1. H2O eviction: 4 sinks, a 64-token window, the 192 heaviest hitters: 260 rows per kv-head.
  kvmem::EvictionConfig ecfg{.head_dim = D, .value_dim = D, .query_heads = Hq, .kv_heads = Hkv,
                             .sinks = 4, .window = 64, .top_k = 192};
  kvmem::EvictionMemory<exec, kvmem::score::AccumulatedAttention> h2o(ecfg, /*batch=*/1);
  h2o.prefill(wrap(q.data(), 0, prompt, Hq, D), wrap(k.data(), 0, prompt, Hkv, D), wrap(v.data(), 0, prompt, Hkv, D),
              wrap(y.data(), 0, prompt, Hq, D));
  for (long t = prompt; t < T; ++t)
    h2o.decode(wrap(q.data(), t, 1, Hq, D), wrap(k.data(), t, 1, Hkv, D), wrap(v.data(), t, 1, Hkv, D),
               wrap(y.data(), t, 1, Hq, D));
  Kokkos::View<long***, exec::memory_space> kept("kept", 1, Hkv, ecfg.budget());
  Kokkos::View<long**, exec::memory_space> rows("rows", 1, Hkv);
  h2o.kept(kept, rows);
  std::printf("H2O after %ld tokens: %ld rows on kv-head 0 (budget %ld); oldest kept: %ld %ld %ld %ld %ld ...\n", T,
              rows(0, 0), ecfg.budget(), kept(0, 0, 0), kept(0, 0, 1), kept(0, 0, 2), kept(0, 0, 3), kept(0, 0, 4));

  // 2. KVM with a 16 sqrt(N) budget, alone and with H2O row eviction above 256 rows.
  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = D;
  cfg.query_heads = Hq;
  cfg.kv_heads = Hkv;
  cfg.chunk = 64;
  cfg.rope_dims = 0;
  cfg.max_rows = 1 << 20;
  const kvmem::budget::PowerLaw budget{.min_rows = 64, .growth_factor = 16.0, .growth_exponent = 0.5};
  Kokkos::View<float*, exec::memory_space> ones("ones", D), zeros("zeros", D), taus("tau", Hq);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  const kvmem::LayerWeights<exec::memory_space> weights{ones, zeros, taus, taus};
  kvmem::KvmMemory<exec, kvmem::budget::PowerLaw> kvm(cfg, budget, weights, 1);
  kvmem::KvmMemoryWithRowEviction<exec, kvmem::budget::PowerLaw, kvmem::score::RowAccumulatedAttention> kvm_h2o(
      cfg, budget, weights, 1, kvmem::score::RowAccumulatedAttention{.max_rows = 256});
  const auto none = Kokkos::View<const float***, Kokkos::LayoutStride, exec::memory_space>();  // gates z = 0
  auto run = [&](auto& memory) {
    memory.prefill(wrap(q.data(), 0, T, Hq, D), wrap(k.data(), 0, T, Hkv, D), wrap(v.data(), 0, T, Hkv, D), none,
                   wrap(y.data(), 0, T, Hq, D));
    return memory.cursor(0).rows;
  };
  const long plain_rows = run(kvm), capped_rows = run(kvm_h2o);
  std::printf("KVM after %ld tokens: %ld state rows; KVM + H2O row eviction: %ld rows (cap 256)\n", T, plain_rows,
              capped_rows);
  return 0;
}
