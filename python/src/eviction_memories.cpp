/// \file eviction_memories.cpp
/// Python bindings of EvictionMemory (kvpop-paper Sec. 2; spec EVICTION.md) with every eviction scorer:
/// streaming (StreamingLLM, score::None), knorm (score::KeyNorm), h2o (score::AccumulatedAttention), tova
/// (score::LastQueryAttention), snapkv (SnapKV's observation window, score::ObservationWindow) and kvpop (the
/// learned mLSTM, score::MLstm); EvictionConfig::chunk and observation_window for compression per chunk
/// and at the end of a prompt.

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <map>
#include <string>

#include <kvmem/eviction.hpp>

#include "families.hpp"
#include "handles.hpp"
#include "tensors.hpp"

namespace kvmem::python {
namespace {

/// EvictionMemory<exec, Scorer, S> behind the AnyMemory interface.
template <class Scorer, StorageType S>
class Eviction final : public ContractMemory<EvictionMemory<exec, Scorer, S>> {
  using Mem = EvictionMemory<exec, Scorer, S>;

 public:
  Eviction(const EvictionConfig& cfg, int batch, const Scorer& scorer) : mem_(cfg, batch, scorer) {}

  [[nodiscard]] nb::dict state() const override {
    const auto& cache = mem_.cache();
    const long B = mem_.batch(), H = mem_.config().kv_heads, K = static_cast<long>(cache.positions.extent(2));
    Kokkos::View<long***, Kokkos::LayoutRight, mem_space> positions("kvmem::python::kept_positions", B, H, K);
    Kokkos::View<long**, Kokkos::LayoutRight, mem_space> rows("kvmem::python::kept_rows", B, H);
    mem_.kept(positions, rows);
    nb::dict d;
    d["keys"] = to_numpy(cache.keys);
    d["values"] = to_numpy(cache.values);
    d["slot_positions"] = to_numpy(cache.positions);
    d["kept_positions"] = to_numpy(positions);
    d["kept_rows"] = to_numpy(rows);
    if (mem_.config().merge_evicted) d["counts"] = to_numpy(cache.counts);  // tokens per slot's row
    return d;
  }

 private:
  Mem& memory() override { return mem_; }
  const Mem& memory() const override { return mem_; }
  typename Mem::inputs inputs(const Call& c) const override {
    const auto t = c.views<S>();
    return {t.q, t.k, t.v};
  }
  Mem mem_;
};

/// An EvictionMemory with `scorer`, of the storage type `dtype` names; returns its handle.
template <class Scorer>
long add(const EvictionConfig& cfg, int batch, const Scorer& scorer, const std::string& dtype) {
  return with_storage(dtype, [&](auto storage) -> long {
    return handles().add(std::make_unique<Eviction<Scorer, typename decltype(storage)::type>>(cfg, batch, scorer));
  });
}

/// The mLSTM weights (spec EVICTION.md §3) from named tensors, copied to the device; throws
/// kvmem::invalid_argument naming a missing one.
score::MLstmWeights<mem_space> mlstm_weights(const std::map<std::string, nb::ndarray<>>& w) {
  auto get = [&](const char* name) -> const nb::ndarray<>& {
    const auto it = w.find(name);
    if (it == w.end()) throw invalid_argument(detail::describe("weights", std::string("(no '") + name + "')",
                                                               "the kvpop scorer needs w_q, w_k, w_v, w_i, b_i, w_f, b_f, w_s, b_s, theta"));
    return it->second;
  };
  score::MLstmWeights<mem_space> m;
  m.w_q = weight_copy<3>(get("w_q"), "w_q");
  m.w_k = weight_copy<3>(get("w_k"), "w_k");
  m.w_v = weight_copy<3>(get("w_v"), "w_v");
  m.w_i = weight_copy<2>(get("w_i"), "w_i");
  m.w_f = weight_copy<2>(get("w_f"), "w_f");
  m.w_s = weight_copy<2>(get("w_s"), "w_s");
  m.b_i = weight_copy<1>(get("b_i"), "b_i");
  m.b_f = weight_copy<1>(get("b_f"), "b_f");
  m.b_s = weight_copy<1>(get("b_s"), "b_s");
  m.theta = weight_copy<1>(get("theta"), "theta");
  return m;
}

/// An EvictionMemory with the scorer named `scorer`, of storage type `dtype`; returns its handle. Throws
/// kvmem::invalid_argument for an unknown scorer or dtype, options the scorer does not take, or what the
/// memory rejects.
long make_eviction(const EvictionConfig& cfg, int batch, const std::string& scorer, bool h2o_normalize,
                   bool tova_layer_mean, const std::map<std::string, nb::ndarray<>>& weights, const std::string& normalizer,
                   const std::string& dtype) {
  require(scorer == "h2o" || !h2o_normalize, "h2o_normalize", h2o_normalize, "applies to the h2o scorer only");
  require(scorer == "tova" || !tova_layer_mean, "tova_layer_mean", tova_layer_mean, "applies to the tova scorer only");
  require(scorer == "kvpop" || weights.empty(), "weights", weights.size(), "only the kvpop scorer takes weights");
  if (scorer == "streaming") return add(cfg, batch, score::None{}, dtype);
  if (scorer == "knorm") return add(cfg, batch, score::KeyNorm{}, dtype);
  if (scorer == "h2o") {
    score::AccumulatedAttention h2o;
    h2o.normalize = h2o_normalize;
    return add(cfg, batch, h2o, dtype);
  }
  if (scorer == "tova") {
    score::LastQueryAttention tova;
    tova.layer_mean = tova_layer_mean;
    return add(cfg, batch, tova, dtype);
  }
  if (scorer == "snapkv") return add(cfg, batch, score::ObservationWindow{}, dtype);
  if (scorer == "kvpop") {
    require(normalizer == "xlstm" || normalizer == "plain", "normalizer", normalizer, "must be xlstm or plain");
    return add(cfg, batch, score::MLstm<mem_space>(mlstm_weights(weights), normalizer == "plain" ? score::MLstmNormalizer::plain
                                                                                               : score::MLstmNormalizer::xlstm),
               dtype);
  }
  throw invalid_argument(detail::describe("scorer", scorer, "unknown eviction scorer; expected streaming, knorm, h2o, tova, snapkv or kvpop"));
}

}  // namespace

void bind_eviction_memories(nb::module_& m) {
  nb::class_<EvictionConfig>(m, "EvictionConfig")
      .def(nb::init<>())
      .def_rw("head_dim", &EvictionConfig::head_dim)
      .def_rw("value_dim", &EvictionConfig::value_dim)
      .def_rw("query_heads", &EvictionConfig::query_heads)
      .def_rw("kv_heads", &EvictionConfig::kv_heads)
      .def_rw("sinks", &EvictionConfig::sinks)
      .def_rw("window", &EvictionConfig::window)
      .def_rw("top_k", &EvictionConfig::top_k)
      .def_rw("decay_interval", &EvictionConfig::decay_interval)
      .def_rw("merge_evicted", &EvictionConfig::merge_evicted)
      .def_rw("chunk", &EvictionConfig::chunk)
      .def_rw("observation_window", &EvictionConfig::observation_window);
  m.def("make_eviction", &make_eviction, nb::arg("config"), nb::arg("batch"), nb::arg("scorer"), nb::arg("h2o_normalize"),
        nb::arg("tova_layer_mean"), nb::arg("weights"), nb::arg("normalizer"), nb::arg("dtype"),
        "An eviction memory (EvictionMemory<exec, Scorer, Storage>; spec EVICTION.md) of storage type `dtype`; returns "
        "its handle.");
}

}  // namespace kvmem::python
