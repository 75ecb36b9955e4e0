/// \file trellis_memory.cpp
/// Python binding of TrellisMemory (trellis-paper Sec. 3, eqs. 4-14; spec TRELLIS.md): the fixed-slot memory
/// trained at test time by gradient descent (merge::GradientDescent).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include <kvmem/trellis_memory.hpp>

#include "families.hpp"
#include "handles.hpp"
#include "tensors.hpp"

namespace kvmem::python {
namespace {

/// TrellisMemory<exec, S> behind the AnyMemory interface; Call::extras holds alpha, beta1, gamma1, beta2,
/// gamma2 (of storage type S, as q, k, v).
template <StorageType S>
class Trellis final : public ContractMemory<TrellisMemory<exec, S>> {
  using Mem = TrellisMemory<exec, S>;

 public:
  Trellis(const TrellisConfig& cfg, const TrellisWeights<mem_space>& w, int batch) : weights_(w), mem_(cfg, weights_, batch) {}

  [[nodiscard]] nb::dict state() const override {
    nb::dict d;
    d["m1"] = to_numpy(mem_.m1());
    d["m2"] = to_numpy(mem_.m2());
    return d;
  }

 private:
  Mem& memory() override { return mem_; }
  const Mem& memory() const override { return mem_; }
  typename Mem::inputs inputs(const Call& c) const override {
    require(c.extras.size() == 5, "trellis inputs", c.extras.size(), "must be alpha, beta1, gamma1, beta2, gamma2");
    const auto t = c.views<S>();
    return {t.q, t.k, t.v, token_view<S>(c.extras[0], "alpha"), gate_view<S>(c.extras[1], "beta1"),
            gate_view<S>(c.extras[2], "gamma1"), gate_view<S>(c.extras[3], "beta2"), gate_view<S>(c.extras[4], "gamma2")};
  }
  TrellisWeights<mem_space> weights_;
  TrellisMemory<exec, S> mem_;
};

/// A Trellis memory of storage type `dtype`; `phi` and `f` by name (merge::parse_phi, parse_activation);
/// ln_weight/ln_bias [m] (float32) or None for no LN-SiLU affine. Returns its handle.
long make_trellis(TrellisConfig cfg, const std::string& phi, const std::string& f, const std::optional<nb::ndarray<>>& ln_weight,
                  const std::optional<nb::ndarray<>>& ln_bias, int batch, const std::string& dtype) {
  cfg.phi = merge::parse_phi(phi);
  cfg.f = merge::parse_activation(f);
  TrellisWeights<mem_space> w;
  require(ln_weight.has_value() == ln_bias.has_value(), "ln_weight/ln_bias", ln_weight ? "ln_bias missing" : "ln_weight missing",
          "give both or neither");
  if (ln_weight) {
    w.ln_weight = weight_copy<1>(*ln_weight, "ln_weight");
    w.ln_bias = weight_copy<1>(*ln_bias, "ln_bias");
  }
  return with_storage(dtype, [&](auto storage) -> long {
    return handles().add(std::make_unique<Trellis<typename decltype(storage)::type>>(cfg, w, batch));
  });
}

}  // namespace

void bind_trellis_memory(nb::module_& m) {
  nb::class_<TrellisConfig>(m, "TrellisConfig")
      .def(nb::init<>())
      .def_rw("slots", &TrellisConfig::slots)
      .def_rw("head_dim", &TrellisConfig::head_dim)
      .def_rw("value_dim", &TrellisConfig::value_dim)
      .def_rw("heads", &TrellisConfig::heads)
      .def_rw("chunk", &TrellisConfig::chunk)
      .def_rw("readout2_phi", &TrellisConfig::readout2_phi)
      .def_rw("grad_scale", &TrellisConfig::grad_scale)
      .def_rw("ln_eps", &TrellisConfig::ln_eps)
      .def_rw("l2_eps", &TrellisConfig::l2_eps)
      .def_rw("check_gates", &TrellisConfig::check_gates);
  m.def("make_trellis", &make_trellis, nb::arg("config"), nb::arg("phi"), nb::arg("f"), nb::arg("ln_weight").none(),
        nb::arg("ln_bias").none(), nb::arg("batch"), nb::arg("dtype"),
        "A Trellis memory (TrellisMemory<exec, Storage>; spec TRELLIS.md) of storage type `dtype`; returns its handle.");
}

}  // namespace kvmem::python
