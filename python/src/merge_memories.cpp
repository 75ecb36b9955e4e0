/// \file merge_memories.cpp
/// Python bindings of the merging memories: KVM (kvm-paper; merge::WinnerTakeAll), OVQ (ovq-paper;
/// merge::KMeansCount) and proportional merging (merge::Proportional), each with the budget schedules fixed,
/// power-law, saturating and plateau, and KVM with H2O eviction of its state rows (fixed and power-law
/// budgets).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <kvmem/kvmem.hpp>

#include "families.hpp"
#include "handles.hpp"
#include "tensors.hpp"

namespace kvmem::python {
namespace {

/// The compiled memory `Mem` behind the AnyMemory interface. The learned weights are device copies that
/// live as long as the memory.
template <class Mem>
class MergeMemory final : public ContractMemory<Mem> {
  using S = typename Mem::storage_type;

 public:
  template <class... RowPolicy>
  MergeMemory(const MemoryConfig& cfg, const typename Mem::budget_type& budget, const LayerWeights<mem_space>& weights,
              int batch, bool counts, const RowPolicy&... row_policy)
      : weights_(weights), mem_(cfg, budget, weights_, batch, row_policy...), counts_(counts) {}

  [[nodiscard]] nb::dict state() const override {
    nb::dict d;
    const auto& rows = mem_.rows();
    d["keys"] = to_numpy(rows.keys);
    d["values"] = to_numpy(rows.values);
    d[counts_ ? "counts" : "radius"] = to_numpy(counts_ ? rows.counts : rows.radius);
    nb::list live;
    for (long b = 0; b < mem_.batch(); ++b) live.append(mem_.cursor(b).rows);
    d["rows"] = live;
    nb::list window;
    for (long b = 0; b < mem_.batch(); ++b) window.append(mem_.window_tokens(b));
    d["window_tokens"] = window;
    return d;
  }

 private:
  Mem& memory() override { return mem_; }
  const Mem& memory() const override { return mem_; }
  typename Mem::inputs inputs(const Call& c) const override {
    const auto t = c.views<S>();
    return {t.q, t.k, t.v, c.extras.empty() ? typename Mem::gates_in{} : gate_view<S>(c.extras[0], "gate")};
  }
  LayerWeights<mem_space> weights_;
  Mem mem_;
  bool counts_;
};

/// Calls make(budget) with the kvmem::budget value that `b` names; throws kvmem::invalid_argument for an
/// unknown schedule.
template <class Make>
long with_budget(const BudgetArgs& b, Make&& make) {
  if (b.kind == "fixed") return make(budget::Fixed{b.min_rows});
  if (b.kind == "power-law") return make(budget::PowerLaw{b.min_rows, b.growth_factor, b.growth_exponent, b.round_down});
  if (b.kind == "saturating") return make(budget::Saturating{b.min_rows, b.saturation_n, b.round_down});
  if (b.kind == "plateau") return make(budget::Plateau{b.plateau_n});
  throw invalid_argument(detail::describe("budget", b.kind, "unknown budget schedule; expected fixed, power-law, saturating or plateau"));
}

/// A KVM memory of storage type S with the budget schedule `budget` (row eviction above
/// `evict_rows_above` rows when it is > 0); returns its handle.
template <StorageType S, class Budget>
long add_kvm(const MemoryConfig& cfg, const Budget& budget, const LayerWeights<mem_space>& w, int batch, long evict_rows_above) {
  if (evict_rows_above == 0)
    return handles().add(std::make_unique<MergeMemory<KvmMemory<exec, Budget, S>>>(cfg, budget, w, batch, false));
  if constexpr (std::is_same_v<Budget, budget::Fixed> || std::is_same_v<Budget, budget::PowerLaw>) {
    using mem_t = KvmMemoryWithRowEviction<exec, Budget, score::RowAccumulatedAttention, S>;
    return handles().add(std::make_unique<MergeMemory<mem_t>>(cfg, budget, w, batch, false,
                                                              score::RowAccumulatedAttention{.max_rows = evict_rows_above}));
  }
  throw invalid_argument(detail::describe("evict_rows_above", evict_rows_above, "row eviction is compiled for the fixed and "
                                                                                "power-law budgets only"));
}

long make_kvm(const MemoryConfig& cfg, const BudgetArgs& b, const nb::ndarray<>& ln_weight, const nb::ndarray<>& ln_bias,
              const nb::ndarray<>& tau_state, const nb::ndarray<>& tau_window, int batch, long evict_rows_above,
              const std::string& dtype) {
  const LayerWeights<mem_space> w{weight_copy<1>(ln_weight, "ln_weight"), weight_copy<1>(ln_bias, "ln_bias"),
                                  weight_copy<1>(tau_state, "tau_state"), weight_copy<1>(tau_window, "tau_window")};
  return with_budget(b, [&](const auto& budget) -> long {
    return with_storage(dtype, [&](auto storage) -> long {
      return add_kvm<typename decltype(storage)::type>(cfg, budget, w, batch, evict_rows_above);
    });
  });
}

long make_ovq(const MemoryConfig& cfg, const BudgetArgs& b, const nb::ndarray<>& beta, int batch, const std::string& dtype) {
  const auto betas = weight_copy<1>(beta, "beta");
  const LayerWeights<mem_space> w{{}, {}, betas, betas};
  return with_budget(b, [&](const auto& budget) -> long {
    return with_storage(dtype, [&](auto storage) -> long {
      using mem_t = OvqMemory<exec, std::remove_cvref_t<decltype(budget)>, typename decltype(storage)::type>;
      return handles().add(std::make_unique<MergeMemory<mem_t>>(cfg, budget, w, batch, true));
    });
  });
}

/// A proportional-merge memory (merge::Proportional; tau_state = tau_window = 1, the model's own scale);
/// returns its handle.
long make_proportional(const MemoryConfig& cfg, const BudgetArgs& b, int batch, const std::string& dtype) {
  Kokkos::View<float*, mem_space> ones("kvmem::python::unit_temperatures", cfg.query_heads);
  Kokkos::deep_copy(ones, 1.0f);
  const LayerWeights<mem_space> w{{}, {}, ones, ones};
  return with_budget(b, [&](const auto& budget) -> long {
    return with_storage(dtype, [&](auto storage) -> long {
      using mem_t = ProportionalMemory<exec, std::remove_cvref_t<decltype(budget)>, typename decltype(storage)::type>;
      return handles().add(std::make_unique<MergeMemory<mem_t>>(cfg, budget, w, batch, true));
    });
  });
}

}  // namespace

void bind_merge_memories(nb::module_& m) {
  nb::class_<BudgetArgs>(m, "BudgetArgs")
      .def(nb::init<>())
      .def_rw("kind", &BudgetArgs::kind)
      .def_rw("min_rows", &BudgetArgs::min_rows)
      .def_rw("growth_factor", &BudgetArgs::growth_factor)
      .def_rw("growth_exponent", &BudgetArgs::growth_exponent)
      .def_rw("round_down", &BudgetArgs::round_down)
      .def_rw("saturation_n", &BudgetArgs::saturation_n)
      .def_rw("plateau_n", &BudgetArgs::plateau_n);
  m.def("make_kvm", &make_kvm, nb::arg("config"), nb::arg("budget"), nb::arg("ln_weight"), nb::arg("ln_bias"),
        nb::arg("tau_state"), nb::arg("tau_window"), nb::arg("batch"), nb::arg("evict_rows_above"), nb::arg("dtype"),
        "A KVM memory (kvm-paper Sec. 4; KvmMemory<exec, Budget, Storage>) of storage type `dtype`; returns its handle.");
  m.def("make_ovq", &make_ovq, nb::arg("config"), nb::arg("budget"), nb::arg("beta"), nb::arg("batch"), nb::arg("dtype"),
        "An OVQ memory (ovq-paper Sec. 3.2; OvqMemory<exec, Budget, Storage>) of storage type `dtype`; returns its handle.");
  m.def("make_proportional", &make_proportional, nb::arg("config"), nb::arg("budget"), nb::arg("batch"), nb::arg("dtype"),
        "A proportional-merge memory (merge::Proportional; ProportionalMemory<exec, Budget, Storage>) of storage type "
        "`dtype`; returns its handle.");
}

}  // namespace kvmem::python
