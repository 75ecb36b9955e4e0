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
inline const io::Tensor& float_tensor(const io::SafetensorsFile& file, const std::string& name, std::size_t rank,
                                      const std::string& layout) {
  const auto& t = file.at(name);
  require(t.dtype == "F32" || t.dtype == "F64", "tensor '" + name + "' dtype", t.dtype,
          "unsupported; float tensors must be F32 or F64");
  require(t.shape.size() == rank, "tensor '" + name + "' shape", shape_string(t.shape),
          "must have rank " + std::to_string(rank) + " " + layout);
  return t;
}

/// Requires dimension `axis` of tensor `name` to equal `want` (described as `what`).
inline void expect_dim(const io::Tensor& t, const std::string& name, std::size_t axis, std::int64_t want,
                       const std::string& what) {
  require(t.shape[axis] == want, "tensor '" + name + "' shape", shape_string(t.shape),
          "dimension " + std::to_string(axis) + " must equal " + what + " = " + std::to_string(want));
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
