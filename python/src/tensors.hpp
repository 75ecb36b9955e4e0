#pragma once
/// \file tensors.hpp
/// DLPack tensors (torch.Tensor, NumPy arrays) seen as unmanaged Kokkos views of kvmem's token layout,
/// without a copy: the view points at the tensor's data with the tensor's extents and strides, in the
/// memory's storage type (float32, bfloat16 or float16; kvmem/dtype.hpp), never converted.

#include <Kokkos_Core.hpp>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/errors.hpp>

namespace kvmem::python {

namespace nb = nanobind;

/// The execution space every compiled memory runs on (Kokkos' default: OpenMP in the CPU build, Cuda in a
/// Cuda build) and its memory space.
using exec = Kokkos::DefaultExecutionSpace;
using mem_space = exec::memory_space;

/// Token tensors as the memories of storage type S take them: [B, heads, T, channels] (and gates
/// [B, heads, T]), any strides, unmanaged (they alias the caller's tensor).
template <StorageType S>
using tokens_in = Kokkos::View<const S****, Kokkos::LayoutStride, mem_space>;
template <StorageType S>
using tokens_out = Kokkos::View<S****, Kokkos::LayoutStride, mem_space>;
template <StorageType S>
using gates_in = Kokkos::View<const S***, Kokkos::LayoutStride, mem_space>;

/// The storage types the module compiles every memory for, by the code the Python side puts at the end of
/// a call's descriptor (kvmem.ops.describe): 0 float32, 1 bfloat16, 2 float16.
enum class Dtype : int { float32 = 0, bfloat16 = 1, float16 = 2 };

template <StorageType S>
inline constexpr Dtype dtype_of = std::is_same_v<S, float> ? Dtype::float32 : std::is_same_v<S, bfloat16> ? Dtype::bfloat16 : Dtype::float16;

/// torch's name of a storage type (torch.float32 without "torch."): float32, bfloat16 or float16.
inline const char* dtype_name_of(Dtype d) {
  return d == Dtype::float32 ? "float32" : d == Dtype::bfloat16 ? "bfloat16" : "float16";
}

/// Calls make(std::type_identity<S>{}) with the storage type S that `dtype` names ("float32", "bfloat16",
/// "float16", torch's names) and returns its result. Throws kvmem::invalid_argument for any other name.
template <class Make>
auto with_storage(const std::string& dtype, Make&& make) {
  if (dtype == "float32") return make(std::type_identity<float>{});
  if (dtype == "bfloat16") return make(std::type_identity<bfloat16>{});
  if (dtype == "float16") return make(std::type_identity<float16>{});
  throw invalid_argument(detail::describe("dtype", dtype, "must be float32, bfloat16 or float16"));
}

/// The DLPack type of S (float32: float code, 32 bits; bfloat16: bfloat code, 16 bits; float16: float
/// code, 16 bits).
template <StorageType S>
nb::dlpack::dtype dlpack_dtype() {
  const auto code = std::is_same_v<S, bfloat16> ? nb::dlpack::dtype_code::Bfloat : nb::dlpack::dtype_code::Float;
  return {static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(8 * sizeof(S)), 1};
}

/// A DLPack type as torch names it (float32, bfloat16, float64, ...), or by its code and bits.
inline std::string describe_dtype(const nb::dlpack::dtype& t) {
  if (t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return "bfloat16";
  if (t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float)) return "float" + std::to_string(t.bits);
  return "code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits";
}

/// The DLPack device type of mem_space: kDLCPU (1) for host memory, kDLCUDA (2) for CudaSpace.
inline constexpr int dlpack_device() {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<mem_space, Kokkos::CudaSpace>) return nb::device::cuda::value;
#endif
  return nb::device::cpu::value;
}

/// Throws kvmem::invalid_argument (ValueError in Python) unless `t` holds elements of type S, has rank
/// `rank` and lives in the memory space of the compiled memories. `name` is the Python argument's name.
template <StorageType S>
void check_tensor(const nb::ndarray<>& t, const char* name, std::size_t rank) {
  if (t.dtype() != dlpack_dtype<S>())
    throw invalid_argument(detail::describe(std::string(name) + ".dtype", describe_dtype(t.dtype()),
                                            std::string("must be ") + dtype_name_of(dtype_of<S>) + " (kvmem does not cast)"));
  if (t.device_type() != dlpack_device())
    throw invalid_argument(detail::describe(std::string(name) + ".device", "DLPack device type " + std::to_string(t.device_type()),
                                            "must be the memory's device (DLPack type " + std::to_string(dlpack_device()) +
                                                ", Kokkos " + mem_space::name() + ")"));
  if (t.ndim() != rank)
    throw invalid_argument(detail::describe(std::string(name) + ".dim()", t.ndim(), "must be " + std::to_string(rank)));
}

/// A rank-4 view [B, heads, T, channels] of `t` (checked by check_tensor<S>), sharing its data and strides.
template <StorageType S>
tokens_in<S> token_view(const nb::ndarray<>& t, const char* name) {
  check_tensor<S>(t, name, 4);
  const Kokkos::LayoutStride layout(t.shape(0), t.stride(0), t.shape(1), t.stride(1), t.shape(2), t.stride(2),
                                    t.shape(3), t.stride(3));
  return tokens_in<S>(static_cast<const S*>(t.data()), layout);
}

/// A rank-3 view [B, heads, T] of `t` (checked by check_tensor<S>), sharing its data and strides.
template <StorageType S>
gates_in<S> gate_view(const nb::ndarray<>& t, const char* name) {
  check_tensor<S>(t, name, 3);
  const Kokkos::LayoutStride layout(t.shape(0), t.stride(0), t.shape(1), t.stride(1), t.shape(2), t.stride(2));
  return gates_in<S>(static_cast<const S*>(t.data()), layout);
}

/// The four token tensors of a call (q, k, v, y) as the Python side describes them, without DLPack (which
/// costs microseconds per tensor at every decode step): per tensor its data pointer, 4 extents and 4
/// strides (in elements), then the storage type's code (Dtype) of all four: 37 integers. The Python side
/// has checked dtype, device and rank; the memories check the extents against their configuration.
inline constexpr std::size_t descriptor_size = 4 * 9 + 1;
using Descriptor = std::array<std::int64_t, descriptor_size>;
/// The descriptor of a call's log-sum-exp output lse [B, Hq, T] (float32): data pointer, 3 extents, 3
/// strides in elements; all zeros when the call does not ask for it.
inline constexpr std::size_t lse_descriptor_size = 1 + 3 + 3;
using LseDescriptor = std::array<std::int64_t, lse_descriptor_size>;

/// The views of a descriptor's tensors in storage type S (which the caller has matched with the
/// descriptor's dtype code): q, k, v read, y written.
template <StorageType S>
struct TokenViews {
  tokens_in<S> q, k, v;
  tokens_out<S> y;
};

/// The rank-4 view of tensor `i` (0 q, 1 k, 2 v, 3 y) of a descriptor (see descriptor_size).
template <class View>
View described_view(const Descriptor& d, std::size_t i) {
  const std::int64_t* t = d.data() + 9 * i;
  const Kokkos::LayoutStride layout(t[1], t[5], t[2], t[6], t[3], t[7], t[4], t[8]);
  return View(reinterpret_cast<typename View::pointer_type>(static_cast<std::uintptr_t>(t[0])), layout);
}

/// The four views of a descriptor in storage type S.
template <StorageType S>
TokenViews<S> described_views(const Descriptor& d) {
  return {described_view<tokens_in<S>>(d, 0), described_view<tokens_in<S>>(d, 1), described_view<tokens_in<S>>(d, 2),
          described_view<tokens_out<S>>(d, 3)};
}

/// A copy of the float32 tensor `t` of rank `Rank` (a learned weight, not a token tensor: float32 whatever
/// the memory's storage type) in a managed device view labelled `name`. The memory keeps the copy, so the
/// caller may free `t`.
template <int Rank>
auto weight_copy(const nb::ndarray<>& t, const char* name) {
  check_tensor<float>(t, name, Rank);
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
