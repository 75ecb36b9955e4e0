#pragma once
/// \file run_memory.hpp
/// Runs a composed kvmem::Memory over a batch in prefill or decode mode, writes y and the final state to
/// a safetensors file, and prints the one-screen summary (shared by `kvmem-run kvm` and `kvmem-run ovq`).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <kvmem/io/safetensors.hpp>
#include <kvmem/kvmem.hpp>

#include "batch.hpp"
#include "run_tokens.hpp"
#include "tensors.hpp"

namespace kvmem::tools {

/// Output tensor names of the final state: keys [B, Hkv, M, D], values [B, Hkv, M, Dv], the per-row
/// scalar [B, Hkv, M] (radius or count) and the row counts [B, Hkv] (int64).
struct StateNames {
  std::string memory, keys, values, scalar, rows;
  bool scalar_is_count = false;
};

/// Runs `mem` over `in` ("prefill" or "decode"), writes y (in the run's dtype, Memory's storage type) and
/// the final state (float32, padded with zeros to the largest row count M) to `output` with `names`, and
/// prints a summary including `details`.
template <class Memory, class MemorySpace>
void run_memory(Memory& mem, const Batch<MemorySpace, typename Memory::storage_type>& in, const std::string& mode,
                const StateNames& names, const std::string& input, const std::string& output,
                const std::string& details) {
  using storage = typename Memory::storage_type;
  Kokkos::View<storage****, Kokkos::LayoutRight, MemorySpace> y("y", in.B, in.Hq, in.T, in.Dv);
  const double seconds = run_tokens(mem, typename Memory::inputs{in.q, in.k, in.v, in.gate}, y, mode, in.lengths);

  long M = 0, tokens = 0, min_rows = -1;
  for (long b = 0; b < in.B; ++b) {
    M = std::max(M, mem.cursor(b).rows);
    min_rows = min_rows < 0 ? mem.cursor(b).rows : std::min(min_rows, mem.cursor(b).rows);
    tokens += in.lengths[b];
  }
  const auto& st = mem.rows();
  auto keys = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.keys);
  auto values = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.values);
  auto scalar = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), names.scalar_is_count ? st.counts : st.radius);
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  std::vector<float> sk(in.B * in.Hkv * M * in.D, 0.0f), sv(in.B * in.Hkv * M * in.Dv, 0.0f), ss(in.B * in.Hkv * M, 0.0f);
  std::vector<std::int64_t> rows(in.B * in.Hkv);
  for (long b = 0; b < in.B; ++b)
    for (long h = 0; h < in.Hkv; ++h) {
      const long m = mem.cursor(b).rows, base = (b * in.Hkv + h) * M;
      rows[b * in.Hkv + h] = m;
      for (long i = 0; i < m; ++i) {
        for (long c = 0; c < in.D; ++c) sk[(base + i) * in.D + c] = keys(b, h, i, c);
        for (long c = 0; c < in.Dv; ++c) sv[(base + i) * in.Dv + c] = values(b, h, i, c);
        ss[base + i] = scalar(b, h, i);
      }
    }
  io::SafetensorsFile out;
  out.put("y", {in.B, in.Hq, in.T, in.Dv}, yh.data());
  out.put(names.keys, {in.B, in.Hkv, M, in.D}, sk.data());
  out.put(names.values, {in.B, in.Hkv, M, in.Dv}, sv.data());
  out.put(names.scalar, {in.B, in.Hkv, M}, ss.data());
  out.put(names.rows, {in.B, in.Hkv}, rows.data());
  out.metadata["memory"] = names.memory;
  out.metadata["mode"] = mode;
  out.metadata["budget"] = std::string(Memory::budget_type::name);
  out.write(output);

  using exec = typename Memory::execution_space;
  std::printf("kvmem-run %s  mode=%s  dtype=%s  budget=%s  backend=%s (%d threads)\n", names.memory.c_str(),
              mode.c_str(), in.dtype.flag().c_str(), std::string(Memory::budget_type::name).c_str(), exec().name(),
              exec().concurrency());
  std::printf("  input         %s%s\n", input.c_str(), in.dtype.conversion().c_str());
  std::printf("  shape         B=%ld  Hq=%ld  Hkv=%ld  T=%ld  D=%ld  Dv=%ld  (%ld tokens in all)\n", in.B, in.Hq, in.Hkv,
              in.T, in.D, in.Dv, tokens);
  std::printf("  memory        %s\n", details.c_str());
  std::printf("  state rows    %ld..%ld per kv-head (largest sequence: %ld tokens)\n", min_rows, M,
              *std::max_element(in.lengths.begin(), in.lengths.end()));
  print_memory_held<storage>(mem.held_bytes(), "state rows float32 + window " + in.dtype.flag(), tokens, in.Hkv,
                             in.D + in.Dv);
  std::printf("  wall time     %.3f s  (%.0f tokens/s)\n", seconds, seconds > 0 ? tokens / seconds : 0.0);
  std::printf("  output        %s\n", output.c_str());
}

}  // namespace kvmem::tools
