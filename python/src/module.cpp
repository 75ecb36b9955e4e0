/// \file module.cpp
/// The extension module `kvmem._kvmem`: Kokkos' lifetime in the process, the table of memories by handle,
/// and the calls every memory shares (prefill, decode, reset, sizes, state). The families' constructors are
/// in merge_memories.cpp, eviction_memories.cpp and trellis_memory.cpp. Python code calls this through the
/// `kvmem` package, which checks arguments first and registers the torch.library ops.

#include <Kokkos_Core.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <kvmem/config.hpp>

#include "families.hpp"
#include "handles.hpp"
#include "tensors.hpp"

namespace kvmem::python {

Handles& handles() {
  static Handles table;
  return table;
}

namespace {

/// Kokkos Tools counts (allocations, and deep copies in any space) while counting is on: what the Python
/// tests use to show that a call copies nothing and allocates nothing. A deep copy from a scalar (a fill,
/// whose source Kokkos labels "Scalar" or "(none)") writes its destination and copies nothing: counted as
/// a fill.
struct EventCounts {
  bool on = false;
  long allocations = 0, allocated_bytes = 0, fills = 0, deep_copies = 0, largest_deep_copy_bytes = 0;
  std::string largest_deep_copy;  // "destination <- source" labels of the largest deep copy
};
EventCounts g_counts;

void on_allocate(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t bytes) {
  ++g_counts.allocations;
  g_counts.allocated_bytes += static_cast<long>(bytes);
}
void on_deep_copy(Kokkos_Profiling_SpaceHandle, const char* dst, const void*, Kokkos_Profiling_SpaceHandle, const char* src,
                  const void*, std::uint64_t bytes) {
  if (std::string_view(src) == "Scalar" || std::string_view(src) == "(none)") {
    ++g_counts.fills;
    return;
  }
  ++g_counts.deep_copies;
  if (static_cast<long>(bytes) > g_counts.largest_deep_copy_bytes) {
    g_counts.largest_deep_copy_bytes = static_cast<long>(bytes);
    g_counts.largest_deep_copy = std::string(dst) + " <- " + src;
  }
}

/// Starts Kokkos with `num_threads` host threads (<= 0: Kokkos' default) unless it already runs.
void initialize(int num_threads) {
  if (Kokkos::is_initialized()) return;
  auto settings = Kokkos::InitializationSettings().set_disable_warnings(true);
  if (num_threads > 0) settings.set_num_threads(num_threads);
  Kokkos::initialize(settings);
}

/// Destroys every memory, then finalizes Kokkos (at interpreter exit; later calls raise "not a live memory").
void finalize() {
  handles().clear();
  if (Kokkos::is_initialized() && !Kokkos::is_finalized()) Kokkos::finalize();
}

/// The call of `memory` on the tensors of descriptor `tensors` (tensors.hpp), the family's `extras` and the
/// log-sum-exp descriptor `lse` (7 integers, or none when not asked). Throws kvmem::invalid_argument when
/// the descriptor is not 37 integers or `lse` neither 0 nor 7, when its dtype is not the memory's (naming
/// q.dtype and both types), or when y's bytes overlap those of q, k or v (the output would be written while
/// it is read).
Call make_call(const AnyMemory& memory, const std::vector<std::int64_t>& tensors, std::vector<nb::ndarray<>> extras,
               const std::vector<std::int64_t>& lse = {}) {
  if (tensors.size() != descriptor_size)
    throw invalid_argument(detail::describe("tensors", tensors.size(), "must be 37 integers: q, k, v, y as (pointer, 4 extents, "
                                                                       "4 strides), then the dtype code"));
  if (!lse.empty() && lse.size() != lse_descriptor_size)
    throw invalid_argument(detail::describe("lse", lse.size(), "must be 7 integers (pointer, 3 extents, 3 strides) or none"));
  Call call{{}, std::move(extras), {}};
  std::copy(tensors.begin(), tensors.end(), call.tensors.begin());
  std::copy(lse.begin(), lse.end(), call.lse.begin());
  const std::int64_t code = tensors.back();
  if (code < 0 || code > 2 || static_cast<Dtype>(code) != memory.dtype())
    throw invalid_argument(detail::describe("q.dtype", code >= 0 && code <= 2 ? dtype_name_of(static_cast<Dtype>(code)) : "unknown code",
                                            std::string("must be the memory's dtype ") + dtype_name_of(memory.dtype()) +
                                                " (kvmem does not cast)"));
  const std::int64_t bytes = call.element_bytes();
  const auto span = [&](std::size_t i) {  // [first byte, one past the last byte) of tensor i
    const std::int64_t* t = call.tensors.data() + 9 * i;
    std::int64_t last = 0;
    for (int d = 0; d < 4; ++d) {
      if (t[1 + d] == 0) return std::pair<std::int64_t, std::int64_t>{t[0], t[0]};
      last += (t[1 + d] - 1) * t[5 + d];
    }
    return std::pair<std::int64_t, std::int64_t>{t[0], t[0] + bytes * (last + 1)};
  };
  const auto [y0, y1] = span(3);
  for (std::size_t i = 0; i < 3; ++i) {
    const auto [a0, a1] = span(i);
    if (a0 < y1 && y0 < a1 && a0 < a1 && y0 < y1)
      throw invalid_argument(std::string("y: must not alias the input ") + "qkv"[i] + " (its bytes overlap; pass another y)");
  }
  return call;
}

void prefill(long handle, const std::vector<std::int64_t>& tensors, std::vector<nb::ndarray<>> extras,
             const std::vector<long>& lengths, const std::vector<std::int64_t>& lse) {
  auto& memory = handles().at(handle);
  const Call call = make_call(memory, tensors, std::move(extras), lse);
  nb::gil_scoped_release release;
  memory.prefill(call, lengths);
}

void extend(long handle, const std::vector<std::int64_t>& tensors, std::vector<nb::ndarray<>> extras,
            const std::vector<long>& lengths, const std::vector<std::int64_t>& lse) {
  auto& memory = handles().at(handle);
  const Call call = make_call(memory, tensors, std::move(extras), lse);
  nb::gil_scoped_release release;
  memory.extend(call, lengths);
}

void decode(long handle, const std::vector<std::int64_t>& tensors, std::vector<nb::ndarray<>> extras,
            const std::vector<std::uint8_t>& active, const std::vector<std::int64_t>& lse) {
  auto& memory = handles().at(handle);
  const Call call = make_call(memory, tensors, std::move(extras), lse);
  nb::gil_scoped_release release;
  memory.decode(call, std::span<const unsigned char>(active.data(), active.size()));
}

/// The C++ baseline of bench/python_overhead.py: the memory driven from C++ alone, timed in C++.
/// "prefill": `repeats` prefills of all T tokens, each after an untimed reset; "decode": one reset, then T
/// decode steps, token t of q, k, v (subviews) each. Returns the seconds of each call (fenced). Families
/// without extra tensors only (KVM without a gate, OVQ, eviction).
std::vector<double> time_calls(long handle, const std::vector<std::int64_t>& tensors, const std::string& mode, int repeats) {
  auto& memory = handles().at(handle);
  const Call call = make_call(memory, tensors, {});
  if (mode != "prefill" && mode != "decode") throw invalid_argument(detail::describe("mode", mode, "must be prefill or decode"));
  nb::gil_scoped_release release;
  std::vector<double> seconds;
  const auto timed = [&](auto&& fn) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    exec().fence();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  if (mode == "prefill") {
    for (int r = 0; r < repeats; ++r) {
      memory.reset();
      exec().fence();
      timed([&] { memory.prefill(call, {}); });
    }
    return seconds;
  }
  memory.reset();
  for (std::int64_t t = 0; t < call.tensors[3]; ++t) {  // tensors[3]: q's token count T
    const Call step = call.token(t);
    timed([&] { memory.decode(step, {}); });
  }
  return seconds;
}

}  // namespace
}  // namespace kvmem::python

NB_MODULE(_kvmem, m) {
  namespace py = kvmem::python;
  namespace nb = nanobind;
  m.doc() = "kvmem's compiled memories (use the kvmem package, not this module)";
  m.def("initialize", &py::initialize, nb::arg("num_threads"));
  m.def("finalize", &py::finalize);
  m.def("is_initialized", [] { return Kokkos::is_initialized(); });
  m.def("dtype", [](long h) { return std::string(py::dtype_name_of(py::handles().at(h).dtype())); }, nb::arg("handle"));
  m.def("backend", [] { return std::string(py::exec::name()) + " (" + std::to_string(py::exec().concurrency()) + " threads)"; });
  m.def("dlpack_device", [] { return py::dlpack_device(); });

  nb::class_<kvmem::MemoryConfig>(m, "MemoryConfig")
      .def(nb::init<>())
      .def_rw("head_dim", &kvmem::MemoryConfig::head_dim)
      .def_rw("value_dim", &kvmem::MemoryConfig::value_dim)
      .def_rw("query_heads", &kvmem::MemoryConfig::query_heads)
      .def_rw("kv_heads", &kvmem::MemoryConfig::kv_heads)
      .def_rw("chunk", &kvmem::MemoryConfig::chunk)
      .def_rw("window_chunks", &kvmem::MemoryConfig::window_chunks)
      .def_rw("rope_dims", &kvmem::MemoryConfig::rope_dims)
      .def_rw("sinks", &kvmem::MemoryConfig::sinks)
      .def_rw("max_rows", &kvmem::MemoryConfig::max_rows)
      .def_rw("ln_eps", &kvmem::MemoryConfig::ln_eps)
      .def_rw("norm_eps", &kvmem::MemoryConfig::norm_eps)
      .def_rw("normalize_rows", &kvmem::MemoryConfig::normalize_rows);

  py::bind_merge_memories(m);
  py::bind_eviction_memories(m);
  py::bind_trellis_memory(m);

  m.def("prefill", &py::prefill, nb::arg("handle"), nb::arg("tensors"), nb::arg("extras"), nb::arg("lengths"),
        nb::arg("lse") = std::vector<std::int64_t>{});
  m.def("decode", &py::decode, nb::arg("handle"), nb::arg("tensors"), nb::arg("extras"), nb::arg("active"),
        nb::arg("lse") = std::vector<std::int64_t>{});
  m.def("extend", &py::extend, nb::arg("handle"), nb::arg("tensors"), nb::arg("extras"), nb::arg("lengths"),
        nb::arg("lse") = std::vector<std::int64_t>{});
  m.def("set_strict_slots", [](long handle, bool on) { py::handles().at(handle).set_strict_slots(on); }, nb::arg("handle"),
        nb::arg("on"));
  m.def("strict_slots", [](long handle) { return py::handles().at(handle).strict_slots(); }, nb::arg("handle"));
  m.def("reset", [](long h) { py::handles().at(h).reset(); }, nb::arg("handle"));
  m.def("reset_sequence", [](long h, long b) { py::handles().at(h).reset_sequence(b); }, nb::arg("handle"),
        nb::arg("sequence"));
  m.def("release", [](long h) { py::handles().release(h); }, nb::arg("handle"));
  m.def("live_memories", [] { return py::handles().live(); });
  m.def("allocated_bytes", [](long h) { return py::handles().at(h).allocated_bytes(); }, nb::arg("handle"));
  m.def("held_bytes", [](long h) { return py::handles().at(h).held_bytes(); }, nb::arg("handle"));
  m.def("tokens", [](long h, long b) { return py::handles().at(h).tokens(b); }, nb::arg("handle"), nb::arg("sequence"));
  m.def("state", [](long h) { return py::handles().at(h).state(); }, nb::arg("handle"));
  m.def("time_calls", &py::time_calls, nb::arg("handle"), nb::arg("tensors"), nb::arg("mode"), nb::arg("repeats"), "C++-timed prefills or decode steps (the baseline of bench/python_overhead.py).");
  m.def("view_data", [](long handle, const std::vector<std::int64_t>& tensors, int i) {
    const auto& memory = py::handles().at(handle);
    const py::Call call = py::make_call(memory, tensors, {});
    return py::with_storage(py::dtype_name_of(memory.dtype()), [&](auto storage) {
      const auto t = call.views<typename decltype(storage)::type>();
      const std::array<const void*, 4> data{t.q.data(), t.k.data(), t.v.data(), t.y.data()};
      return reinterpret_cast<std::uintptr_t>(data.at(static_cast<std::size_t>(i)));
    });
  }, nb::arg("handle"), nb::arg("tensors"), nb::arg("index"),
        "The data pointer of the Kokkos view that a call of memory `handle` makes of tensor `index` (0 q, 1 k, 2 v, "
        "3 y); the tests compare it with tensor.data_ptr().");
  m.def("count_events", [](bool on) {
    if (on && !py::g_counts.on) {
      Kokkos::Tools::Experimental::set_allocate_data_callback(py::on_allocate);
      Kokkos::Tools::Experimental::set_begin_deep_copy_callback(py::on_deep_copy);
    } else if (!on && py::g_counts.on) {
      Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
      Kokkos::Tools::Experimental::set_begin_deep_copy_callback(nullptr);
    }
    py::g_counts = {on, 0, 0, 0, 0, 0, {}};
  }, nb::arg("on"), "Counts Kokkos allocations and deep copies from now on (on) or stops counting.");
  m.def("event_counts", [] {  // allocations, allocated_bytes, fills, deep_copies, largest_deep_copy(_bytes)
    nb::dict d;
    d["allocations"] = py::g_counts.allocations;
    d["allocated_bytes"] = py::g_counts.allocated_bytes;
    d["fills"] = py::g_counts.fills;
    d["deep_copies"] = py::g_counts.deep_copies;
    d["largest_deep_copy_bytes"] = py::g_counts.largest_deep_copy_bytes;
    d["largest_deep_copy"] = py::g_counts.largest_deep_copy;
    return d;
  });
}
