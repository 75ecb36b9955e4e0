// A decode step captured in a CUDA graph and replayed (built where Kokkos has the Cuda backend; run on a GPU
// by scripts/gpu-check; an OpenMP build compiles nothing here). For a KVM, an eviction and a Trellis
// memory: the reference decodes the stream with decode(); the other memory runs on a Kokkos::Cuda
// instance over a stream of its own, captures one decode_async() step into a graph (after reserve(),
// set_active() and a warm-up step of no active sequence, which performs Kokkos' lazy allocations), then,
// per token, copies the token into fixed input views, replays the graph and copies y out. Every output
// must equal the reference's bit for bit, and sync() must give the reference's counts
// (docs/cuda.md, "Capturing a decode step in a CUDA graph").
#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)

#include <catch2/catch_test_macros.hpp>
#include <cuda_runtime.h>

#include <array>
#include <functional>
#include <span>
#include <type_traits>

#include "decode_stream.hpp"
#include "float_bits.hpp"

namespace {

using namespace kvmem_test;
using cuda_t = Kokkos::Cuda;
static_assert(std::is_same_v<mem, cuda_t::memory_space>, "the test streams live in Cuda's memory space");

/// A stream of its own and a Kokkos::Cuda instance on it; destroyed after the instance.
struct CaptureStream {
  cudaStream_t stream{};
  CaptureStream() { REQUIRE(cudaStreamCreate(&stream) == cudaSuccess); }
  ~CaptureStream() { cudaStreamDestroy(stream); }
  CaptureStream(const CaptureStream&) = delete;
  CaptureStream& operator=(const CaptureStream&) = delete;
};

/// Fixed-address views of one token: the graph reads these, the host refills them before each replay.
struct TokenSlot {
  view4 q, k, v, y, alpha;
  view3 gate, beta1, gamma1, beta2, gamma2;
};

/// Captures `step` (one decode_async on `on_stream`'s stream) into a graph, then for every token t in
/// [first, last): `load`(t) fills the slot on `on_stream`, the graph replays, `store`(t) copies y out on it.
void replay(const cuda_t& on_stream, cudaStream_t stream, long first, long last, const std::function<void()>& step,
            const std::function<void(long)>& load, const std::function<void(long)>& store) {
  on_stream.fence();
  cudaGraph_t graph{};
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  step();
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  cudaGraphExec_t instance{};
  REQUIRE(cudaGraphInstantiate(&instance, graph, 0) == cudaSuccess);
  for (long t = first; t < last; ++t) {
    load(t);
    REQUIRE(cudaGraphLaunch(instance, stream) == cudaSuccess);
    store(t);
  }
  on_stream.fence();
  REQUIRE(cudaGraphExecDestroy(instance) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
}

void require_same(const view4& a, const view4& b, long first, long last) {
  const auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, a);
  const auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, b);
  long differ = 0;
  for (long s = 0; s < static_cast<long>(a.extent(0)); ++s)
    for (long h = 0; h < static_cast<long>(a.extent(1)); ++h)
      for (long t = first; t < last; ++t)
        for (long c = 0; c < static_cast<long>(a.extent(3)); ++c) differ += same_bits(ha(s, h, t, c), hb(s, h, t, c)) ? 0 : 1;
  REQUIRE(differ == 0);
}

constexpr std::array<unsigned char, kBatch> kNone{0, 0};

}  // namespace

TEST_CASE("decode_async: one step captured in a CUDA graph replays decode()'s outputs", "[decode-async][cuda]") {
  CaptureStream cs;
  const cuda_t on_stream(cs.stream);
  auto one = [](long heads, long channels) { return view4("slot", kBatch, heads, 1, channels); };
  auto one3 = [](long heads) { return view3("slot", kBatch, heads, 1); };

  SECTION("KVM, power-law budget") {
    const Stream s;
    const auto w = unit_weights();
    KvmPowerLaw want = kvm_power_law(w);
    using Graphed = kvmem::KvmMemory<cuda_t, kvmem::budget::PowerLaw>;
    Graphed got(memory_config(2, 1), kGrowing, w, kBatch, on_stream);
    view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
    want.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
    got.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                tokens(y2, 0, kPrompt));
    for (long t = kPrompt; t < s.T; ++t)
      want.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1));
    const TokenSlot slot{one(kQueryHeads, kHeadDim), one(kKvHeads, kHeadDim), one(kKvHeads, kHeadDim),
                         one(kQueryHeads, kHeadDim), {}, one3(kKvHeads), {}, {}, {}, {}};
    auto step = [&] { got.decode_async(slot.q, slot.k, slot.v, slot.gate, slot.y); };
    got.reserve(s.T);
    got.set_active(kNone);
    step();  // warm-up: no sequence is active
    got.set_active({});
    replay(
        on_stream, cs.stream, kPrompt, s.T, step,
        [&](long t) {
          Kokkos::deep_copy(on_stream, slot.q, tokens(s.q, t, 1));
          Kokkos::deep_copy(on_stream, slot.k, tokens(s.k, t, 1));
          Kokkos::deep_copy(on_stream, slot.v, tokens(s.v, t, 1));
          Kokkos::deep_copy(on_stream, slot.gate, gates(s.gate, t, 1));
        },
        [&](long t) { Kokkos::deep_copy(on_stream, tokens(y2, t, 1), slot.y); });
    got.sync();
    require_same(s.y, y2, kPrompt, s.T);
    for (long b = 0; b < kBatch; ++b) {
      REQUIRE(got.cursor(b).tokens == want.cursor(b).tokens);
      REQUIRE(got.cursor(b).rows == want.cursor(b).rows);
    }
  }

  SECTION("eviction, TOVA") {
    const Stream s;
    const kvmem::EvictionConfig cfg{.head_dim = kHeadDim, .value_dim = kHeadDim, .query_heads = kQueryHeads,
                                    .kv_heads = kKvHeads, .sinks = 2, .window = 16, .top_k = 24};
    kvmem::EvictionMemory<exec, kvmem::score::LastQueryAttention> want(cfg, kBatch);
    kvmem::EvictionMemory<cuda_t, kvmem::score::LastQueryAttention> got(cfg, kBatch, {}, on_stream);
    view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
    want.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.y, 0, kPrompt));
    got.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(y2, 0, kPrompt));
    for (long t = kPrompt; t < s.T; ++t)
      want.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.y, t, 1));
    const TokenSlot slot{one(kQueryHeads, kHeadDim), one(kKvHeads, kHeadDim), one(kKvHeads, kHeadDim),
                         one(kQueryHeads, kHeadDim), {}, {}, {}, {}, {}, {}};
    auto step = [&] { got.decode_async(slot.q, slot.k, slot.v, slot.y); };
    got.set_active(kNone);
    step();
    got.set_active({});
    replay(
        on_stream, cs.stream, kPrompt, s.T, step,
        [&](long t) {
          Kokkos::deep_copy(on_stream, slot.q, tokens(s.q, t, 1));
          Kokkos::deep_copy(on_stream, slot.k, tokens(s.k, t, 1));
          Kokkos::deep_copy(on_stream, slot.v, tokens(s.v, t, 1));
        },
        [&](long t) { Kokkos::deep_copy(on_stream, tokens(y2, t, 1), slot.y); });
    got.sync();
    require_same(s.y, y2, kPrompt, s.T);
    REQUIRE(got.tokens(0) == want.tokens(0));
  }

  SECTION("Trellis") {
    const TrellisStream s;
    kvmem::TrellisConfig cfg{.slots = kSlots, .head_dim = kHeadDim, .value_dim = kHeadDim, .heads = kKvHeads};
    cfg.chunk = kChunk;
    cfg.check_gates = false;
    kvmem::TrellisMemory<exec> want(cfg, kBatch);
    kvmem::TrellisMemory<cuda_t> got(cfg, kBatch, on_stream);
    view4 y2("y2", kBatch, kKvHeads, s.T, kHeadDim);
    auto prefill = [&](auto& m, const view4& y) {
      m.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), tokens(s.alpha, 0, kPrompt),
                gates(s.beta1, 0, kPrompt), gates(s.gamma1, 0, kPrompt), gates(s.beta2, 0, kPrompt),
                gates(s.gamma2, 0, kPrompt), tokens(y, 0, kPrompt));
    };
    prefill(want, s.y);
    prefill(got, y2);
    for (long t = kPrompt; t < s.T; ++t)
      want.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), tokens(s.alpha, t, 1), gates(s.beta1, t, 1),
                  gates(s.gamma1, t, 1), gates(s.beta2, t, 1), gates(s.gamma2, t, 1), tokens(s.y, t, 1));
    const TokenSlot slot{one(kKvHeads, kHeadDim), one(kKvHeads, kHeadDim), one(kKvHeads, kHeadDim),
                         one(kKvHeads, kHeadDim), one(kKvHeads, kSlots), {}, one3(kKvHeads), one3(kKvHeads),
                         one3(kKvHeads), one3(kKvHeads)};
    auto step = [&] {
      got.decode_async(slot.q, slot.k, slot.v, slot.alpha, slot.beta1, slot.gamma1, slot.beta2, slot.gamma2, slot.y);
    };
    got.set_active(kNone);
    step();
    got.set_active({});
    replay(
        on_stream, cs.stream, kPrompt, s.T, step,
        [&](long t) {
          Kokkos::deep_copy(on_stream, slot.q, tokens(s.q, t, 1));
          Kokkos::deep_copy(on_stream, slot.k, tokens(s.k, t, 1));
          Kokkos::deep_copy(on_stream, slot.v, tokens(s.v, t, 1));
          Kokkos::deep_copy(on_stream, slot.alpha, tokens(s.alpha, t, 1));
          Kokkos::deep_copy(on_stream, slot.beta1, gates(s.beta1, t, 1));
          Kokkos::deep_copy(on_stream, slot.gamma1, gates(s.gamma1, t, 1));
          Kokkos::deep_copy(on_stream, slot.beta2, gates(s.beta2, t, 1));
          Kokkos::deep_copy(on_stream, slot.gamma2, gates(s.gamma2, t, 1));
        },
        [&](long t) { Kokkos::deep_copy(on_stream, tokens(y2, t, 1), slot.y); });
    got.sync();
    require_same(s.y, y2, kPrompt, s.T);
    REQUIRE(got.tokens(0) == want.tokens(0));
  }
}

#endif  // KOKKOS_ENABLE_CUDA
