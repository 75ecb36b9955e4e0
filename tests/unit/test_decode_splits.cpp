// Split-KV decode of the memories' readout (kernels::DecodeSplits, detail::readout_split_kv): state rows
// and windows longer than one split of readout_split_keys keys, read in splits at fixed positions in
// prefill and in decode, give the same bits whether a decode step runs its splits in parallel teams or in
// one, on every host backend, and match the float64 reference.
#include <algorithm>
#include <catch2/catch_test_macros.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "float_bits.hpp"
#include "kernel_launches.hpp"
#include "kvm_harness.hpp"

using kvmem::kernels::DecodeSplits;
using kvmem_ref::Schedule;
using kvmem_test::KvmCase;
using kvmem_test::KvmOutput;
using kvmem_test::Mode;

namespace {

constexpr long S = kvmem::kernels::readout_split_keys;
constexpr const char* kSplitReadout = "kvmem::readout_split";  // the split-KV readout's kernel (kernels/readout/launch.hpp)
constexpr double tolerance = 1e-4;  // float32 kernels against the float64 reference (test_kvm_reference.cpp)

/// Small heads, chunk 16, two sequences (the second ends one key past a split of the window or state).
KvmCase small_case() {
  KvmCase c;
  c.B = 2, c.Hq = 1, c.Hkv = 1, c.D = 8, c.Dv = 6;
  c.params.chunk = 16, c.params.rope_dims = 4, c.params.sinks = 1;
  return c;
}

/// State rows past one split: a fixed budget of S + 40 rows (rows fill one split, then one more, then merge).
KvmCase rows_case() {
  KvmCase c = small_case();
  c.params.window_chunks = 2;
  c.params.schedule = Schedule::fixed;
  c.params.min_len = S + 40;
  c.params.max_chunks = (S + 40) / 16 + 2;
  c.T = S + 40 + 3 * 16 + 70;
  c.lengths = {c.T, S + 32 + 16 + 1};
  return c;
}

/// A window past one split: L = S + 64 tokens, a state of 8 rows.
KvmCase window_case() {
  KvmCase c = small_case();
  c.params.window_chunks = S / 16 + 4;
  c.params.schedule = Schedule::fixed;
  c.params.min_len = 8;
  c.T = S + 64 + 16 * 3 + 5;
  c.lengths = {c.T, S + 1};
  return c;
}

/// Elements of sequence b's y and log-sum-exp whose bits differ between two runs.
long differing(const KvmOutput& a, const KvmOutput& b, const KvmCase& c) {
  long differ = 0;
  for (long s = 0; s < c.B; ++s) {
    const auto ya = kvmem_test::sequence_y(a, c, s), yb = kvmem_test::sequence_y(b, c, s);
    const auto la = kvmem_test::sequence_lse(a, c, s), lb = kvmem_test::sequence_lse(b, c, s);
    for (std::size_t i = 0; i < ya.size(); ++i) differ += !kvmem_test::same_bits(ya[i], yb[i]);
    for (std::size_t i = 0; i < la.size(); ++i) differ += !kvmem_test::same_bits(la[i], lb[i]);
  }
  return differ;
}

/// Which runs check_schedules compares with the prefill.
enum Runs : unsigned {
  kSplit = 1,     ///< token-by-token decode, split-KV (DecodeSplits::always)
  kContinue = 2,  ///< half the prompt prefilled, the rest decoded in one team per kv-head (DecodeSplits::never)
  kAsync = 4,     ///< half prefilled, the rest launch-only as a GPU plans it (plan_on_device, decode_async), split
  kAll = 7
};

/// The prefill of case c on ExecSpace with storage type S against the `runs`: every run gives the prefill's
/// bits, and (KVM's rule in float32) the split decode's y and log-sum-exp match the float64 reference;
/// `Merge` = Proportional and 16-bit storage are checked by their bits only (their references are
/// test_proportional.cpp's and test_storage_types.cpp's). A split run (kSplit, kAsync: DecodeSplits::always)
/// must launch the split-KV readout ("kvmem::readout_split"; from the step whose state rows' capacity and
/// window may hold more than one split of keys on), the prefill and the kContinue run (never) must not,
/// so that a silent fallback to one split fails; the memory's recorded readout form (Memory::readout_form,
/// kernels::ReadoutForm) must say split_kv after those steps and never elsewhere. Returns the prefill's output.
template <class ExecSpace, class Merge = kvmem::merge::WinnerTakeAll, kvmem::StorageType St = float>
KvmOutput check_schedules(KvmCase c, unsigned runs = kAll) {
  // Runs case x in `mode` (prefill_then_decode: `split` tokens prefilled) and requires launches of the
  // split-KV readout where `splits`, none elsewhere.
  auto run = [](const KvmCase& x, Mode mode, long split = 0, bool splits = false) {
    const kvmem_test::KernelLaunches launches(kSplitReadout);
    auto out = kvmem_test::run_kvm<ExecSpace, St, kvmem::score::KeepRows, Merge>(x, mode, split);
    INFO("split-KV readout launches: " << launches.count());
    CHECK((launches.count() > 0) == splits);
    const auto split_steps = std::count(out.forms.begin(), out.forms.end(), kvmem::kernels::ReadoutForm::split_kv);
    INFO("steps recorded as split-KV: " << split_steps << " of " << out.forms.size());
    CHECK((split_steps > 0) == splits);
    return out;
  };
  c.generate();
  const auto prefill = run(c, Mode::prefill);
  if (runs & kContinue) {
    c.decode_splits = DecodeSplits::never;
    CHECK(differing(run(c, Mode::prefill_then_decode, c.T / 2), prefill, c) == 0);
  }
  c.decode_splits = DecodeSplits::always;
  if (runs & kSplit) {
    const auto split = run(c, Mode::decode, 0, true);
    CHECK(differing(split, prefill, c) == 0);
    if constexpr (std::is_same_v<Merge, kvmem::merge::WinnerTakeAll> && std::is_same_v<St, float>)
      for (long b = 0; b < c.B; ++b) {
        INFO("sequence " << b << " length " << c.length(b));
        const auto ref = kvmem_ref::kvm_prefill(c.sequence(b), c.params);
        CHECK(kvmem_test::relative_error(kvmem_test::sequence_y(split, c, b), ref.y) <= tolerance);
        CHECK(kvmem_test::relative_error(kvmem_test::sequence_lse(split, c, b), ref.lse) <= tolerance);
      }
  }
  if (runs & kAsync) {
    c.decode_async = true;
    CHECK(differing(run(c, Mode::prefill_then_decode, c.T / 2, true), prefill, c) == 0);
  }
  return prefill;
}

/// check_schedules on the host's default space, then the prefill and the split decode on Serial, which must
/// give the host's bits; returns the host's prefill.
KvmOutput check_host_and_serial(const KvmCase& c) {
  const auto host = check_schedules<Kokkos::DefaultHostExecutionSpace>(c);
#if defined(KOKKOS_ENABLE_SERIAL)
  KvmCase g = c;
  g.generate();
  CHECK(differing(check_schedules<Kokkos::Serial>(c, kSplit), host, g) == 0);
#endif
  return host;
}

}  // namespace

TEST_CASE("split-KV decode of state rows past a split: the prompt's bits in either schedule, and the reference",
          "[splits][kvm]") {
  REQUIRE(check_host_and_serial(rows_case()).rows[0] == S + 40);  // the state did pass one split
}

TEST_CASE("split-KV decode of a window past a split: the prompt's bits in either schedule, and the reference",
          "[splits][kvm]") {
  check_host_and_serial(window_case());
}

TEST_CASE("split-KV decode reads each state row's bias at its own index (proportional merge: log counts)",
          "[splits][proportional]") {
  check_schedules<Kokkos::DefaultHostExecutionSpace, kvmem::merge::Proportional>(rows_case(), kSplit);
}

TEST_CASE("split-KV decode in bfloat16 with GQA (widened key tiles, a block of G query heads)", "[splits][kvm][bf16]") {
  KvmCase c = rows_case();
  c.Hq = 4;  // G = 4
  check_schedules<Kokkos::DefaultHostExecutionSpace, kvmem::merge::WinnerTakeAll, kvmem::bfloat16>(c, kSplit);
}

TEST_CASE("the launch counter counts its kernel's launches only, while it lives, one counter at a time",
          "[splits][harness]") {
  // The test of kvmem_test::KernelLaunches, which the split-KV checks above read.
  const Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace> four(0, 4);
  {
    const kvmem_test::KernelLaunches launches("kvmem_test::probe");
    Kokkos::parallel_for("kvmem_test::probe", four, [](int) {});
    Kokkos::parallel_for("kvmem_test::probe_other", four, [](int) {});
    Kokkos::parallel_for("kvmem_test::probe", four, [](int) {});
    CHECK(launches.count() == 2);
    CHECK_THROWS_AS(kvmem_test::KernelLaunches("kvmem_test::probe"), std::logic_error);
  }
  Kokkos::parallel_for("kvmem_test::probe", four, [](int) {});  // no counter alive
  const kvmem_test::KernelLaunches again("kvmem_test::probe");
  CHECK(again.count() == 0);
}

TEST_CASE("the readout's entry point records the form it took: its own window writes in an unsplit decode step",
          "[splits][readout]") {
  using kvmem::kernels::ReadoutForm;
  KvmCase c = small_case();  // G = 1: one team per (sequence, kv-head) in a decode step
  c.T = 70;
  c.lengths = {70, 33};
  c.generate();
  c.decode_splits = DecodeSplits::never;
  const auto out = kvmem_test::run_kvm<Kokkos::DefaultHostExecutionSpace>(c, Mode::decode);
  REQUIRE(out.forms.size() == static_cast<std::size_t>(c.T));
  // A decode step writes its token in the readout's own teams, except where a lazy fold (KVM's) runs between
  // the write and the read: then the window is written by its own launch first.
  const auto writing = std::count(out.forms.begin(), out.forms.end(), ReadoutForm::tiles_writing_window);
  const auto after_write = std::count(out.forms.begin(), out.forms.end(), ReadoutForm::tiles);
  INFO("decode steps writing the window in the readout: " << writing << ", after write_window: " << after_write);
  CHECK(writing > 0);
  CHECK(writing + after_write == c.T);  // never split-KV (never) nor tensor cores (a host space)
}

TEST_CASE("a key list's splits: every split holds keys, at the fixed positions", "[splits]") {
  using kvmem::kernels::KeySplit;
  // (state rows, window tokens) at every boundary: one key, one key past a split, an empty state, an empty
  // window (state only), state up to a split's end, both past several splits.
  for (auto [m, nw] : std::vector<std::pair<long, long>>{{0, 1},     {0, S},     {0, S + 1},         {1, 1},
                                                         {S, 1},     {S + 1, 1}, {1, 0},             {S, 0},
                                                         {S + 1, 0}, {2 * S, S}, {2 * S + 1, 2 * S + 1}, {S - 1, S + 1}}) {
    INFO("rows " << m << " window " << nw);
    const long n = KeySplit::count(m, nw);
    long rows = 0, window = 0;
    for (long s = 0; s < n; ++s) {
      const KeySplit k = KeySplit::of(s, m, nw);
      CHECK(k.row_begin == rows);  // in order, no gap, no overlap
      CHECK(k.window_begin == window);
      CHECK(k.row_end - k.row_begin + k.window_end - k.window_begin >= 1);  // never a split without keys
      CHECK(k.row_end - k.row_begin <= S);
      CHECK(k.window_end - k.window_begin <= S);
      CHECK(((k.row_end == k.row_begin || k.row_begin % S == 0) && k.window_begin % S == 0));  // fixed positions
      rows = k.row_end, window = k.window_end;
    }
    CHECK(rows == m);
    CHECK(window == nw);
    CHECK(n <= kvmem::kernels::readout_max_splits(m, nw));
  }
}

#ifdef KOKKOS_ENABLE_CUDA
TEST_CASE("split-KV decode on the GPU: the prompt's bits in either schedule, and the reference (Cuda)",
          "[splits][kvm][cuda]") {
  check_schedules<Kokkos::Cuda>(rows_case());
  check_schedules<Kokkos::Cuda>(window_case());
  check_schedules<Kokkos::Cuda, kvmem::merge::Proportional>(rows_case());
}
#endif
