#pragma once
// Test harness: random KVM inputs for a batch, the kvmem kernels run over them on a chosen execution
// space, and the naive float64 reference (tests/reference/kvm_reference.hpp) run per sequence.

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvmem/kvmem.hpp>

#include "../reference/kvm_reference.hpp"
#include "worst_error.hpp"

namespace kvmem_test {

/// One batch of random inputs; tensors row-major as in the kvmem-run contract.
struct KvmCase {
  long B = 1, Hq = 2, Hkv = 1, T = 40, D = 8, Dv = 6;
  std::vector<long> lengths;  // empty = all T
  kvmem_ref::KvmParams params;
  unsigned seed = 1;
  bool zero_value_rows = false;   // some tokens get all-zero values
  bool duplicate_tokens = false;  // some tokens repeat an earlier key/value (novelty and argmax ties)
  kvmem::kernels::DecodeSplits decode_splits = kvmem::kernels::DecodeSplits::automatic;  // Memory::set_decode_splits
  bool decode_async = false;  // decode as a GPU does: plan_on_device(), reserve(T), decode_async, sync()
  kvmem::kernels::ReadoutPath readout_path = kvmem::kernels::ReadoutPath::automatic;  // Memory::set_readout_path
  bool expect_tensor_cores = false;  // REQUIRE that the readout runs on tensor cores (Memory::tensor_core_readout)
  std::vector<float> q, k, v, gate, ln_weight, ln_bias, tau_state, tau_bswa;

  long length(long b) const { return lengths.empty() ? T : lengths[b]; }

  /// Rounds the token inputs (q, k, v, gate) to the storage type S, as a memory of that type receives them,
  /// so that the float64 reference sees the same inputs (layer weights stay float32).
  template <kvmem::StorageType S>
  void round_inputs() {
    for (auto* x : {&q, &k, &v, &gate})
      for (auto& e : *x) e = kvmem::to_float(kvmem::from_float<S>(e));
  }

  void generate() {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
    auto fill = [&](std::vector<float>& x, std::size_t n, auto dist) {
      x.resize(n);
      for (auto& e : x) e = dist();
    };
    fill(q, B * Hq * T * D, [&] { return normal(rng); });
    fill(k, B * Hkv * T * D, [&] { return normal(rng); });
    fill(v, B * Hkv * T * Dv, [&] { return normal(rng); });
    fill(gate, B * Hkv * T, [&] { return uni(rng); });
    fill(ln_weight, D, [&] { return 1.0f + 0.2f * normal(rng); });
    fill(ln_bias, D, [&] { return 0.1f * normal(rng); });
    fill(tau_state, Hq, [&] { return 1.0f + 0.2f * normal(rng); });
    fill(tau_bswa, Hq, [&] { return 1.0f + 0.2f * normal(rng); });
    for (long b = 0; b < B; ++b)
      for (long h = 0; h < Hkv; ++h)
        for (long t = 0; t < T; ++t) {
          if (zero_value_rows && t % 5 == 3)
            std::fill_n(&v[((b * Hkv + h) * T + t) * Dv], Dv, 0.0f);
          if (duplicate_tokens && t % 4 == 2 && t >= 2) {
            std::copy_n(&k[((b * Hkv + h) * T + t - 2) * D], D, &k[((b * Hkv + h) * T + t) * D]);
            std::copy_n(&v[((b * Hkv + h) * T + t - 2) * Dv], Dv, &v[((b * Hkv + h) * T + t) * Dv]);
            gate[(b * Hkv + h) * T + t] = gate[(b * Hkv + h) * T + t - 2];
          }
        }
  }

  /// Sequence b for the reference (float inputs widened to double).
  kvmem_ref::KvmSequence sequence(long b) const {
    kvmem_ref::KvmSequence s;
    const long n = length(b);
    s.T = n, s.D = D, s.Dv = Dv, s.Hq = Hq, s.Hkv = Hkv;
    auto take = [&](const std::vector<float>& x, long heads, long dim) {
      std::vector<double> out;
      for (long h = 0; h < heads; ++h)
        for (long t = 0; t < n; ++t)
          for (long c = 0; c < dim; ++c) out.push_back(x[((b * heads + h) * T + t) * dim + c]);
      return out;
    };
    s.q = take(q, Hq, D);
    s.k = take(k, Hkv, D);
    s.v = take(v, Hkv, Dv);
    s.gate = take(gate, Hkv, 1);
    s.ln_weight.assign(ln_weight.begin(), ln_weight.end());
    s.ln_bias.assign(ln_bias.begin(), ln_bias.end());
    s.tau_state.assign(tau_state.begin(), tau_state.end());
    s.tau_bswa.assign(tau_bswa.begin(), tau_bswa.end());
    return s;
  }

  kvmem::MemoryConfig config() const {
    kvmem::MemoryConfig c;
    c.head_dim = static_cast<int>(D);
    c.value_dim = static_cast<int>(Dv);
    c.query_heads = static_cast<int>(Hq);
    c.kv_heads = static_cast<int>(Hkv);
    c.chunk = static_cast<int>(params.chunk);
    c.window_chunks = static_cast<int>(params.window_chunks);
    c.rope_dims = static_cast<int>(params.rope_dims);
    c.sinks = static_cast<int>(params.sinks);
    c.max_rows = params.chunk * params.max_chunks;
    return c;
  }
};

/// max over the case's queries, heads and keys of scale * ||q|| * ||key||, where a key is a window key or a
/// state row's read key LN_s(K): ||LN_s(K)|| <= max|w| sqrt(D) + ||b||.
inline double kvm_logit_abs(const kvmem_test::KvmCase& c) {
  double qmax = 0.0, kmax = 0.0, wmax = 0.0, bnorm = 0.0, tau = 0.0;
  auto norm = [](const float* x, long n) {
    double s = 0.0;
    for (long i = 0; i < n; ++i) s += double(x[i]) * x[i];
    return std::sqrt(s);
  };
  for (long i = 0; i < c.B * c.Hq * c.T; ++i) qmax = std::max(qmax, norm(&c.q[i * c.D], c.D));
  for (long i = 0; i < c.B * c.Hkv * c.T; ++i) kmax = std::max(kmax, norm(&c.k[i * c.D], c.D));
  for (long i = 0; i < c.D; ++i) wmax = std::max(wmax, std::abs(double(c.ln_weight[i])));
  bnorm = norm(c.ln_bias.data(), c.D);
  for (long h = 0; h < c.Hq; ++h) tau = std::max({tau, std::abs(double(c.tau_state[h])), std::abs(double(c.tau_bswa[h]))});
  return tau / std::sqrt(double(c.D)) * qmax * std::max(kmax, wmax * std::sqrt(double(c.D)) + bnorm);
}

/// max over the case's tokens of ||v||: a read value's element is at most its row's radius, a token's ||v||.
inline double value_norm_max(const KvmCase& c) {
  double vmax = 0.0;
  for (long i = 0; i < c.B * c.Hkv * c.T; ++i) {
    double s = 0.0;
    for (long d = 0; d < c.Dv; ++d) s += double(c.v[i * c.Dv + d]) * c.v[i * c.Dv + d];
    vmax = std::max(vmax, std::sqrt(s));
  }
  return vmax;
}

/// What the kernels produced for a batch: y [B, Hq, T, Dv] and the final state per sequence.
struct KvmOutput {
  std::vector<float> y;
  std::vector<float> lse;                                   // [B, Hq, T], the readout's log-sum-exp
  std::vector<long> rows;                                   // [B]
  std::vector<std::vector<float>> keys, values, radius, counts;  // per b: [Hkv, rows, D|Dv|1|1]
  std::vector<kvmem::kernels::ReadoutForm> forms;           // Memory::readout_form() after each call, in order
};

template <class MemorySpace>
Kokkos::View<float*, MemorySpace> device_vector(const std::vector<float>& x, const std::string& name) {
  Kokkos::View<float*, MemorySpace> v(name, x.size());
  Kokkos::deep_copy(v, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(x.data(), x.size()));
  return v;
}

/// Copies the final state of `mem` into `out`.
template <class Memory>
void read_state(const Memory& mem, const KvmCase& c, KvmOutput& out) {
  const auto& st = mem.rows();
  auto keys = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.keys);
  auto values = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.values);
  auto radius = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.radius);
  auto counts = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.counts);
  out.rows.assign(c.B, 0);
  out.keys.assign(c.B, {});
  out.values.assign(c.B, {});
  out.radius.assign(c.B, {});
  out.counts.assign(c.B, {});
  for (long b = 0; b < c.B; ++b) {
    const long m = mem.cursor(b).rows;
    out.rows[b] = m;
    for (long h = 0; h < c.Hkv; ++h)
      for (long i = 0; i < m; ++i) {
        for (long d = 0; d < c.D; ++d) out.keys[b].push_back(keys(b, h, i, d));
        for (long d = 0; d < c.Dv; ++d) out.values[b].push_back(values(b, h, i, d));
        out.radius[b].push_back(radius(b, h, i));
        out.counts[b].push_back(counts(b, h, i));
      }
  }
}

/// Calls f(budget) with the kvmem budget schedule matching the reference parameters.
template <class F>
void with_budget(const kvmem_ref::KvmParams& p, F&& f) {
  switch (p.schedule) {
    case kvmem_ref::Schedule::fixed: f(kvmem::budget::Fixed{p.min_len}); break;
    case kvmem_ref::Schedule::power_law:
      f(kvmem::budget::PowerLaw{p.min_len, p.growth_factor, p.growth_exponent, p.round_down});
      break;
    case kvmem_ref::Schedule::saturation: f(kvmem::budget::Saturating{p.min_len, p.saturation_n, p.round_down}); break;
  }
}

enum class Mode { prefill, decode, prefill_then_decode };

/// x as the storage type S (rounded by kvmem::from_float).
template <kvmem::StorageType S>
std::vector<S> stored_as(const std::vector<float>& x) {
  std::vector<S> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = kvmem::from_float<S>(x[i]);
  return out;
}

/// Runs the kvmem KVM memory on ExecSpace over case `c` with tokens in the storage type S (inputs rounded
/// to S; outputs widened back to float) and row eviction `row_policy` (score::RowEviction; the default
/// evicts none), merging by `Merge` (KVM's merge::WinnerTakeAll by default; merge::Proportional is checked
/// the same way). prefill_then_decode prefills the first `split` tokens of every sequence and decodes the
/// rest. Every call asks for the readout's log-sum-exp (the AttentionMemory overloads with lse).
template <class ExecSpace, kvmem::StorageType S = float, class RowPolicy = kvmem::score::KeepRows,
          class Merge = kvmem::merge::WinnerTakeAll>
KvmOutput run_kvm(const KvmCase& c, Mode mode, long split = 0, const ExecSpace& exec = ExecSpace(),
                  const RowPolicy& row_policy = {}) {
  using space = typename ExecSpace::memory_space;
  using view4 = Kokkos::View<S****, Kokkos::LayoutRight, space>;
  using view3 = Kokkos::View<S***, Kokkos::LayoutRight, space>;
  auto to4 = [&](const std::vector<float>& x, long h, long d, const std::string& n) {
    view4 v(n, c.B, h, c.T, d);
    const auto xs = stored_as<S>(x);
    Kokkos::deep_copy(v, Kokkos::View<const S****, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                             xs.data(), c.B, h, c.T, d));
    return v;
  };
  const view4 q = to4(c.q, c.Hq, c.D, "q"), k = to4(c.k, c.Hkv, c.D, "k"), v = to4(c.v, c.Hkv, c.Dv, "v");
  view3 gate("gate", c.B, c.Hkv, c.T);
  const auto gates = stored_as<S>(c.gate);
  Kokkos::deep_copy(gate, Kokkos::View<const S***, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                              gates.data(), c.B, c.Hkv, c.T));
  view4 y("y", c.B, c.Hq, c.T, c.Dv);
  Kokkos::View<float***, Kokkos::LayoutRight, space> lse("lse", c.B, c.Hq, c.T);
  Kokkos::deep_copy(lse, -std::numeric_limits<float>::infinity());  // what a prefill writes past a sequence
  kvmem::LayerWeights<space> w{device_vector<space>(c.ln_weight, "ln_weight"), device_vector<space>(c.ln_bias, "ln_bias"),
                               device_vector<space>(c.tau_state, "tau_state"), device_vector<space>(c.tau_bswa, "tau_bswa")};
  std::vector<long> len(c.B);
  for (long b = 0; b < c.B; ++b) len[b] = c.length(b);
  KvmOutput out;
  with_budget(c.params, [&](const auto& budget) {
    using budget_t = std::remove_cvref_t<decltype(budget)>;
    kvmem::Memory<ExecSpace, Merge, budget_t, kvmem::score::Novelty, RowPolicy, S> mem(c.config(), budget, w,
                                                                                       static_cast<int>(c.B), row_policy, exec);
    using memory_t = decltype(mem);
    mem.set_decode_splits(c.decode_splits);
    mem.set_readout_path(c.readout_path);
    if (c.expect_tensor_cores && !mem.tensor_core_readout(q))
      throw std::logic_error("run_kvm: the case expects the tensor-core readout, which does not apply");
    long first_decoded = 0;
    if (mode != Mode::decode) {
      std::vector<long> pre(c.B);
      for (long b = 0; b < c.B; ++b) pre[b] = mode == Mode::prefill ? len[b] : std::min(len[b], split);
      mem.prefill(typename memory_t::inputs{q, k, v, gate}, y, pre, lse);
      out.forms.push_back(mem.readout_form());
      first_decoded = mode == Mode::prefill ? c.T : split;
    }
    std::vector<unsigned char> active(c.B);
    if (c.decode_async) {
      mem.plan_on_device();
      mem.reserve(c.T);
    }
    for (long t = first_decoded; t < c.T; ++t) {
      for (long b = 0; b < c.B; ++b) active[b] = t < len[b];
      const auto at = std::make_pair(t, t + 1);
      auto s4 = [&](const view4& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at, Kokkos::ALL); };
      auto s3 = [&](const auto& x) { return Kokkos::subview(x, Kokkos::ALL, Kokkos::ALL, at); };
      const typename memory_t::inputs in{s4(q), s4(k), s4(v), s3(gate)};
      if (c.decode_async) {
        mem.set_active(active);
        mem.decode_async(in, s4(y), s3(lse));
      } else {
        mem.decode(in, s4(y), active, s3(lse));
      }
      out.forms.push_back(mem.readout_form());
    }
    if (c.decode_async) mem.sync();
    read_state(mem, c, out);
  });
  auto yh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  out.y.resize(yh.size());
  for (std::size_t i = 0; i < yh.size(); ++i) out.y[i] = kvmem::to_float(yh.data()[i]);
  auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
  out.lse.assign(lh.data(), lh.data() + lh.size());
  return out;
}

/// Appends `base` edited by `edit` (a callable on KvmCase&) to `cases`, seeded first_seed + its index: the
/// edge-case lists of the reference tests.
template <class Edit>
void add_case(std::vector<KvmCase>& cases, const KvmCase& base, unsigned first_seed, Edit edit) {
  KvmCase c = base;
  c.seed = first_seed + static_cast<unsigned>(cases.size());
  edit(c);
  cases.push_back(c);
}

/// Sequence b's own tokens out of a batch tensor x [B, heads, T, channels]: [heads, length, channels], as
/// the references write them.
inline std::vector<float> sequence_tokens(const std::vector<float>& x, long b, long heads, long T, long length,
                                          long channels) {
  std::vector<float> out;
  for (long h = 0; h < heads; ++h)
    for (long t = 0; t < length; ++t)
      for (long d = 0; d < channels; ++d) out.push_back(x[((b * heads + h) * T + t) * channels + d]);
  return out;
}

/// y of sequence b's own tokens out of a batch run: [Hq, length(b), Dv], as the reference writes it.
inline std::vector<float> sequence_y(const KvmOutput& got, const KvmCase& c, long b) {
  return sequence_tokens(got.y, b, c.Hq, c.T, c.length(b), c.Dv);
}

/// The readout's log-sum-exp of sequence b's own tokens out of a batch run: [Hq, length(b)], as the
/// reference writes it.
inline std::vector<float> sequence_lse(const KvmOutput& got, const KvmCase& c, long b) {
  return sequence_tokens(got.lse, b, c.Hq, c.T, c.length(b), 1);
}

}  // namespace kvmem_test
