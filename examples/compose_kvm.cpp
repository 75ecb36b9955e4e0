/// \file compose_kvm.cpp
/// Composes a KVM memory (winner-take-all merge, novelty append, 16 sqrt(N) budget), prefills a
/// prompt held in an engine-style [tokens, heads, head_dim] buffer without copying it, then decodes
/// more tokens one at a time. Prints the state rows and memory held as the sequence grows.

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <random>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "engine_buffers.hpp"

int main() {
  Kokkos::ScopeGuard guard;
  using exec = Kokkos::DefaultHostExecutionSpace;
  using space = exec::memory_space;

  kvmem::MemoryConfig cfg;
  cfg.head_dim = 64;
  cfg.value_dim = 64;
  cfg.query_heads = 8;
  cfg.kv_heads = 2;  // GQA: 4 query heads per kv-head
  cfg.chunk = 64;
  cfg.window_chunks = 2;
  cfg.rope_dims = 32;
  cfg.sinks = 1;
  cfg.max_rows = 1 << 20;
  const kvmem::budget::PowerLaw budget{.min_rows = 64, .growth_factor = 16.0, .growth_exponent = 0.5};

  // Learned layer parameters at their initial values: LN_s affine (1, 0), temperatures 1.
  kvmem::LayerWeights<space> weights;
  Kokkos::View<float*, space> ones("ones", cfg.head_dim), zeros("zeros", cfg.head_dim), taus("tau", cfg.query_heads);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(taus, 1.0f);
  weights = {ones, zeros, taus, taus};

  kvmem::KvmMemory<exec, kvmem::budget::PowerLaw> memory(cfg, budget, weights, /*batch=*/1);

  // An engine's buffers: [T, heads, head_dim] per tensor, as vLLM or llama.cpp hold them.
  const long prompt = 1000, generated = 200, T = prompt + generated;
  std::mt19937 rng(7);
  std::vector<float> q = example::random_buffer(rng, T, cfg.query_heads, cfg.head_dim),
                     k = example::random_buffer(rng, T, cfg.kv_heads, cfg.head_dim),
                     v = example::random_buffer(rng, T, cfg.kv_heads, cfg.value_dim),
                     gate = example::random_buffer(rng, T, cfg.kv_heads, 1), y(T * cfg.query_heads * cfg.value_dim);
  using example::wrap;
  auto wrap_gate = [&](float* data, long t0, long tokens) { return example::wrap_scalar(data, t0, tokens, cfg.kv_heads); };

  memory.prefill(wrap(q.data(), 0, prompt, cfg.query_heads, cfg.head_dim), wrap(k.data(), 0, prompt, cfg.kv_heads, cfg.head_dim),
                 wrap(v.data(), 0, prompt, cfg.kv_heads, cfg.value_dim), wrap_gate(gate.data(), 0, prompt),
                 wrap(y.data(), 0, prompt, cfg.query_heads, cfg.value_dim));
  std::printf("after prefill of %ld tokens: %ld state rows, %ld window tokens, %ld bytes held\n", prompt,
              memory.cursor(0).rows, memory.window_tokens(0), memory.held_bytes());
  for (long t = prompt; t < T; ++t) {
    memory.decode(wrap(q.data(), t, 1, cfg.query_heads, cfg.head_dim), wrap(k.data(), t, 1, cfg.kv_heads, cfg.head_dim),
                  wrap(v.data(), t, 1, cfg.kv_heads, cfg.value_dim), wrap_gate(gate.data(), t, 1),
                  wrap(y.data(), t, 1, cfg.query_heads, cfg.value_dim));
  }
  const long full = T * cfg.kv_heads * (cfg.head_dim + cfg.value_dim) * 4;
  std::printf("after decoding %ld more: %ld state rows, %ld bytes held vs %ld for a full KV cache\n", generated,
              memory.cursor(0).rows, memory.held_bytes(), full);
  std::printf("y[last token, head 0, 0:4] = %.4f %.4f %.4f %.4f\n", y[(T - 1) * cfg.query_heads * cfg.value_dim],
              y[(T - 1) * cfg.query_heads * cfg.value_dim + 1], y[(T - 1) * cfg.query_heads * cfg.value_dim + 2],
              y[(T - 1) * cfg.query_heads * cfg.value_dim + 3]);
  return 0;
}
