// Trained memory weights files (io/memory_weights.hpp, policy/trained_weights.hpp): each memory's layer as
// the views a memory reads, the merge gate x . W_g on a hand-computed case, and errors that name the file,
// the tensor and the shape expected.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include <kvmem/io/memory_weights.hpp>
#include <kvmem/policy/trained_weights.hpp>

using Catch::Matchers::ContainsSubstring;
using kvmem::io::MemoryWeightsFile;
using kvmem::io::SafetensorsFile;

namespace {
using mem_space = Kokkos::DefaultExecutionSpace::memory_space;

/// Element i of the n-th tensor listed in a weights file of layer L written by weights_of: 0.5 + 0.25 i +
/// 100 n + 10 L, so that no two tensors or layers hold the same values.
float element_value(long i, std::size_t n, int layer) {
  return 0.5f + 0.25f * static_cast<float>(i) + 100.0f * static_cast<float>(n) + 10.0f * layer;
}

/// A weights file of `memory` for a model with 2 layers, hidden 3, Hq 4, Hkv 2, D 4, holding `tensors` of
/// every layer, element i of the n-th tensor listed of layer L being element_value(i, n, L).
SafetensorsFile weights_of(const std::string& memory, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& tensors,
                           const std::string& shape = R"({"layers":2,"hidden":3,"query_heads":4,"kv_heads":2,"head_dim":4,"adapter_rank":0})") {
  SafetensorsFile f;
  f.metadata = {{"format", "kvmem-memory-weights-1"}, {"memory", memory}, {"model", "tiny"}, {"shape", shape}};
  for (int layer = 0; layer < 2; ++layer)
    for (std::size_t which = 0; which < tensors.size(); ++which) {
      const auto& [name, dims] = tensors[which];
      long n = 1;
      for (auto d : dims) n *= d;
      std::vector<float> v(static_cast<std::size_t>(n));
      for (long i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = element_value(i, which, layer);
      f.put("layers." + std::to_string(layer) + "." + name, dims, v.data());
    }
  return SafetensorsFile::parse(f.serialize(), "w.safetensors");  // as read from a file
}

const std::vector<std::pair<std::string, std::vector<std::int64_t>>> kvm_tensors = {
    {"gate_weight", {3, 2}}, {"ln_weight", {4}}, {"ln_bias", {4}}, {"tau_state", {4}}, {"tau_window", {4}}};

template <class View>
std::vector<float> host(const View& v) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

/// Elements of a loaded weight view (rank 1 to 3) that differ from tensor n of layer L as weights_of wrote
/// it, of extents `dims`: each element read through the view's own indices (a, b, c), which row-major is
/// element (a d1 + b) d2 + c of the tensor; a view of other extents counts as wholly wrong.
template <class View>
long wrong_elements(const View& v, std::vector<long> dims, std::size_t n, int layer) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  if (dims.size() != View::rank) return std::max(static_cast<long>(h.size()), 1L);
  for (std::size_t r = 0; r < dims.size(); ++r)
    if (static_cast<long>(h.extent(r)) != dims[r]) return std::max(static_cast<long>(h.size()), 1L);
  dims.resize(3, 1);  // a view of lower rank: the indices past its rank are 0
  long wrong = 0;
  for (long a = 0; a < dims[0]; ++a)
    for (long b = 0; b < dims[1]; ++b)
      for (long c = 0; c < dims[2]; ++c)
        wrong += h.access(a, b, c) != element_value((a * dims[1] + b) * dims[2] + c, n, layer) ? 1 : 0;
  return wrong;
}
}  // namespace

TEST_CASE("a KVM weights file's layer: LayerWeights views and the merge gate x . W_g", "[io][weights]") {
  const auto w = MemoryWeightsFile::from(weights_of("kvm", kvm_tensors), "w.safetensors", "kvm");
  REQUIRE(w.model() == "tiny");
  REQUIRE(w.shape().hidden == 3);
  const auto kvm = kvmem::load_kvm_layer<mem_space>(w, 1);
  // kvm_tensors' order: gate_weight (n = 0), ln_weight (1), ln_bias (2), tau_state (3), tau_window (4).
  REQUIRE(host(kvm.weights.ln_weight) == std::vector<float>{110.5f, 110.75f, 111.0f, 111.25f});
  REQUIRE(host(kvm.weights.ln_bias) == std::vector<float>{210.5f, 210.75f, 211.0f, 211.25f});
  REQUIRE(host(kvm.weights.tau_state) == std::vector<float>{310.5f, 310.75f, 311.0f, 311.25f});
  REQUIRE(host(kvm.weights.tau_window) == std::vector<float>{410.5f, 410.75f, 411.0f, 411.25f});
  // W_g of layer 1 = [[10.5, 10.75], [11, 11.25], [11.5, 11.75]]; x [B=1, T=2, hidden=3] = [[1, 0, 2], [0, -1, 1]]:
  // z[h=0] = (1*10.5 + 2*11.5, -11 + 11.5) = (33.5, 0.5); z[h=1] = (10.75 + 23.5, -11.25 + 11.75) = (34.25, 0.5).
  const auto z = kvmem::merge_gate_preactivation(kvm, {1, 0, 2, 0, -1, 1}, 1, 2);
  REQUIRE(z == std::vector<float>{33.5f, 0.5f, 34.25f, 0.5f});
  REQUIRE_THROWS_WITH(kvmem::merge_gate_preactivation(kvm, {1, 0, 2}, 1, 2), ContainsSubstring("x size"));
}

TEST_CASE("OVQ's beta and KVPOP's scorer from weights files", "[io][weights]") {
  const auto ovq = MemoryWeightsFile::from(weights_of("ovq", {{"beta", {4}}}), "o.safetensors", "ovq");
  const auto beta = kvmem::load_ovq_layer<mem_space>(ovq, 0);
  REQUIRE(host(beta.tau_state) == std::vector<float>{0.5f, 0.75f, 1.0f, 1.25f});
  REQUIRE(host(beta.tau_window) == host(beta.tau_state));
  // KVPOP: Hkv = 2, X = D + Dv = 8, h = D / 2 = 2.
  const auto kvpop = MemoryWeightsFile::from(
      weights_of("kvpop", {{"w_q", {2, 8, 2}}, {"w_k", {2, 8, 2}}, {"w_v", {2, 8, 2}}, {"w_i", {2, 8}}, {"b_i", {2}},
                           {"w_f", {2, 8}}, {"b_f", {2}}, {"w_s", {2, 2}}, {"b_s", {2}}, {"theta", {2}}}),
      "p.safetensors", "kvpop");
  kvmem::EvictionConfig cfg;
  cfg.head_dim = cfg.value_dim = 4;
  cfg.query_heads = 4;
  cfg.kv_heads = 2;
  const auto m = kvmem::load_kvpop_layer<mem_space>(kvpop, 1, cfg);
  REQUIRE(host(m.w_q)[31] == 10.5f + 0.25f * 31);  // element_value by hand
  REQUIRE(host(m.b_i) == std::vector<float>{410.5f, 410.75f});
  // Every element of every tensor of layer 1, at its own (kv-head, input, output) index; n in the order listed.
  CHECK(wrong_elements(m.w_q, {2, 8, 2}, 0, 1) == 0);
  CHECK(wrong_elements(m.w_k, {2, 8, 2}, 1, 1) == 0);
  CHECK(wrong_elements(m.w_v, {2, 8, 2}, 2, 1) == 0);
  CHECK(wrong_elements(m.w_i, {2, 8}, 3, 1) == 0);
  CHECK(wrong_elements(m.b_i, {2}, 4, 1) == 0);
  CHECK(wrong_elements(m.w_f, {2, 8}, 5, 1) == 0);
  CHECK(wrong_elements(m.b_f, {2}, 6, 1) == 0);
  CHECK(wrong_elements(m.w_s, {2, 2}, 7, 1) == 0);
  CHECK(wrong_elements(m.b_s, {2}, 8, 1) == 0);
  CHECK(wrong_elements(m.theta, {2}, 9, 1) == 0);
  REQUIRE_THROWS_WITH(kvmem::load_kvpop_layer<mem_space>(kvpop, 2, cfg), ContainsSubstring("outside [0, 2)"));
  REQUIRE_THROWS_WITH(kvmem::load_kvm_layer<mem_space>(ovq, 0), ContainsSubstring("memory kvm"));
}

TEST_CASE("the weights' element check finds one wrong element, another layer's tensor and other extents",
          "[io][weights][harness]") {
  // The test of wrong_elements itself: a check at the first and the last element only would pass the view
  // with one element changed in its middle.
  const auto file = MemoryWeightsFile::from(weights_of("kvpop", {{"w_q", {2, 8, 2}}}), "p.safetensors", "kvpop");
  auto w_q = file.layer_tensor(1, "w_q", {2, 8, 2});  // layer 1's w_q as the file holds it, row-major
  const Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged> good(w_q.data(), 2, 8, 2);
  REQUIRE(wrong_elements(good, {2, 8, 2}, 0, 1) == 0);
  auto changed = Kokkos::create_mirror(good);
  Kokkos::deep_copy(changed, good);
  changed(1, 3, 0) += 0.125f;  // element 22 of 32
  CHECK(wrong_elements(changed, {2, 8, 2}, 0, 1) == 1);
  CHECK(wrong_elements(good, {2, 8, 2}, 0, 0) == 32);  // layer 0's values
  CHECK(wrong_elements(good, {2, 2, 8}, 0, 1) == 32);  // other extents
  CHECK(wrong_elements(Kokkos::subview(good, 0, Kokkos::ALL, Kokkos::ALL), {2, 8, 2}, 0, 1) > 0);  // other rank
}

TEST_CASE("bad weights files name the file, the key or the tensor and the shape expected", "[io][weights][errors]") {
  const auto from = [](SafetensorsFile f, const std::string& memory = "kvm") {
    return MemoryWeightsFile::from(std::move(f), "w.safetensors", memory);
  };
  auto plain = weights_of("kvm", kvm_tensors);
  plain.metadata.erase("format");
  REQUIRE_THROWS_WITH(from(plain), ContainsSubstring("weights file 'w.safetensors' metadata format") &&
                                       ContainsSubstring("kvmem-memory-weights-1"));
  REQUIRE_THROWS_WITH(from(weights_of("kvm", kvm_tensors), "ovq"), ContainsSubstring("expected ovq"));
  REQUIRE_THROWS_WITH(from(weights_of("kvm", kvm_tensors, "[1, 2]")), ContainsSubstring("metadata shape"));
  REQUIRE_THROWS_WITH(from(weights_of("kvm", kvm_tensors, R"({"layers":2,"hidden":3})")),
                      ContainsSubstring("shape.query_heads"));
  REQUIRE_THROWS_WITH(from(weights_of("kvm", kvm_tensors, R"({"layers":0,"hidden":3,"query_heads":4,"kv_heads":2,"head_dim":4,"adapter_rank":0})")),
                      ContainsSubstring("shape.layers"));
  const auto w = from(weights_of("kvm", kvm_tensors));
  REQUIRE_THROWS_WITH(w.expect_model("other"), ContainsSubstring("another model than other"));
  REQUIRE_THROWS_WITH(w.expect_sizes(4, 1, 4), ContainsSubstring("shape.kv_heads"));
  REQUIRE_THROWS_WITH(w.layer_tensor(0, "tau_state", {5}), ContainsSubstring("layers.0.tau_state") &&
                                                              ContainsSubstring("expected dtype F32 and shape [5]"));
  REQUIRE_THROWS_WITH(w.layer_tensor(1, "beta", {4}), ContainsSubstring("layers.1.beta") && ContainsSubstring("(missing)"));
  REQUIRE_THROWS_WITH(w.layer_tensor(-1, "tau_state", {4}), ContainsSubstring("outside [0, 2)"));
  auto short_ln = weights_of("kvm", kvm_tensors);
  const float three[] = {1, 2, 3};
  short_ln.put("layers.1.ln_bias", {3}, three);
  REQUIRE_THROWS_WITH(kvmem::load_kvm_layer<mem_space>(from(short_ln), 1),
                      ContainsSubstring("layers.1.ln_bias") && ContainsSubstring("shape [4]"));
}
