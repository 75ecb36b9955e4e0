#pragma once
// Exact attention in a storage type against a float64 softmax of the same rounded inputs, within the bound
// of docs/numerics.md (storage_bound.hpp): shared by the storage-type tests (host backends, the portable
// kernels) and the tensor-core tests (a GPU, FlashInfer's kernel: the bound plus 2 u V).
#include <Kokkos_Core.hpp>
#include <catch2/catch_test_macros.hpp>
#include <algorithm>
#include <cmath>
#include <vector>

#include <kvmem/dtype.hpp>
#include <kvmem/kernels/readout/exact_attention.hpp>

#include "kvm_harness.hpp"
#include "storage_bound.hpp"
#include "worst_error.hpp"

namespace kvmem_test {

/// Exact attention on ExecSpace with q, k, v, y of the storage type S against a float64 softmax of the same
/// (rounded) inputs, y [B, Hq, T, Dv] widened to float: every output within the bound, and a decode step at
/// the last position (first_position T - 1) gives that row of the prompt bit for bit. With `tensor_cores`
/// the readout must run on FlashInfer's kernel (flashinfer_exact_applies, else the test fails), the bound
/// grows by 2 u V (docs/numerics.md, "The readout on tensor cores"; 3 u V for a decode step over more than
/// readout_split_keys keys, which FlashInfer partitions) and the decode row is held to the bound instead of
/// the prompt's bits. q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] row-major, rounded here.
template <class ExecSpace, class S>
void exact_attention_within_bound(long B, long Hq, long Hkv, long T, long D, long Dv, std::vector<float> q,
                                  std::vector<float> k, std::vector<float> v, bool tensor_cores = false) {
  using space = typename ExecSpace::memory_space;
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = kvmem::to_float(kvmem::from_float<S>(e));
  const auto qs = stored_as<S>(q), ks = stored_as<S>(k), vs = stored_as<S>(v);
  using host4 = Kokkos::View<const S****, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  using view4 = Kokkos::View<S****, Kokkos::LayoutRight, space>;
  auto to_device = [](const std::vector<S>& x, long b, long h, long t, long d) {
    view4 out("x", b, h, t, d);
    Kokkos::deep_copy(out, host4(x.data(), b, h, t, d));
    return out;
  };
  std::vector<S> q_last(B * Hq * D);
  for (long bh = 0; bh < B * Hq; ++bh)
    for (long c = 0; c < D; ++c) q_last[bh * D + c] = qs[(bh * T + T - 1) * D + c];
  const view4 qd = to_device(qs, B, Hq, T, D), kd = to_device(ks, B, Hkv, T, D), vd = to_device(vs, B, Hkv, T, Dv),
              q1 = to_device(q_last, B, Hq, 1, D);
  view4 yd("y", B, Hq, T, Dv), y1d("y1", B, Hq, 1, Dv);
  if (tensor_cores) REQUIRE(kvmem::kernels::flashinfer_exact_applies<ExecSpace>(kvmem::kernels::ReadoutPath::automatic, qd, kd, vd));
  kvmem::kernels::exact_causal_attention(ExecSpace(), qd, kd, vd, yd);
  kvmem::kernels::exact_causal_attention(ExecSpace(), q1, kd, vd, y1d, nullptr, T - 1);
  const auto y = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), yd);
  const auto y1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y1d);
  const double u_s = kvmem::unit_roundoff<S>;
  WorstError worst_excess;  // the largest |y - ref| - limit (an excess over the bound), at least 0
  long differ = 0;
  const long G = Hq / Hkv;
  for (long b = 0; b < B; ++b)
    for (long hq = 0; hq < Hq; ++hq)
      for (long u = 0; u < T; ++u) {
        const long h = hq / G;
        std::vector<double> logit(u + 1);
        double top = -INFINITY, sum = 0.0, logit_abs = 0.0, vmax = 0.0;
        for (long p = 0; p <= u; ++p) {
          double s = 0.0, a = 0.0;
          for (long c = 0; c < D; ++c) {
            const double prod = double(q[((b * Hq + hq) * T + u) * D + c]) * k[((b * Hkv + h) * T + p) * D + c];
            s += prod, a += std::abs(prod);
          }
          logit[p] = s / std::sqrt(double(D));
          logit_abs = std::max(logit_abs, a / std::sqrt(double(D)));
          top = std::max(top, logit[p]);
          for (long c = 0; c < Dv; ++c) vmax = std::max(vmax, std::abs(double(v[((b * Hkv + h) * T + p) * Dv + c])));
        }
        std::vector<double> ref(Dv, 0.0);
        for (long p = 0; p <= u; ++p) {
          const double e = std::exp(logit[p] - top);
          sum += e;
          for (long c = 0; c < Dv; ++c) ref[c] += e * v[((b * Hkv + h) * T + p) * Dv + c];
        }
        // Exact attention holds nothing of its own: keys and values are the inputs, only y is rounded.
        const StorageBound bound{u_s, 0.0, 0.0, double(D), double(u + 1), logit_abs, vmax};
        const double limit = bound.value() + (tensor_cores ? 2.0 * u_s * vmax : 0.0);
        for (long c = 0; c < Dv; ++c) worst_excess.add_error(std::abs(kvmem::to_float(y(b, hq, u, c)) - ref[c] / sum) - limit);
        if (u == T - 1)
          for (long c = 0; c < Dv; ++c) {
            if (tensor_cores)  // past readout_split_keys keys, a decode step's partition rounds its chunks too
              worst_excess.add_error(std::abs(kvmem::to_float(y1(b, hq, 0, c)) - ref[c] / sum) - limit -
                                     (T > kvmem::kernels::readout_split_keys ? u_s * vmax : 0.0));
            else
              differ += y1(b, hq, 0, c).bits != y(b, hq, u, c).bits;
          }
      }
  CHECK(worst_excess <= 0.0);
  CHECK(differ == 0);
}

}  // namespace kvmem_test
