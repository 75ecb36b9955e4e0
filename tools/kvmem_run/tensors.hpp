#pragma once
/// \file tensors.hpp
/// kvmem-run helpers: named tensors of a safetensors file checked against expected shapes, as Kokkos views.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include <kvmem/errors.hpp>
#include <kvmem/io/safetensors.hpp>

namespace kvmem::tools {

/// Shape of `name` as a string, e.g. "[2, 4, 100, 64]".
inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// The tensor `name` of `file`, required to be a float tensor (F32 or F64) of rank `rank`.
/// Throws kvmem::invalid_argument naming the tensor for a missing tensor, another dtype or another rank.
/// `name` and `layout` are C strings: a std::string temporary argument would make every `const auto& t =
/// float_tensor(...)` look like a dangling reference to g++ (-Wdangling-reference).
inline const io::Tensor& float_tensor(const io::SafetensorsFile& file, const char* name, std::size_t rank,
                                      const char* layout) {
  const auto& t = file.at(name);
  require(t.dtype == "F32" || t.dtype == "F64", "tensor '" + std::string(name) + "' dtype", t.dtype,
          "unsupported; float tensors must be F32 or F64");
  require(t.shape.size() == rank, "tensor '" + std::string(name) + "' shape", shape_string(t.shape),
          "must have rank " + std::to_string(rank) + " " + std::string(layout));
  return t;
}

/// Requires dimension `axis` of tensor `name` to equal `want` (described as `what`).
inline void expect_dim(const io::Tensor& t, const std::string& name, std::size_t axis, std::int64_t want,
                       const std::string& what) {
  require(t.shape[axis] == want, "tensor '" + name + "' shape", shape_string(t.shape),
          "dimension " + std::to_string(axis) + " must equal " + what + " = " + std::to_string(want));
}

/// Requires one token's worth of the token tensor `name` (its size with dimension `token_axis` taken as 1)
/// to fit in the file it came from, and every other dimension to fit an int. With T >= 1 this always
/// holds; with T = 0 the tensor holds no data, yet its batch, head and channel dimensions still size the
/// memory (B x Hkv x (window + chunk) x (D + Dv)) and the outputs (state_rows [B, Hkv]), so without it a
/// 300-byte file could make kvmem-run allocate any amount. (Found by fuzzing; docs/reliability.md.)
inline void require_token_fits(const io::SafetensorsFile& f, const io::Tensor& t, const std::string& name,
                               std::size_t token_axis) {
  if (f.file_bytes == 0) return;  // built in memory: its sizes are the caller's
  std::uint64_t bytes = io::dtype_size(t.dtype);
  for (std::size_t i = 0; i < t.shape.size(); ++i) {
    if (i == token_axis) continue;
    const auto dim = static_cast<std::uint64_t>(t.shape[i]);
    require(dim <= 2147483647u, "tensor '" + name + "' shape", shape_string(t.shape),
            "dimension " + std::to_string(i) + " must be below 2^31");
    require(dim == 0 || bytes <= f.file_bytes / dim, "tensor '" + name + "' shape", shape_string(t.shape),
            "a single token of it would need more bytes than the whole file (" + std::to_string(f.file_bytes) +
                "); its batch, head or channel dimensions are too large");
    bytes *= dim;
  }
}

/// The optional `lengths` [B] tensor (I64 or I32, each in [0, T]) of a ragged batch; all T without it.
/// Throws kvmem::invalid_argument naming the tensor or the offending entry.
inline std::vector<long> load_lengths(const io::SafetensorsFile& f, long B, long T) {
  std::vector<long> lengths(B, T);
  if (!f.has("lengths")) return lengths;
  const auto& l = f.at("lengths");
  require(l.dtype == "I64" || l.dtype == "I32", "tensor 'lengths' dtype", l.dtype, "must be I64 (or I32)");
  require(l.shape.size() == 1 && l.shape[0] == B, "tensor 'lengths' shape", shape_string(l.shape),
          "must be [B] with B = " + std::to_string(B));
  const auto vals = io::to_double(l, "lengths");
  for (long b = 0; b < B; ++b) {
    require(vals[b] >= 0 && vals[b] <= static_cast<double>(T), "lengths[" + std::to_string(b) + "]", vals[b],
            "must be in [0, T = " + std::to_string(T) + "]");
    lengths[b] = static_cast<long>(vals[b]);
  }
  return lengths;
}

/// float*, float**, ... for rank R.
template <int R> struct rank_type { using type = typename rank_type<R - 1>::type*; };
template <> struct rank_type<0> { using type = float; };

/// Copies a float tensor into a new LayoutRight device view of rank R with the tensor's shape.
template <int R, class MemorySpace>
auto to_view(const io::Tensor& t, const std::string& name) {
  const auto values = io::to_double(t, name);
  std::vector<float> f(values.begin(), values.end());
  using data_t = typename rank_type<R>::type;
  using device_t = Kokkos::View<data_t, Kokkos::LayoutRight, MemorySpace>;
  using host_t = Kokkos::View<data_t, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  auto make = [&](auto&&... lead) {
    auto ext = [&](int i) { return static_cast<std::size_t>(t.shape[i]); };
    if constexpr (R == 1) return std::make_pair(device_t(lead..., ext(0)), host_t(f.data(), ext(0)));
    else if constexpr (R == 3) return std::make_pair(device_t(lead..., ext(0), ext(1), ext(2)), host_t(f.data(), ext(0), ext(1), ext(2)));
    else return std::make_pair(device_t(lead..., ext(0), ext(1), ext(2), ext(3)), host_t(f.data(), ext(0), ext(1), ext(2), ext(3)));
  };
  auto [view, host] = make(Kokkos::view_alloc(Kokkos::WithoutInitializing, name));
  Kokkos::deep_copy(view, host);
  return view;
}

}  // namespace kvmem::tools
