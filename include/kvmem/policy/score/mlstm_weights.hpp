#pragma once
/// \file mlstm_weights.hpp
/// Learned weights of KVPOP's mLSTM scorer and their safetensors layout (kvpop-paper App. B;
/// spec EVICTION.md §3, §4).

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <type_traits>
#include <string>
#include <vector>

#include "../../errors.hpp"
#include "../../eviction_config.hpp"
#include "../../io/safetensors.hpp"

namespace kvmem::score {

/// The mLSTM scorer's weights of one layer, one set per kv-head, float32 views in `MemorySpace`.
/// With D the key head_dim (even), Dv the value head_dim, X = D + Dv (the input x_t = [k_t ; v_t]) and
/// h = D / 2 (spec EVICTION.md §3, Q5):
///
/// | tensor  | shape          | meaning                                             |
/// |---------|----------------|-----------------------------------------------------|
/// | `w_q`   | [Hkv, X, h]    | query projection, before the Hedgehog map            |
/// | `w_k`   | [Hkv, X, h]    | key projection, before the Hedgehog map              |
/// | `w_v`   | [Hkv, X, h]    | value projection                                     |
/// | `w_i`   | [Hkv, X]       | input-gate weights (log input gate, exponential)     |
/// | `b_i`   | [Hkv]          | input-gate bias                                      |
/// | `w_f`   | [Hkv, X]       | forget-gate weights                                  |
/// | `b_f`   | [Hkv]          | forget-gate bias                                     |
/// | `w_s`   | [Hkv, h]       | score head weights                                   |
/// | `b_s`   | [Hkv]          | score head bias                                      |
/// | `theta` | [Hkv]          | decay logit: log gamma = log 0.999 + sigmoid(theta) (log 0.999999 - log 0.999) |
///
/// These are the names `load_mlstm_weights` reads from a safetensors file (F32 or F64) and that
/// `kvmem-run evict --scorer kvpop --weights FILE` expects.
template <class MemorySpace>
struct MLstmWeights {
  Kokkos::View<const float***, Kokkos::LayoutRight, MemorySpace> w_q, w_k, w_v;
  Kokkos::View<const float**, Kokkos::LayoutRight, MemorySpace> w_i, w_f, w_s;
  Kokkos::View<const float*, MemorySpace> b_i, b_f, b_s, theta;

  /// Throws kvmem::invalid_argument naming the first tensor that is missing (empty view) or whose
  /// extents differ from the table above for `cfg` (which needs an even head_dim).
  void validate(const EvictionConfig& cfg) const {
    require(cfg.head_dim % 2 == 0, "head_dim", cfg.head_dim, "must be even for the mLSTM scorer (h = D / 2, spec EVICTION.md §3)");
    const long H = cfg.kv_heads, X = static_cast<long>(cfg.head_dim) + cfg.value_dim, h = cfg.head_dim / 2;
    auto check = [&](const auto& view, const char* name, std::vector<long> want) {
      std::string got = "[", expect = "[";
      bool ok = view.data() != nullptr || view.size() == 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        got += (i ? ", " : "") + std::to_string(view.extent(i));
        expect += (i ? ", " : "") + std::to_string(want[i]);
        ok = ok && static_cast<long>(view.extent(i)) == want[i];
      }
      require(ok && view.size() > 0, std::string("mLSTM weight '") + name + "' shape", got + "]",
              "must be " + expect + "] (Hkv = " + std::to_string(H) + ", X = D + Dv = " + std::to_string(X) +
                  ", h = D / 2 = " + std::to_string(h) + "; spec EVICTION.md §3)");
    };
    check(w_q, "w_q", {H, X, h});
    check(w_k, "w_k", {H, X, h});
    check(w_v, "w_v", {H, X, h});
    check(w_i, "w_i", {H, X});
    check(b_i, "b_i", {H});
    check(w_f, "w_f", {H, X});
    check(b_f, "b_f", {H});
    check(w_s, "w_s", {H, h});
    check(b_s, "b_s", {H});
    check(theta, "theta", {H});
  }
};

/// Reads the mLSTM weights (names and shapes of MLstmWeights, each name after `prefix`: "" for a file of
/// one layer, "layers.<L>." in a kvmem weights file, policy/trained_weights.hpp) from a parsed safetensors
/// file into float32 views of `MemorySpace`, and validates them against `cfg`. Throws
/// kvmem::invalid_argument naming the tensor for a missing tensor, a dtype other than F32 or F64, or a
/// wrong shape.
template <class MemorySpace>
MLstmWeights<MemorySpace> load_mlstm_weights(const io::SafetensorsFile& file, const EvictionConfig& cfg,
                                             const std::string& prefix = "") {
  auto load = [&](const char* short_name, auto rank_tag) {
    constexpr int R = decltype(rank_tag)::value;
    const std::string full = prefix + short_name;
    const char* name = full.c_str();
    if (!file.has(full))
      throw invalid_argument(std::string("mLSTM weight '") + name + "': missing from the weights file (spec EVICTION.md §3)");
    const auto& t = file.at(full);
    require(t.dtype == "F32" || t.dtype == "F64", std::string("mLSTM weight '") + name + "' dtype", t.dtype,
            "must be F32 or F64");
    require(t.shape.size() == static_cast<std::size_t>(R), std::string("mLSTM weight '") + name + "' rank", t.shape.size(),
            "must be " + std::to_string(R));
    const auto values = io::to_double(t, name);
    std::vector<float> f(values.begin(), values.end());
    auto ext = [&](int i) { return static_cast<std::size_t>(t.shape[i]); };
    if constexpr (R == 1) {
      Kokkos::View<float*, Kokkos::LayoutRight, MemorySpace> v(std::string(name), ext(0));
      Kokkos::deep_copy(v, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(f.data(), ext(0)));
      return Kokkos::View<const float*, Kokkos::LayoutRight, MemorySpace>(v);
    } else if constexpr (R == 2) {
      Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> v(std::string(name), ext(0), ext(1));
      Kokkos::deep_copy(v, Kokkos::View<const float**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                               f.data(), ext(0), ext(1)));
      return Kokkos::View<const float**, Kokkos::LayoutRight, MemorySpace>(v);
    } else {
      Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace> v(std::string(name), ext(0), ext(1), ext(2));
      Kokkos::deep_copy(v, Kokkos::View<const float***, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                               f.data(), ext(0), ext(1), ext(2)));
      return Kokkos::View<const float***, Kokkos::LayoutRight, MemorySpace>(v);
    }
  };
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  using three = std::integral_constant<int, 3>;
  MLstmWeights<MemorySpace> w;
  w.w_q = load("w_q", three{});
  w.w_k = load("w_k", three{});
  w.w_v = load("w_v", three{});
  w.w_i = load("w_i", two{});
  w.b_i = load("b_i", one{});
  w.w_f = load("w_f", two{});
  w.b_f = load("b_f", one{});
  w.w_s = load("w_s", two{});
  w.b_s = load("b_s", one{});
  w.theta = load("theta", one{});
  w.validate(cfg);
  return w;
}

}  // namespace kvmem::score
