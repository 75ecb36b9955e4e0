// The readout on tensor cores (kernels/readout/flashinfer.hpp, FlashInfer's FA2 paged prefill) against the
// portable readout and the float64 reference, on Kokkos::Cuda in bfloat16 and float16. Compiled only where
// the build links kvmem::flashinfer (CMake option KVMEM_FLASHINFER, a Cuda build); runs on a GPU
// (scripts/gpu-check). What it checks (docs/numerics.md, "The readout on tensor cores"):
// - the state (rows, sums, radii, counts) is the portable path's bit for bit: no merge reads the readout;
// - y within the storage bound plus 2u V of the float64 reference (one-target cases, whose merge decisions
//   cannot depend on rounding), and within twice that of the portable path (cases with ranked merges);
// - the readout's log-sum-exp within the logits' bound of the portable path's;
// - prefill, decode, and prefill then decode, and decode_async, for KVM (no row bias) and KVM proportional
//   (a log-count row bias), D = 64 and 128, GQA groups 1, 2 and 8, sequences of different lengths (one token);
// - exact attention (kernels::exact_causal_attention) on tensor cores against the float64 softmax within the
//   bound plus 2u V, prompts and a decode step (300 tokens), and a decode step over 1,100 keys, partitioned;
// - decode steps of a memory whose window and state pass 1,024 keys (FlashInfer's KV partition).
#include <Kokkos_Core.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <algorithm>
#include <cmath>

#include "exact_bound.hpp"
#include "float_bits.hpp"
#include "kvm_harness.hpp"
#include "storage_bound.hpp"

#ifdef KOKKOS_ENABLE_CUDA

using kvmem::bfloat16;
using kvmem::float16;
using kvmem::kernels::ReadoutPath;

namespace {

/// A case of head_dim D with G = Hq / Hkv, over three sequences of 150, 97 and 1 tokens, chunk 16 and a
/// window of two chunks; `one_target`: sinks = chunk - 1 and one chunk of rows (every merge routes to the
/// one non-sink row), otherwise a fixed budget of 48 rows with ranked merges.
kvmem_test::KvmCase tensor_core_case(long D, long Hq, long Hkv, bool one_target, unsigned seed) {
  kvmem_test::KvmCase c;
  c.B = 3, c.Hq = Hq, c.Hkv = Hkv, c.T = 150, c.D = D, c.Dv = D, c.seed = seed;
  c.lengths = {150, 97, 1};
  c.params.chunk = 16, c.params.window_chunks = 2, c.params.rope_dims = 8;
  c.params.schedule = kvmem_ref::Schedule::fixed;
  if (one_target) {
    c.params.sinks = 15, c.params.min_len = 16, c.params.max_chunks = 1;
  } else {
    c.params.sinks = 1, c.params.min_len = 48, c.params.max_chunks = 3;
  }
  c.generate();
  return c;
}

/// Largest |a - b| over every sequence's own tokens of two outputs [B, Hq, T, per_token] of case c,
/// NaN-aware (kvmem_test::WorstError); outputs of different sizes fail.
kvmem_test::WorstError worst_difference(const std::vector<float>& a, const std::vector<float>& b,
                                        const kvmem_test::KvmCase& c, long per_token) {
  if (a.size() != b.size()) return kvmem_test::worst_abs_error(a, b);  // +infinity: the sizes differ
  kvmem_test::WorstError worst;
  for (long s = 0; s < c.B; ++s)
    worst.add_all(kvmem_test::sequence_tokens(a, s, c.Hq, c.T, c.length(s), per_token),
                  kvmem_test::sequence_tokens(b, s, c.Hq, c.T, c.length(s), per_token));
  return worst;
}

/// The tensor-core path against the portable one on case c (and, `against_reference`, the float64
/// reference). `partitioned`: decode steps read more than readout_split_keys keys of a segment, which
/// FlashInfer partitions (one more rounding of each chunk's output).
template <class S, class Merge>
void compare_paths(kvmem_test::KvmCase c, kvmem_test::Mode mode, bool against_reference, bool partitioned = false) {
  c.round_inputs<S>();
  const double u = kvmem::unit_roundoff<S>, vmax = kvmem_test::value_norm_max(c);
  const kvmem_test::StorageBound bound{u, u, u, double(c.D + c.T), double(c.T + c.params.chunk),
                                       kvmem_test::kvm_logit_abs(c), vmax};
  // P and each segment's output in 16 bits; a partition's chunk outputs too.
  const double tensor_core_bound = bound.value() + (partitioned ? 3.0 : 2.0) * u * vmax;
  c.readout_path = ReadoutPath::portable;
  const auto portable = kvmem_test::run_kvm<Kokkos::Cuda, S, kvmem::score::KeepRows, Merge>(c, mode, 40);
  c.readout_path = ReadoutPath::automatic;
  c.expect_tensor_cores = true;
  const auto tensor = kvmem_test::run_kvm<Kokkos::Cuda, S, kvmem::score::KeepRows, Merge>(c, mode, 40);
  // The state is the portable path's, bit for bit.
  REQUIRE(tensor.rows == portable.rows);
  for (long b = 0; b < c.B; ++b) {
    CHECK(tensor.keys[b] == portable.keys[b]);
    CHECK(tensor.values[b] == portable.values[b]);
    CHECK(tensor.radius[b] == portable.radius[b]);
    CHECK(tensor.counts[b] == portable.counts[b]);
  }
  CHECK(worst_difference(tensor.y, portable.y, c, c.Dv) <= bound.value() + tensor_core_bound);
  // lse: both paths' logits are within E = (u + gamma(D)) logit_abs of the exact ones; the sums add gamma(n).
  const double lse_bound = 2.0 * ((u + kvmem_test::gamma32(double(c.D))) * bound.logit_abs +
                                  kvmem_test::gamma32(double(c.T + c.params.chunk + 4)) + u);
  CHECK(worst_difference(tensor.lse, portable.lse, c, 1) <= lse_bound);
  if (!against_reference) return;
  for (long b = 0; b < c.B; ++b) {
    const auto ref = kvmem_ref::kvm_prefill(c.sequence(b), c.params);
    CHECK(kvmem_test::worst_abs_error(kvmem_test::sequence_y(tensor, c, b), ref.y) <= tensor_core_bound);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("on a GPU, the tensor-core readout keeps the state's bits and stays within its bound",
                   "[flashinfer][gpu]", bfloat16, float16) {
  using S = TestType;
  static_assert(kvmem::kernels::flashinfer_readout_built<Kokkos::Cuda, S>);
  for (long D : {64L, 128L})
    for (auto [Hq, Hkv] : {std::pair{2L, 2L}, std::pair{4L, 2L}, std::pair{8L, 1L}})
      for (auto mode : {kvmem_test::Mode::prefill, kvmem_test::Mode::decode, kvmem_test::Mode::prefill_then_decode}) {
        INFO("D=" << D << " Hq=" << Hq << " Hkv=" << Hkv << " mode " << static_cast<int>(mode));
        compare_paths<S, kvmem::merge::WinnerTakeAll>(tensor_core_case(D, Hq, Hkv, true, 5), mode, true);
        compare_paths<S, kvmem::merge::WinnerTakeAll>(tensor_core_case(D, Hq, Hkv, false, 6), mode, false);
        compare_paths<S, kvmem::merge::Proportional>(tensor_core_case(D, Hq, Hkv, false, 7), mode, false);
      }
}

TEMPLATE_TEST_CASE("on a GPU, decode steps over more than 1024 keys of a segment use FlashInfer's KV partition",
                   "[flashinfer][gpu]", bfloat16, float16) {
  // A window ring of 1,344 slots and up to 1,088 state rows: past position 1,024 each decode step splits
  // both segments at the portable readout's split positions.
  kvmem_test::KvmCase c;
  c.B = 2, c.Hq = 8, c.Hkv = 2, c.T = 1400, c.D = 128, c.Dv = 128, c.seed = 11;
  c.lengths = {1400, 1130};
  c.params.chunk = 64, c.params.window_chunks = 20, c.params.rope_dims = 8, c.params.sinks = 1;
  c.params.schedule = kvmem_ref::Schedule::fixed, c.params.min_len = 1088, c.params.max_chunks = 17;
  c.generate();
  for (auto mode : {kvmem_test::Mode::decode, kvmem_test::Mode::prefill_then_decode}) {
    INFO("mode " << static_cast<int>(mode));
    compare_paths<TestType, kvmem::merge::WinnerTakeAll>(c, mode, false, /*partitioned=*/true);
  }
}

TEMPLATE_TEST_CASE("on a GPU, decode_async on tensor cores gives decode()'s outputs bit for bit", "[flashinfer][gpu]",
                   bfloat16, float16) {
  using S = TestType;
  auto c = tensor_core_case(128, 8, 2, false, 8);
  c.round_inputs<S>();
  c.expect_tensor_cores = true;
  const auto stepped = kvmem_test::run_kvm<Kokkos::Cuda, S>(c, kvmem_test::Mode::prefill_then_decode, 40);
  c.decode_async = true;
  const auto launched = kvmem_test::run_kvm<Kokkos::Cuda, S>(c, kvmem_test::Mode::prefill_then_decode, 40);
  CHECK(launched.y == stepped.y);
  CHECK(launched.lse == stepped.lse);
  CHECK(launched.rows == stepped.rows);
}

TEMPLATE_TEST_CASE("on a GPU, exact attention on tensor cores stays within its bound of float64", "[flashinfer][gpu]",
                   bfloat16, float16) {
  const long B = 2;
  for (long T : {300L, 1100L})  // 1100: the decode step's 1,100 keys are partitioned at 1,024
    for (long D : {64L, 128L})
      for (auto [Hq, Hkv] : {std::pair{2L, 2L}, std::pair{8L, 2L}}) {
        if (T > 1024 && D == 64) continue;
        INFO("T=" << T << " D=" << D << " Hq=" << Hq << " Hkv=" << Hkv);
        kvmem_test::exact_attention_within_bound<Kokkos::Cuda, TestType>(
            B, Hq, Hkv, T, D, D, kvmem_test::uniform(B * Hq * T * D, 31), kvmem_test::uniform(B * Hkv * T * D, 32),
            kvmem_test::uniform(B * Hkv * T * D, 33), /*tensor_cores=*/true);
      }
}

TEST_CASE("the tensor-core readout is not taken where it does not apply", "[flashinfer][gpu]") {
  // float32 storage, a head_dim not instantiated, the portable path asked for: the portable readout runs.
  auto c = tensor_core_case(64, 4, 2, false, 9);
  c.expect_tensor_cores = true;
  CHECK_THROWS_AS((kvmem_test::run_kvm<Kokkos::Cuda, float>(c, kvmem_test::Mode::prefill)), std::logic_error);
  auto odd = tensor_core_case(64, 4, 2, false, 9);
  odd.D = odd.Dv = 48;
  odd.generate();
  odd.expect_tensor_cores = true;
  CHECK_THROWS_AS((kvmem_test::run_kvm<Kokkos::Cuda, bfloat16>(odd, kvmem_test::Mode::prefill)), std::logic_error);
  c.readout_path = ReadoutPath::portable;
  CHECK_THROWS_AS((kvmem_test::run_kvm<Kokkos::Cuda, bfloat16>(c, kvmem_test::Mode::prefill)), std::logic_error);
}

#endif
