#pragma once
/// \file tensors.hpp
/// DLPack tensors (torch.Tensor, NumPy arrays) seen as unmanaged Kokkos views of kvmem's token layout,
/// without a copy: the view points at the tensor's data with the tensor's extents and strides.

#include <Kokkos_Core.hpp>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <kvmem/errors.hpp>

namespace kvmem::python {

namespace nb = nanobind;

/// The execution space every compiled memory runs on (Kokkos' default: OpenMP in the CPU build, Cuda in a
/// Cuda build) and its memory space.
using exec = Kokkos::DefaultExecutionSpace;
using mem_space = exec::memory_space;

/// Token tensors as the memories take them: [B, heads, T, channels] (and gates [B, heads, T]), any
/// strides, unmanaged (they alias the caller's tensor).
using tokens_in = Kokkos::View<const float****, Kokkos::LayoutStride, mem_space>;
using tokens_out = Kokkos::View<float****, Kokkos::LayoutStride, mem_space>;
using gates_in = Kokkos::View<const float***, Kokkos::LayoutStride, mem_space>;

/// The DLPack device type of mem_space: kDLCPU (1) for host memory, kDLCUDA (2) for CudaSpace.
inline constexpr int dlpack_device() {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<mem_space, Kokkos::CudaSpace>) return nb::device::cuda::value;
#endif
  return nb::device::cpu::value;
}

/// Throws kvmem::invalid_argument (ValueError in Python) unless `t` is float32, of rank `rank`, in the
/// memory space of the compiled memories. `name` is the Python argument's name.
inline void check_tensor(const nb::ndarray<>& t, const char* name, std::size_t rank) {
  if (t.dtype() != nb::dtype<float>())
    throw invalid_argument(detail::describe(std::string(name) + ".dtype", "code " + std::to_string(t.dtype().code) +
                                                                              ", " + std::to_string(t.dtype().bits) + " bits",
                                            "must be float32"));
  if (t.device_type() != dlpack_device())
    throw invalid_argument(detail::describe(std::string(name) + ".device", "DLPack device type " + std::to_string(t.device_type()),
                                            "must be the memory's device (DLPack type " + std::to_string(dlpack_device()) +
                                                ", Kokkos " + mem_space::name() + ")"));
  if (t.ndim() != rank)
    throw invalid_argument(detail::describe(std::string(name) + ".dim()", t.ndim(), "must be " + std::to_string(rank)));
}

/// A rank-4 view [B, heads, T, channels] of `t` (checked by check_tensor), sharing its data and strides.
template <class View>
View token_view(const nb::ndarray<>& t, const char* name) {
  check_tensor(t, name, 4);
  const Kokkos::LayoutStride layout(t.shape(0), t.stride(0), t.shape(1), t.stride(1), t.shape(2), t.stride(2),
                                    t.shape(3), t.stride(3));
  return View(static_cast<typename View::pointer_type>(t.data()), layout);
}

/// The four token tensors of a call (q, k, v, y) as the Python side describes them, without DLPack (which
/// costs microseconds per tensor at every decode step): per tensor its data pointer, 4 extents and 4
/// strides (in elements), 36 integers in all. The Python side has checked dtype (float32), device and
/// rank; the memories check the extents against their configuration.
inline constexpr std::size_t descriptor_size = 4 * 9;

/// The rank-4 view of tensor `i` (0 q, 1 k, 2 v, 3 y) of a descriptor (see descriptor_size).
template <class View>
View described_view(const std::vector<std::int64_t>& d, std::size_t i) {
  const std::int64_t* t = d.data() + 9 * i;
  const Kokkos::LayoutStride layout(t[1], t[5], t[2], t[6], t[3], t[7], t[4], t[8]);
  return View(reinterpret_cast<typename View::pointer_type>(static_cast<std::uintptr_t>(t[0])), layout);
}

/// A rank-3 view [B, heads, T] of `t` (checked by check_tensor), sharing its data and strides.
inline gates_in gate_view(const nb::ndarray<>& t, const char* name) {
  check_tensor(t, name, 3);
  const Kokkos::LayoutStride layout(t.shape(0), t.stride(0), t.shape(1), t.stride(1), t.shape(2), t.stride(2));
  return gates_in(static_cast<const float*>(t.data()), layout);
}

/// A copy of the float32 tensor `t` of rank `Rank` (a learned weight, not a token tensor) in a managed
/// device view labelled `name`. The memory keeps the copy, so the caller may free `t`.
template <int Rank>
auto weight_copy(const nb::ndarray<>& t, const char* name) {
  check_tensor(t, name, Rank);
  using data_t = std::conditional_t<Rank == 1, float*, std::conditional_t<Rank == 2, float**, float***>>;
  using const_t = std::conditional_t<Rank == 1, const float*, std::conditional_t<Rank == 2, const float**, const float***>>;
  Kokkos::LayoutStride layout;
  for (int i = 0; i < Rank; ++i) {
    layout.dimension[i] = t.shape(i);
    layout.stride[i] = t.stride(i);
  }
  Kokkos::LayoutRight right;
  for (int i = 0; i < Rank; ++i) right.dimension[i] = t.shape(i);
  Kokkos::View<data_t, Kokkos::LayoutRight, mem_space> out(std::string("kvmem::python::") + name, right);
  const Kokkos::View<const_t, Kokkos::LayoutStride, mem_space> src(static_cast<const float*>(t.data()), layout);
  Kokkos::deep_copy(out, src);
  return out;
}

}  // namespace kvmem::python
