// A downstream program: includes the installed kvmem headers, composes a KVM memory with a fixed
// 32-row budget, decodes 300 tokens of one sequence and checks the state stayed within its budget.
#include <Kokkos_Core.hpp>
#include <cstdio>

#include <kvmem/kvmem.hpp>

int main() {
  Kokkos::ScopeGuard guard;
  using exec = Kokkos::DefaultHostExecutionSpace;
  using space = exec::memory_space;
  kvmem::MemoryConfig cfg;
  cfg.head_dim = cfg.value_dim = 16;
  cfg.query_heads = cfg.kv_heads = 1;
  cfg.chunk = 16;
  cfg.rope_dims = 8;
  cfg.max_rows = 64;
  Kokkos::View<float*, space> ones("ones", 16), zeros("zeros", 16), tau("tau", 1);
  Kokkos::deep_copy(ones, 1.0f);
  Kokkos::deep_copy(tau, 1.0f);
  kvmem::KvmMemory<exec, kvmem::budget::Fixed> memory(cfg, kvmem::budget::Fixed{32}, {ones, zeros, tau, tau}, 1);
  Kokkos::View<float****, space> q("q", 1, 1, 1, 16), k("k", 1, 1, 1, 16), v("v", 1, 1, 1, 16), y("y", 1, 1, 1, 16);
  Kokkos::View<float***, space> gate("gate", 1, 1, 1);
  for (int t = 0; t < 300; ++t) {
    for (int c = 0; c < 16; ++c) {
      q(0, 0, 0, c) = static_cast<float>((t * 7 + c * 3) % 11) - 5.0f;
      k(0, 0, 0, c) = static_cast<float>((t * 5 + c * 13) % 17) - 8.0f;
      v(0, 0, 0, c) = static_cast<float>((t + c) % 5);
    }
    memory.decode(q, k, v, gate, y);
  }
  const long rows = memory.cursor(0).rows;
  std::printf("downstream: 300 tokens -> %ld state rows (budget 32)\n", rows);
  return rows == 32 ? 0 : 1;
}
