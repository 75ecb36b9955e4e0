#pragma once
/// \file batch.hpp
/// The q, k, v tensors of one captured layer, checked against each other, as device views.

#include <Kokkos_Core.hpp>
#include <string>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/errors.hpp>
#include <kvmem/io/safetensors.hpp>

#include "tensors.hpp"

namespace kvmem::tools {

/// Device views of one batch in the run's storage type Storage (float, kvmem::bfloat16 or kvmem::float16):
/// q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv], gate [B, Hkv, T] (may be empty: z = 0) and the
/// sequence lengths.
template <class MemorySpace, StorageType Storage = float>
struct Batch {
  using storage_type = Storage;
  Kokkos::View<Storage****, Kokkos::LayoutRight, MemorySpace> q, k, v;
  Kokkos::View<Storage***, Kokkos::LayoutRight, MemorySpace> gate;
  std::vector<long> lengths;
  long B = 0, Hq = 0, Hkv = 0, T = 0, D = 0, Dv = 0;
  TokenDtype dtype;  ///< the run's dtype, of Storage (dtype.name == kvmem::dtype_name<Storage>)

  /// Reads q, k, v and the optional lengths [B] of `f` (no gate) as `dtype` (token_tensor): Hq a positive
  /// multiple of Hkv (GQA), B >= 1. Throws kvmem::invalid_argument naming the first bad tensor.
  static Batch load_qkv(const io::SafetensorsFile& f, const TokenDtype& dtype) {
    Batch in;
    in.dtype = dtype;
    const auto& q = token_tensor(f, "q", 4, "[B, Hq, T, D]", dtype);
    const auto& k = token_tensor(f, "k", 4, "[B, Hkv, T, D]", dtype);
    const auto& v = token_tensor(f, "v", 4, "[B, Hkv, T, Dv]", dtype);
    require_token_fits(f, q, "q", 2);
    require_token_fits(f, k, "k", 2);
    require_token_fits(f, v, "v", 2);
    in.B = q.shape[0], in.Hq = q.shape[1], in.T = q.shape[2], in.D = q.shape[3];
    in.Hkv = k.shape[1], in.Dv = v.shape[3];
    expect_dim(k, "k", 0, in.B, "B (from q)");
    expect_dim(k, "k", 2, in.T, "T (from q)");
    expect_dim(k, "k", 3, in.D, "D (from q)");
    expect_dim(v, "v", 0, in.B, "B (from q)");
    expect_dim(v, "v", 1, in.Hkv, "Hkv (from k)");
    expect_dim(v, "v", 2, in.T, "T (from q)");
    require(in.B >= 1, "tensor 'q' shape", shape_string(q.shape), "needs at least one sequence (B >= 1)");
    require(in.Hkv >= 1 && in.Hq % in.Hkv == 0, "tensor 'q' shape", shape_string(q.shape),
            "query heads Hq = " + std::to_string(in.Hq) + " must be a positive multiple of the kv-heads Hkv = " +
                std::to_string(in.Hkv) + " of tensor 'k'");
    in.lengths = load_lengths(f, in.B, in.T);
    in.q = to_view<4, MemorySpace, Storage>(q, "q");
    in.k = to_view<4, MemorySpace, Storage>(k, "k");
    in.v = to_view<4, MemorySpace, Storage>(v, "v");
    return in;
  }
};

}  // namespace kvmem::tools
