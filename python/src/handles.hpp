#pragma once
/// \file handles.hpp
/// The one interface through which Python drives every compiled memory (AnyMemory), and the table of live
/// memories by integer handle. Handles are what the torch.library ops take: an int is a value torch.compile
/// can trace, and the table lets Kokkos be finalized after every memory is gone, whatever Python still holds.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <kvmem/memory_concept.hpp>

#include "tensors.hpp"

namespace kvmem::python {

/// The token tensors of one prefill or decode call: the descriptor of q [B, Hq, T, D], k [B, Hkv, T, D],
/// v [B, Hkv, T, Dv], y [B, Hq, T, Dv] (written; tensors.hpp) in the storage type its dtype code names,
/// and the family's extra tensors in the order its Python class documents (KVM/OVQ: [gate [B, Hkv, T]] or
/// none; Trellis: alpha [B, H, T, m], beta1, gamma1, beta2, gamma2 [B, H, T]), all of that storage type.
struct Call {
  Descriptor tensors{};
  std::vector<nb::ndarray<>> extras;
  /// The readout's log-sum-exp to write, lse [B, Hq, T] float32: (data pointer, 3 extents, 3 strides in
  /// elements), or all zeros when not asked (LseDescriptor).
  LseDescriptor lse{};

  /// Whether the call asks for the readout's log-sum-exp.
  [[nodiscard]] bool wants_lse() const { return lse[0] != 0; }
  /// lse as a view of type View (a facade's lse_out; unallocated when not asked).
  template <class View>
  [[nodiscard]] View lse_view() const {
    if (!wants_lse()) return View{};
    const Kokkos::LayoutStride layout(lse[1], lse[4], lse[2], lse[5], lse[3], lse[6]);
    return View(reinterpret_cast<float*>(static_cast<std::uintptr_t>(lse[0])), layout);
  }

  /// The storage type of q, k, v and y.
  [[nodiscard]] Dtype dtype() const { return static_cast<Dtype>(tensors[descriptor_size - 1]); }
  /// Bytes per element of q, k, v and y (4 or 2).
  [[nodiscard]] std::int64_t element_bytes() const { return dtype() == Dtype::float32 ? 4 : 2; }
  /// q, k, v, y as views of storage type S (the memory's; make_call has checked that it is the call's).
  template <StorageType S>
  [[nodiscard]] TokenViews<S> views() const {
    return described_views<S>(tensors);
  }
  /// Token t of every sequence (T = 1): the same tensors, each moved on by t tokens, no extras.
  [[nodiscard]] Call token(std::int64_t t) const {
    Call c{tensors, {}, lse};
    for (std::size_t i = 0; i < 4; ++i) {
      std::int64_t* d = c.tensors.data() + 9 * i;
      d[0] += t * d[7] * element_bytes();
      d[3] = 1;
    }
    if (wants_lse()) {
      c.lse[0] += t * c.lse[6] * static_cast<std::int64_t>(sizeof(float));
      c.lse[3] = 1;
    }
    return c;
  }
};

/// What every compiled memory offers Python (the C++ facades' common contract).
class AnyMemory {
 public:
  virtual ~AnyMemory() = default;
  /// The storage type of the memory's tokens and state (its template's Storage).
  [[nodiscard]] virtual Dtype dtype() const = 0;
  /// Runs a prompt (Memory::prefill, EvictionMemory::prefill, TrellisMemory::prefill); lengths [B] or empty.
  /// Writes the readout's log-sum-exp too when the call asks (Call::lse); throws kvmem::invalid_argument
  /// when it asks a memory whose readout is not one softmax (Trellis).
  virtual void prefill(const Call& call, std::span<const long> lengths) = 0;
  /// Runs one token per active sequence; active [B] (0/1) or empty for all. The log-sum-exp as prefill.
  virtual void decode(const Call& call, std::span<const unsigned char> active) = 0;
  /// Continues prompts (the facade's extend()): prefill's form, refusing a sequence that holds no token.
  virtual void extend(const Call& call, std::span<const long> lengths) = 0;
  /// The strict slot protocol on or off (the facade's set_strict_slots()), and whether it is on.
  virtual void set_strict_slots(bool on) = 0;
  [[nodiscard]] virtual bool strict_slots() const = 0;
  /// Forgets every sequence (the facade's reset()).
  virtual void reset() = 0;
  /// Forgets sequence b alone (the facade's reset_sequence(b)); throws kvmem::invalid_argument as it does.
  virtual void reset_sequence(long b) = 0;
  /// Bytes allocated on the device (the facade's allocated_bytes()).
  [[nodiscard]] virtual long allocated_bytes() const = 0;
  /// Bytes of keys/values/state held for the tokens seen (the facade's held_bytes()).
  [[nodiscard]] virtual long held_bytes() const = 0;
  /// Tokens sequence b has seen.
  [[nodiscard]] virtual long tokens(long b) const = 0;
  /// The memory's state as named host arrays (copies), e.g. state rows and their counts.
  [[nodiscard]] virtual nb::dict state() const = 0;
};

/// The live memories by handle (handles are never reused within a process).
class Handles {
 public:
  long add(std::unique_ptr<AnyMemory> memory) {
    const long handle = next_++;
    table_.emplace(handle, std::move(memory));
    return handle;
  }
  /// Throws kvmem::invalid_argument for a handle that is not live (released, or never made).
  AnyMemory& at(long handle) const {
    const auto it = table_.find(handle);
    if (it == table_.end())
      throw invalid_argument(detail::describe("handle", handle, "is not a live kvmem memory (released, or after kvmem shut down)"));
    return *it->second;
  }
  void release(long handle) { table_.erase(handle); }
  void clear() { table_.clear(); }
  [[nodiscard]] long live() const { return static_cast<long>(table_.size()); }

 private:
  std::map<long, std::unique_ptr<AnyMemory>> table_;
  long next_ = 1;
};

/// The process's table (module.cpp).
Handles& handles();

/// The element type of the NumPy array that to_numpy makes of a view of T: float for bfloat16 and float16
/// (NumPy has no bfloat16), T otherwise.
template <class T>
using numpy_element = std::conditional_t<std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>, float, T>;

/// Copies a device view (rank 1 to 4, LayoutRight) into a new NumPy array (host, C order) owned by Python.
/// A bfloat16 or float16 view becomes a float32 array, each element widened exactly (to_float).
template <class View, class T = typename View::non_const_value_type>
nb::ndarray<nb::numpy, numpy_element<T>> to_numpy(const View& view) {
  using N = numpy_element<T>;
  std::vector<std::size_t> shape(View::rank());
  std::size_t count = 1;
  for (std::size_t i = 0; i < View::rank(); ++i) count *= (shape[i] = view.extent(i));
  auto* data = new N[count];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<N*>(p); });
  if constexpr (std::is_same_v<N, T>) {
    const Kokkos::View<typename View::non_const_data_type, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>
        host(data, view.layout());
    Kokkos::deep_copy(host, view);
  } else {
    const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, view);
    for (std::size_t i = 0; i < count; ++i) data[i] = to_float(host.data()[i]);
  }
  return nb::ndarray<nb::numpy, N>(data, shape.size(), shape.data(), owner);
}

/// AnyMemory's dtype() for a memory of storage type S.
template <StorageType S>
class TypedMemory : public AnyMemory {
 public:
  [[nodiscard]] Dtype dtype() const final { return dtype_of<S>; }
};

/// A facade M (kvmem::AttentionMemory) behind AnyMemory: prefill, decode (with the readout's log-sum-exp
/// when asked), reset, reset_sequence, the sizes and the token counts go through the one contract, the
/// same for every family. A family's class gives the memory (memory()), how a call's tensors become
/// M::inputs (inputs(), its extras included) and state().
template <AttentionMemory M>
class ContractMemory : public TypedMemory<typename M::storage_type> {
  using S = typename M::storage_type;

 public:
  void prefill(const Call& c, std::span<const long> lengths) final {
    if constexpr (M::softmax_readout) {
      if (c.wants_lse()) return memory().prefill(inputs(c), c.views<S>().y, lengths, c.lse_view<typename M::lse_out>());
    } else {
      refuse_lse(c);
    }
    memory().prefill(inputs(c), c.views<S>().y, lengths);
  }
  void decode(const Call& c, std::span<const unsigned char> active) final {
    if constexpr (M::softmax_readout) {
      if (c.wants_lse()) return memory().decode(inputs(c), c.views<S>().y, active, c.lse_view<typename M::lse_out>());
    } else {
      refuse_lse(c);
    }
    memory().decode(inputs(c), c.views<S>().y, active);
  }
  void extend(const Call& c, std::span<const long> lengths) final {
    if constexpr (M::softmax_readout) {
      if (c.wants_lse()) return memory().extend(inputs(c), c.views<S>().y, lengths, c.lse_view<typename M::lse_out>());
    } else {
      refuse_lse(c);
    }
    memory().extend(inputs(c), c.views<S>().y, lengths);
  }
  void set_strict_slots(bool on) final { memory().set_strict_slots(on); }
  [[nodiscard]] bool strict_slots() const final { return memory().strict_slots(); }
  void reset() final { memory().reset(); }
  void reset_sequence(long b) final { memory().reset_sequence(b); }
  [[nodiscard]] long allocated_bytes() const final { return memory().allocated_bytes(); }
  [[nodiscard]] long held_bytes() const final { return memory().held_bytes(); }
  [[nodiscard]] long tokens(long b) const final { return memory().tokens(b); }

 protected:
  [[nodiscard]] virtual M& memory() = 0;
  [[nodiscard]] virtual const M& memory() const = 0;
  /// The call's q, k, v and the family's extras as the memory's inputs; throws kvmem::invalid_argument for
  /// missing or misshapen extras.
  [[nodiscard]] virtual typename M::inputs inputs(const Call& c) const = 0;

 private:
  static void refuse_lse(const Call& c) {
    if (c.wants_lse())
      throw invalid_argument(detail::describe("lse", "a tensor", "this memory reads its slots through phi, not one softmax "
                                                                  "over keys: it has no log-sum-exp (pass lse=None)"));
  }
};

}  // namespace kvmem::python
