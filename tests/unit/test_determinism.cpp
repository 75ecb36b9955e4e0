// Outputs do not depend on the batch a sequence is decoded in (docs/reliability.md, issue "Hardening"):
// a sequence gives the same bits alone as inside a ragged batch, in prefill, decode and prefill-then-decode,
// with every budget schedule. (Reruns and thread counts: tests/unit/test_modes.cpp.)
#include <catch2/catch_test_macros.hpp>

#include "kvm_harness.hpp"

using kvmem_ref::Schedule;
using kvmem_test::KvmCase;
using kvmem_test::Mode;

namespace {
KvmCase ragged_batch(Schedule schedule, unsigned seed) {
  KvmCase c;
  c.B = 5;
  c.T = 83;
  c.Hq = 4;
  c.Hkv = 2;
  c.D = 8;
  c.Dv = 6;
  c.lengths = {83, 0, 41, 1, 66};
  c.params.chunk = 4;
  c.params.window_chunks = 2;
  c.params.rope_dims = 2;
  c.params.sinks = 1;
  c.params.schedule = schedule;
  c.params.min_len = 2;
  c.params.growth_factor = 2.0;
  c.params.saturation_n = 24;
  c.params.max_chunks = 12;
  c.seed = seed;
  c.duplicate_tokens = true;  // ties in scores and routes
  c.zero_value_rows = true;
  c.generate();
  return c;
}

/// Sequence b of `c` as a batch of one, T = its length.
KvmCase alone(const KvmCase& c, long b) {
  KvmCase s = c;
  const long n = c.length(b);
  s.B = 1;
  s.T = n;
  s.lengths.clear();
  auto take = [&](const std::vector<float>& x, long heads, long dim) {
    std::vector<float> out;
    for (long h = 0; h < heads; ++h)
      for (long t = 0; t < n; ++t)
        for (long d = 0; d < dim; ++d) out.push_back(x[((b * heads + h) * c.T + t) * dim + d]);
    return out;
  };
  s.q = take(c.q, c.Hq, c.D);
  s.k = take(c.k, c.Hkv, c.D);
  s.v = take(c.v, c.Hkv, c.Dv);
  s.gate = take(c.gate, c.Hkv, 1);
  return s;
}

/// y of sequence b, tokens [0, length(b)), [Hq, n, Dv] row-major.
std::vector<float> y_of(const kvmem_test::KvmOutput& out, const KvmCase& c, long b) {
  std::vector<float> y;
  for (long h = 0; h < c.Hq; ++h)
    for (long t = 0; t < c.length(b); ++t)
      for (long d = 0; d < c.Dv; ++d) y.push_back(out.y[((b * c.Hq + h) * c.T + t) * c.Dv + d]);
  return y;
}
}  // namespace

TEST_CASE("a sequence gives the same bits alone and inside a ragged batch", "[kvm][determinism][batch]") {
  using exec = Kokkos::DefaultHostExecutionSpace;
  for (Schedule schedule : {Schedule::fixed, Schedule::power_law, Schedule::saturation}) {
    const auto batch = ragged_batch(schedule, 17 + static_cast<unsigned>(schedule));
    for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode}) {
      const long split = 29;
      const auto together = kvmem_test::run_kvm<exec>(batch, mode, split);
      for (long b = 0; b < batch.B; ++b) {
        INFO("schedule=" << static_cast<int>(schedule) << " mode=" << static_cast<int>(mode) << " sequence " << b
                         << " of length " << batch.length(b));
        const auto single = alone(batch, b);
        const auto by_itself = kvmem_test::run_kvm<exec>(single, mode, split);
        REQUIRE(by_itself.rows[0] == together.rows[b]);
        REQUIRE(y_of(by_itself, single, 0) == y_of(together, batch, b));
        REQUIRE(by_itself.keys[0] == together.keys[b]);
        REQUIRE(by_itself.values[0] == together.values[b]);
        REQUIRE(by_itself.radius[0] == together.radius[b]);
      }
    }
  }
}

TEST_CASE("a sequence gives the same bits whatever its neighbours hold", "[kvm][determinism][batch]") {
  // The same sequence 0 beside two different sets of neighbours (other data, other lengths).
  using exec = Kokkos::DefaultHostExecutionSpace;
  auto a = ragged_batch(Schedule::power_law, 5);
  auto b = ragged_batch(Schedule::power_law, 6);
  b.lengths = {83, 80, 3, 0, 17};
  const long per_head = a.T * a.D, per_head_v = a.T * a.Dv;
  std::copy_n(a.q.begin(), a.Hq * per_head, b.q.begin());  // sequence 0 of a into b
  std::copy_n(a.k.begin(), a.Hkv * per_head, b.k.begin());
  std::copy_n(a.v.begin(), a.Hkv * per_head_v, b.v.begin());
  std::copy_n(a.gate.begin(), a.Hkv * a.T, b.gate.begin());
  b.ln_weight = a.ln_weight;  // the layer's weights are shared by the batch
  b.ln_bias = a.ln_bias;
  b.tau_state = a.tau_state;
  b.tau_bswa = a.tau_bswa;
  for (Mode mode : {Mode::prefill, Mode::decode, Mode::prefill_then_decode}) {
    INFO("mode=" << static_cast<int>(mode));
    const auto ra = kvmem_test::run_kvm<exec>(a, mode, 50), rb = kvmem_test::run_kvm<exec>(b, mode, 50);
    REQUIRE(ra.rows[0] == rb.rows[0]);
    REQUIRE(y_of(ra, a, 0) == y_of(rb, b, 0));
    REQUIRE(ra.keys[0] == rb.keys[0]);
    REQUIRE(ra.values[0] == rb.values[0]);
    REQUIRE(ra.radius[0] == rb.radius[0]);
  }
}
