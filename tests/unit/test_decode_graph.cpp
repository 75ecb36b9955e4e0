// A decode step captured in a CUDA graph and replayed (built where Kokkos has the Cuda backend; run on a GPU
// by scripts/gpu-check; an OpenMP build compiles nothing here). For a KVM, an eviction and a Trellis
// memory: the reference decodes the stream with decode(); the other memory runs on a Kokkos::Cuda
// instance over a stream of its own, captures one decode_async() step into a graph (after reserve(),
// kernels::warm_team_scratch, set_active() and a warm-up step of no active sequence), then,
// per token, copies the token into fixed input views, replays the graph and copies y out. Every output
// must equal the reference's bit for bit, and sync() must give the reference's counts
// (docs/cuda.md, "Capturing a decode step in a CUDA graph").
#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)

#include <catch2/catch_test_macros.hpp>
#include <cuda_runtime.h>

#include <array>
#include <type_traits>
#include <vector>

#include <kvmem/kernels/plan/step_launch.hpp>

#include "decode_stream.hpp"

namespace {

using namespace kvmem_test;
using cuda_t = Kokkos::Cuda;
static_assert(std::is_same_v<mem, cuda_t::memory_space>, "the test streams live in Cuda's memory space");

// kernels::launches_as_argument tells a step kernel that Kokkos passes as the kernel's argument (its driver
// under 4 KiB) from one that goes through global memory, which a captured graph cannot replay.
using step_policy = Kokkos::TeamPolicy<cuda_t, kvmem::kernels::step_launch>;
template <std::size_t Bytes>
struct StepOfBytes {
  std::array<char, Bytes> captured{};
  KOKKOS_FUNCTION void operator()(const step_policy::member_type&) const {}
};
static_assert(kvmem::kernels::launches_as_argument<step_policy, StepOfBytes<64>>());
static_assert(kvmem::kernels::launches_as_argument<step_policy, StepOfBytes<3072>>());
static_assert(!kvmem::kernels::launches_as_argument<step_policy, StepOfBytes<4096>>());

/// A stream of its own and a Kokkos::Cuda instance on it; destroyed after the instance.
struct CaptureStream {
  cudaStream_t stream{};
  // Non-blocking: nothing on the legacy default stream can join (and so invalidate) a capture on it.
  CaptureStream() { REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess); }
  ~CaptureStream() { cudaStreamDestroy(stream); }
  CaptureStream(const CaptureStream&) = delete;
  CaptureStream& operator=(const CaptureStream&) = delete;
};

/// A stream view of one input and the fixed-address view of one token that a captured step reads from;
/// the host refills the slot from the stream before each replay.
template <class View>
struct Input {
  View slot, stream;
};
using Input4 = Input<view4>;
using Input3 = Input<view3>;

/// The captured half of a test: Kokkos' team-scratch pool given memory (kernels::warm_team_scratch); with
/// the active set empty, one warm-up `step` (one decode_async, which performs Kokkos' other lazy
/// allocations); all sequences active; `step` captured on `on_stream`'s stream into
/// a graph; then for every token t in [first, last) the inputs' slots refilled with token t, the graph
/// replayed and `slot_y` copied to y_out[:, :, t]. Ends with a fence and memory.sync(), and requires y_out
/// to equal `want` over [first, last) bit for bit.
template <class Memory, class Step>
void capture_and_replay(Memory& memory, const cuda_t& on_stream, cudaStream_t stream, const Step& step, long first,
                        long last, const std::vector<Input4>& inputs4, const std::vector<Input3>& inputs3,
                        const view4& slot_y, const view4& y_out, const view4& want) {
  const std::array<unsigned char, kBatch> none{};
  kvmem::kernels::warm_team_scratch(on_stream);  // else each team launch asks for a zero-byte pool
  memory.set_active(none);
  step();
  memory.set_active({});
  on_stream.fence();
  cudaGraph_t graph{};
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  try {
    step();
  } catch (...) {  // end the capture whatever happened, so that the stream is usable again
    cudaStreamEndCapture(stream, &graph);
    throw;
  }
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  cudaGraphExec_t instance{};
  REQUIRE(cudaGraphInstantiate(&instance, graph, 0) == cudaSuccess);
  for (long t = first; t < last; ++t) {
    for (const auto& in : inputs4) Kokkos::deep_copy(on_stream, in.slot, tokens(in.stream, t, 1));
    for (const auto& in : inputs3) Kokkos::deep_copy(on_stream, in.slot, gates(in.stream, t, 1));
    REQUIRE(cudaGraphLaunch(instance, stream) == cudaSuccess);
    Kokkos::deep_copy(on_stream, tokens(y_out, t, 1), slot_y);
  }
  on_stream.fence();
  REQUIRE(cudaGraphExecDestroy(instance) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  memory.sync();
  REQUIRE(differing_outputs(want, y_out, first, last) == 0);
}

/// One token's slot of a view [B, heads, T, channels] or [B, heads, T].
view4 slot(const view4& v) { return view4("slot", v.extent(0), v.extent(1), 1, v.extent(3)); }
view3 slot(const view3& v) { return view3("slot", v.extent(0), v.extent(1), 1); }
Input4 input(const view4& v) { return {slot(v), v}; }
Input3 input(const view3& v) { return {slot(v), v}; }

}  // namespace

TEST_CASE("decode_async: one step captured in a CUDA graph replays decode()'s outputs", "[decode-async][cuda]") {
  CaptureStream cs;
  const cuda_t on_stream(cs.stream);

  SECTION("KVM, power-law budget") {
    const Stream s;
    const auto w = unit_weights();
    KvmPowerLaw want = kvm_power_law(w);
    kvmem::KvmMemory<cuda_t, kvmem::budget::PowerLaw> got(memory_config(2, 1), kGrowing, w, kBatch, on_stream);
    view4 y2("y2", kBatch, kQueryHeads, s.T, kHeadDim);
    want.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                 tokens(s.y, 0, kPrompt));
    got.prefill(tokens(s.q, 0, kPrompt), tokens(s.k, 0, kPrompt), tokens(s.v, 0, kPrompt), gates(s.gate, 0, kPrompt),
                tokens(y2, 0, kPrompt));
    for (long t = kPrompt; t < s.T; ++t)
      want.decode(tokens(s.q, t, 1), tokens(s.k, t, 1), tokens(s.v, t, 1), gates(s.gate, t, 1), tokens(s.y, t, 1));
    const Input4 q = input(s.q), k = input(s.k), v = input(s.v);
    const Input3 gate = input(s.gate);
    const view4 y = slot(s.y);
    got.reserve(s.T);
    capture_and_replay(
        got, on_stream, cs.stream, [&] { got.decode_async(q.slot, k.slot, v.slot, gate.slot, y); }, kPrompt, s.T,
        {q, k, v}, {gate}, y, y2, s.y);
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
    const Input4 q = input(s.q), k = input(s.k), v = input(s.v);
    const view4 y = slot(s.y);
    capture_and_replay(
        got, on_stream, cs.stream, [&] { got.decode_async(q.slot, k.slot, v.slot, y); }, kPrompt, s.T, {q, k, v}, {},
        y, y2, s.y);
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
    const Input4 q = input(s.q), k = input(s.k), v = input(s.v), alpha = input(s.alpha);
    const Input3 b1 = input(s.beta1), g1 = input(s.gamma1), b2 = input(s.beta2), g2 = input(s.gamma2);
    const view4 y = slot(s.y);
    capture_and_replay(
        got, on_stream, cs.stream,
        [&] { got.decode_async(q.slot, k.slot, v.slot, alpha.slot, b1.slot, g1.slot, b2.slot, g2.slot, y); }, kPrompt,
        s.T, {q, k, v, alpha}, {b1, g1, b2, g2}, y, y2, s.y);
    REQUIRE(got.tokens(0) == want.tokens(0));
  }
}

#endif  // KOKKOS_ENABLE_CUDA
