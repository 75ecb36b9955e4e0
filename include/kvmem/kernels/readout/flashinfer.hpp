#pragma once
/// \file flashinfer_readout.hpp
/// The block attention readout of kernels::readout, and exact attention, on tensor cores: on Kokkos::Cuda
/// with 16-bit storage, in a build that links kvmem::flashinfer (KVMEM_WITH_FLASHINFER), a step's readout
/// is two launches of FlashInfer's FA2 paged prefill (backend/cuda/flashinfer_readout.hpp) -- one over the
/// state rows' read caches, one over the block sliding window's ring, both addressed in place as pages --
/// joined by their log-sum-exp; exact attention is one launch over the KV cache in place. A decode step
/// splits each segment's keys at every readout_split_keys keys (the portable readout's fixed split
/// positions) into FlashInfer's KV partition, merged by FlashInfer's own log-sum-exp merge. Everything
/// FlashInfer reads besides the memory's own views (schedule, page tables, partition offsets, logit scales,
/// row bias) is written here on the device from the step plan: no host planner, no copy per step, so
/// decode_async stays capturable in a CUDA graph. Where it does not apply (float32 storage, other backends,
/// a head_dim not instantiated, row eviction, a layout FlashInfer cannot address) the portable kernels run.
/// docs/cuda.md, "Tensor cores"; docs/numerics.md, "The readout on tensor cores".

#include <Kokkos_Core.hpp>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../../backend/cuda/flashinfer_readout.hpp"
#include "../../config.hpp"
#include "../../dtype.hpp"
#include "../../math/vector_ops.hpp"
#include "../../policy/layer_weights.hpp"
#include "../../state/state_rows.hpp"
#include "launch.hpp"
#include "../plan/step_launch.hpp"
#include "../plan/step_plan.hpp"

namespace kvmem::kernels {

/// Which kernel a memory's readout (or exact attention) runs: `automatic` takes FlashInfer's tensor cores
/// where flashinfer_readout_applies (flashinfer_exact_applies) says so and the portable kernels elsewhere;
/// `portable` always runs the portable kernels (the reference the tensor-core path is tested against).
enum class ReadoutPath { automatic, portable };

/// Whether this build can run the readout of a memory on ExecSpace with storage T on FlashInfer: a Cuda
/// execution space, 16-bit storage, and kvmem::flashinfer linked (KVMEM_WITH_FLASHINFER).
template <class ExecSpace, StorageType T>
inline constexpr bool flashinfer_readout_built =
#if defined(KVMEM_WITH_FLASHINFER) && defined(KOKKOS_ENABLE_CUDA)
    std::is_same_v<ExecSpace, Kokkos::Cuda> && !std::is_same_v<T, float>;
#else
    false;
#endif

/// The split of a decode step's segment into FlashInfer's KV partition: one CTA per readout_split_keys
/// keys of a segment, at the portable readout's fixed split positions (KeySplit), for a segment of at most
/// `max_keys` keys; 1 (no partition) for a step of more than one query per sequence.
[[nodiscard]] inline long flashinfer_kv_chunks(long max_queries, long max_keys) {
  return max_queries == 1 && max_keys > readout_split_keys ? (max_keys + readout_split_keys - 1) / readout_split_keys
                                                           : 1L;
}

/// Device buffers of the tensor-core paths, grown on the host (reserve), never inside a step, so that a
/// captured decode step replays on the same addresses. For B sequences, up to M queries per sequence, Hq
/// query heads, Hkv kv-heads, state capacity R rows, window ring S slots, D = Dv channels, `blocks` CTAs per
/// kv-head of a launch and `chunks` KV-partition chunks per segment (1: none):
/// - `lens` [4, B] int32: queries, keys of segment 0 (state rows; exact: the KV cache), keys of segment 1
///   (the window), ones (the last page of the window's one-token pages);
/// - `indptr` [6, B + 1] int32: q_indptr, the output rows (b M), segment 0's page indptr (b), segment 1's
///   (b S), and each segment's partition offsets (the rows of its chunk outputs before sequence b: FlashInfer's
///   o_indptr and merge_indptr of a partitioned launch);
/// - `tiles` [2, 3, blocks] int32 (per segment: sequence, query tile, KV chunk of each CTA) and `valid` [2,
///   blocks];
/// - `state_pages` [B] (b), `window_pages` [B x S] (b Hkv S + the ring slot of each window position: pages
///   of one token), `chunk_size` [1] (readout_split_keys), `rows` [1] uint32 (B: the rows a partition merges);
/// - `scales` [2, B M Hq] float32 (Merge::logit_scale of each query, per segment), `row_bias` [B, Hkv, R];
/// - `partials` [2, B M Hq D] in T and `lse` [2, B M Hq] float32 (base 2): each segment's output;
/// - `chunk_out` [2, B Hq chunks D] in T and `chunk_lse` [2, B Hq chunks]: a partitioned segment's chunks.
template <class MemorySpace, StorageType T>
struct FlashInferWork {
  using ints = Kokkos::View<std::int32_t**, Kokkos::LayoutRight, MemorySpace>;
  ints lens, indptr;
  Kokkos::View<std::int32_t***, Kokkos::LayoutRight, MemorySpace> tiles;
  Kokkos::View<std::int32_t*, MemorySpace> state_pages, window_pages, chunk_size;
  Kokkos::View<std::uint32_t*, MemorySpace> rows;
  Kokkos::View<bool**, Kokkos::LayoutRight, MemorySpace> valid;
  Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> scales, lse, chunk_lse;
  Kokkos::View<float*, MemorySpace> row_bias;
  Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace> partials, chunk_out;

  /// The length each buffer needs for a step of these sizes (see the struct comment), in the order
  /// lens, indptr, tiles, state_pages, window_pages, valid, scales, lse, chunk_lse, row_bias, partials,
  /// chunk_out (the last extent of each; the leading ones are fixed).
  [[nodiscard]] static std::array<long, 12> needs(long batch, long max_queries, int hq, int hkv, long row_capacity,
                                                  long slots, int d, long blocks, long chunks) {
    const long out_rows = batch * max_queries * hq, chunk_rows = chunks > 1 ? batch * hq * chunks : 0L;
    return {batch, batch + 1, blocks, batch, batch * slots, blocks, out_rows, out_rows, chunk_rows,
            batch * hkv * row_capacity, out_rows * d, chunk_rows * d};
  }
  /// Whether every buffer holds a step of these sizes.
  [[nodiscard]] bool holds(long batch, long max_queries, int hq, int hkv, long row_capacity, long slots, int d,
                           long blocks, long chunks) const {
    const auto n = needs(batch, max_queries, hq, hkv, row_capacity, slots, d, blocks, chunks);
    const long have[12] = {last(lens), last(indptr), last(tiles), last(state_pages), last(window_pages), last(valid),
                           last(scales), last(lse), last(chunk_lse), last(row_bias), last(partials), last(chunk_out)};
    for (int i = 0; i < 12; ++i)
      if (have[i] < n[i]) return false;
    return chunk_size.extent(0) >= 1 && rows.extent(0) >= 1;
  }
  /// Grows each buffer that is shorter than a step of these sizes needs, to that length (contents
  /// undefined); the others keep their allocation and address, so buffers only ever grow: after a decode
  /// step's reserve() (Memory::reserve) a prefill of any size still leaves them fit for decode steps.
  template <class ExecSpace>
  void reserve(const ExecSpace& exec, long batch, long max_queries, int hq, int hkv, long row_capacity, long slots,
               int d, long blocks, long chunks) {
    const auto n = needs(batch, max_queries, hq, hkv, row_capacity, slots, d, blocks, chunks);
    auto a = [&](const char* label) { return Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, std::string(label)); };
    if (last(lens) < n[0]) lens = ints(a("kvmem::fi_lens"), 4, n[0]);
    if (last(indptr) < n[1]) indptr = ints(a("kvmem::fi_indptr"), 6, n[1]);
    if (last(tiles) < n[2]) tiles = decltype(tiles)(a("kvmem::fi_tiles"), 2, 3, n[2]);
    if (last(state_pages) < n[3]) state_pages = decltype(state_pages)(a("kvmem::fi_state_pages"), n[3]);
    if (last(window_pages) < n[4]) window_pages = decltype(window_pages)(a("kvmem::fi_window_pages"), n[4]);
    if (last(valid) < n[5]) valid = decltype(valid)(a("kvmem::fi_valid"), 2, n[5]);
    if (last(scales) < n[6]) scales = decltype(scales)(a("kvmem::fi_scales"), 2, n[6]);
    if (last(lse) < n[7]) lse = decltype(lse)(a("kvmem::fi_lse"), 2, n[7]);
    if (last(chunk_lse) < n[8]) chunk_lse = decltype(chunk_lse)(a("kvmem::fi_chunk_lse"), 2, n[8]);
    if (last(row_bias) < n[9]) row_bias = decltype(row_bias)(a("kvmem::fi_row_bias"), n[9]);
    if (last(partials) < n[10]) partials = decltype(partials)(a("kvmem::fi_partials"), 2, n[10]);
    if (last(chunk_out) < n[11]) chunk_out = decltype(chunk_out)(a("kvmem::fi_chunk_out"), 2, n[11]);
    if (chunk_size.extent(0) < 1) chunk_size = decltype(chunk_size)(a("kvmem::fi_chunk_size"), 1);
    if (rows.extent(0) < 1) rows = decltype(rows)(a("kvmem::fi_rows"), 1);
  }

 private:
  /// The last extent of a buffer (0 before its first allocation).
  template <class View>
  static long last(const View& v) {
    return v.data() == nullptr ? 0L : static_cast<long>(v.extent(View::rank() - 1));
  }
};

/// The shape of one tensor-core step: B sequences of up to M queries, `tile` packed query rows per CTA,
/// `tiles` query tiles per sequence, `chunks[s]` KV-partition chunks of segment s, `blocks[s]` CTAs per
/// kv-head of segment s's launch (B x tiles x chunks[s]).
struct FlashInferShape {
  long B = 0, M = 0, tiles = 1;
  int tile = 16;
  long chunks[2] = {1, 1}, blocks[2] = {0, 0};

  FlashInferShape(long batch, long max_queries, int group, long max_keys0, long max_keys1)
      : B(batch), M(max_queries) {
    const long packed = max_queries * group;
    tile = backend::cuda::flashinfer::cta_tile_q(packed);
    tiles = (packed + tile - 1) / tile;
    chunks[0] = flashinfer_kv_chunks(max_queries, max_keys0);
    chunks[1] = flashinfer_kv_chunks(max_queries, max_keys1);
    blocks[0] = B * tiles * chunks[0];
    blocks[1] = B * tiles * chunks[1];
  }
  [[nodiscard]] KOKKOS_INLINE_FUNCTION long most_blocks() const { return blocks[0] > blocks[1] ? blocks[0] : blocks[1]; }
  [[nodiscard]] KOKKOS_INLINE_FUNCTION long most_chunks() const { return chunks[0] > chunks[1] ? chunks[0] : chunks[1]; }
};

namespace detail {

/// The address of view(i...) computed on the host from data() and strides (no element access: a device
/// view's elements are not to be touched from the host).
template <class View, class... I>
auto* fi_at(const View& v, I... i) {
  long offset = 0, d = 0;
  ((offset += static_cast<long>(i) * static_cast<long>(v.stride(d++))), ...);
  return v.data() + offset;
}

inline constexpr long fi_int32_max = 2147483647L, fi_uint32_max = 4294967295L;

/// Whether FlashInfer can read queries `q` [B, Hq, T, D] of storage type T in place: channels contiguous,
/// the sequence stride a multiple of the token stride (q_indptr counts token strides), both strides and the
/// data 16-byte aligned (128-bit loads), and every query row's offset within int32.
template <StorageType T, class QueriesIn>
[[nodiscard]] bool fi_queries_addressable(const QueriesIn& q) {
  if (q.stride(3) != 1 || q.stride(2) <= 0) return false;
  const long st = static_cast<long>(q.stride(2)), sh = static_cast<long>(q.stride(1)), sb = static_cast<long>(q.stride(0));
  constexpr long vec = 16 / static_cast<long>(sizeof(T));  // elements per 16 bytes
  if (sb % st != 0 || st % vec != 0 || sh % vec != 0 || reinterpret_cast<std::uintptr_t>(q.data()) % 16 != 0)
    return false;
  const long B = static_cast<long>(q.extent(0)), Hq = static_cast<long>(q.extent(1)), T_in = static_cast<long>(q.extent(2));
  const long q_rows = (B - 1) * (sb / st) + T_in;  // q_indptr + query index, in token strides
  // FlashInfer forms each offset term as a 32-bit product (IdType and uint32): the whole of q within int32.
  const long last = (B - 1) * sb + (Hq - 1) * sh + (T_in - 1) * st + static_cast<long>(q.extent(3));
  return q_rows * st < fi_int32_max && sh < fi_int32_max && last < fi_int32_max;
}

/// Whether FlashInfer's outputs of a step of B sequences of up to M queries, Hq heads of D channels stay
/// within int32 (its row offsets o_indptr * Hq D are 32-bit products).
[[nodiscard]] inline bool fi_outputs_addressable(long batch, long max_queries, long hq, long d) {
  return batch * max_queries * hq * d < fi_int32_max;
}

/// A launch of segment s: the fields every segment shares (storage type, sizes, the queries in place, the
/// schedule in `work`), its KV partition where sh.chunks[s] > 1, its output in work.partials(s) / lse(s).
template <StorageType T, class QueriesIn, class MemorySpace>
backend::cuda::flashinfer::SegmentLaunch fi_launch(const QueriesIn& q, int hq, int hkv, int d, const FlashInferShape& sh,
                                                   int s, FlashInferWork<MemorySpace, T>& work) {
  namespace fi = backend::cuda::flashinfer;
  fi::SegmentLaunch l;
  l.storage = std::is_same_v<T, bfloat16> ? fi::Storage16::bfloat16 : fi::Storage16::float16;
  l.head_dim = d;
  l.query_heads = hq;
  l.kv_heads = hkv;
  l.batch = static_cast<int>(sh.B);
  l.max_queries = static_cast<int>(sh.M);
  l.cta_tile_q = sh.tile;
  l.q = q.data();
  l.q_stride_n = static_cast<std::int32_t>(q.stride(2));
  l.q_stride_h = static_cast<std::int32_t>(q.stride(1));
  l.q_indptr = fi_at(work.indptr, 0, 0);
  l.qo_lens = fi_at(work.lens, 0, 0);
  l.kv_lens = fi_at(work.lens, 1 + s, 0);
  l.request_indices = fi_at(work.tiles, s, 0, 0);
  l.qo_tile_indices = fi_at(work.tiles, s, 1, 0);
  l.kv_tile_indices = fi_at(work.tiles, s, 2, 0);
  l.block_valid = fi_at(work.valid, s, 0);
  l.blocks = static_cast<std::uint32_t>(sh.blocks[s]);
  l.kv_chunk_size = work.chunk_size.data();
  l.scales = fi_at(work.scales, s, 0);
  l.out = fi_at(work.partials, s, 0);
  l.lse = fi_at(work.lse, s, 0);
  l.o_indptr = fi_at(work.indptr, 1, 0);
  if (sh.chunks[s] > 1) {  // FlashInfer's KV partition: chunk outputs, then its merge into out and lse
    l.kv_chunks = static_cast<std::uint32_t>(sh.chunks[s]);
    l.o_indptr = fi_at(work.indptr, 4 + s, 0);
    l.merge_indptr = fi_at(work.indptr, 4 + s, 0);
    l.chunk_out = fi_at(work.chunk_out, s, 0);
    l.chunk_lse = fi_at(work.chunk_lse, s, 0);
    l.merged_rows = work.rows.data();
  }
  return l;
}

}  // namespace detail

/// The counts a tensor-core step's schedule is written from, read from a Memory's step plan `p`
/// (StepPlan::device) and its window ring: per sequence b, its queries (query_end - query_begin), the keys
/// of segment 0 (the state rows read) and 1 (window positions [window_begin, query_end)), none where it has
/// no query; the input index of its first query; and the page of window key j (b Hkv S + its ring slot).
template <class PlanView, class Ring>
struct PlanCounts {
  PlanView p;
  Ring ring;
  long kv_heads = 0;
  KOKKOS_INLINE_FUNCTION long queries(long b) const { return p(b, query_end) - p(b, query_begin); }
  KOKKOS_INLINE_FUNCTION long keys(int s, long b) const {
    return queries(b) <= 0 ? 0L : s == 0 ? p(b, read_rows) : p(b, query_end) - p(b, window_begin_pos);
  }
  KOKKOS_INLINE_FUNCTION long first(long b) const { return queries(b) > 0 ? p(b, query_begin) - p(b, input_offset) : 0L; }
  KOKKOS_INLINE_FUNCTION long window_page(long b, long j) const {
    return (b * kv_heads) * ring.slots() + ring.slot(p(b, window_begin_pos) + j);
  }
};

/// The counts of exact attention: every sequence has `queries` queries (from input index 0) and `keys`
/// keys in segment 0, none in segment 1 (no window).
struct UniformCounts {
  long queries_per_sequence = 0, keys_per_sequence = 0;
  KOKKOS_INLINE_FUNCTION long queries(long) const { return queries_per_sequence; }
  KOKKOS_INLINE_FUNCTION long keys(int s, long) const { return s == 0 ? keys_per_sequence : 0L; }
  KOKKOS_INLINE_FUNCTION long first(long) const { return 0L; }
  KOKKOS_INLINE_FUNCTION long window_page(long, long) const { return 0L; }
};

/// Writes the schedule of a tensor-core step into `work` on the device, from `n` (PlanCounts or
/// UniformCounts), for a step of shape `sh` with G query heads per kv-head, queries whose sequence stride is
/// `q_step` token strides, and window rings of `slots` slots (0: no window). Runs on any execution space
/// (tests/unit/test_flashinfer_schedule.cpp checks it on the CPU against a host reference); one launch, and
/// a second of one thread where a segment is partitioned. What it writes, per segment s in {0, 1}:
/// - CTA x < sh.blocks[s]: sequence b = x / (tiles chunks), query tile t = (x / chunks) % tiles, KV chunk c
///   = x % chunks (tiles(s, 0..2, x)); valid(s, x) iff t tile < queries(b) G and c readout_split_keys <
///   keys(s, b);
/// - per sequence b < B: lens = (queries, keys(0), keys(1), 1), state page b, window pages b S + j for j <
///   slots; indptr rows: q_indptr = b q_step + first(b), output rows b M, segment 0's page indptr b,
///   segment 1's b S (each row closed at b = B with the first(b) term 0);
/// - the chunk size (readout_split_keys) and the rows a partition merges (B);
/// - for a partitioned segment s (sh.chunks[s] > 1, M = 1): indptr(4 + s, b) = the chunks of the sequences
///   before b, ceil(keys(s, b') / readout_split_keys) for each b' with a query.
template <class ExecSpace, class Counts, class MemorySpace, StorageType T>
void flashinfer_schedule(const ExecSpace& exec, const Counts& n, long q_step, long slots, const FlashInferShape& sh, int G,
                         const FlashInferWork<MemorySpace, T>& work) {
  const long most = sh.most_blocks(), B = sh.B;
  const auto w = work;
  Kokkos::parallel_for(
      "kvmem::fi_plan", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, most + B + 1 + B * slots),
      KOKKOS_LAMBDA(long x) {
        if (x < most) {  // CTA x of each segment
          for (int s = 0; s < 2; ++s) {
            if (x >= sh.blocks[s]) continue;
            const long per_b = sh.tiles * sh.chunks[s];
            const long b = x / per_b, t = (x % per_b) / sh.chunks[s], c = x % sh.chunks[s];
            w.tiles(s, 0, x) = static_cast<std::int32_t>(b);
            w.tiles(s, 1, x) = static_cast<std::int32_t>(t);
            w.tiles(s, 2, x) = static_cast<std::int32_t>(c);
            w.valid(s, x) = t * sh.tile < n.queries(b) * G && c * readout_split_keys < n.keys(s, b);
          }
          return;
        }
        if (x >= most + B + 1) {  // window page j of sequence b
          const long i = x - most - B - 1, b = i / slots, j = i % slots;
          w.window_pages(i) = static_cast<std::int32_t>(n.window_page(b, j));
          return;
        }
        const long b = x - most;
        if (b < B) {
          w.lens(0, b) = static_cast<std::int32_t>(n.queries(b));
          w.lens(1, b) = static_cast<std::int32_t>(n.keys(0, b));
          w.lens(2, b) = static_cast<std::int32_t>(n.keys(1, b));
          w.lens(3, b) = 1;
          w.state_pages(b) = static_cast<std::int32_t>(b);
        } else {
          w.chunk_size(0) = static_cast<std::int32_t>(readout_split_keys);
          w.rows(0) = static_cast<std::uint32_t>(B);
        }
        w.indptr(0, b) = static_cast<std::int32_t>(b * q_step + (b < B ? n.first(b) : 0L));
        w.indptr(1, b) = static_cast<std::int32_t>(b * sh.M);
        w.indptr(2, b) = static_cast<std::int32_t>(b);
        w.indptr(3, b) = static_cast<std::int32_t>(b * slots);
      });
  if (sh.most_chunks() > 1)
    Kokkos::parallel_for(
        "kvmem::fi_chunks", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, 1), KOKKOS_LAMBDA(long) {
          for (int s = 0; s < 2; ++s) {
            if (sh.chunks[s] == 1) continue;
            long offset = 0;
            for (long b = 0; b < B; ++b) {
              w.indptr(4 + s, b) = static_cast<std::int32_t>(offset);
              if (n.queries(b) > 0) offset += (n.keys(s, b) + readout_split_keys - 1) / readout_split_keys;
            }
            w.indptr(4 + s, B) = static_cast<std::int32_t>(offset);
          }
        });
}

/// The state rows' logit scale of every query (scales(0, .)), the window's (scales(1, .)), both
/// Merge::logit_scale(tau_state / tau_window[hq], q_u, D) at row (b M + u) Hq + hq, and the bias of every
/// state row read (row_bias, Merge::row_bias at (b Hkv + h) R + r), from the plan `p` and queries `q` [B,
/// Hq, T, D]. Runs on any execution space.
template <class Merge, class ExecSpace, class PlanView, class QueriesIn, StorageType T>
void flashinfer_readout_scales(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                               const state::StateRows<typename ExecSpace::memory_space, T>& rows, const PlanView& p,
                               const QueriesIn& q, const FlashInferShape& sh,
                               const FlashInferWork<typename ExecSpace::memory_space, T>& work) {
  const long B = sh.B, M = sh.M, Hq = cfg.query_heads, Hkv = cfg.kv_heads, R = rows.capacity();
  const int D = cfg.head_dim;
  const auto wk = work;
  const auto tau_state = w.tau_state, tau_window = w.tau_window;
  Kokkos::parallel_for(
      "kvmem::fi_scales", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B * M * Hq + B * Hkv * R),
      KOKKOS_LAMBDA(long i) {
        if (i < B * M * Hq) {
          const long hq = i % Hq, u = (i / Hq) % M, b = i / (Hq * M);
          const long pos = p(b, query_begin) + u;
          if (pos >= p(b, query_end)) return;
          const auto* qu = &q(b, hq, pos - p(b, input_offset), 0);
          wk.scales(0, i) = Merge::logit_scale(tau_state[hq], qu, D);
          wk.scales(1, i) = Merge::logit_scale(tau_window[hq], qu, D);
          return;
        }
        i -= B * M * Hq;
        const long r = i % R, h = (i / R) % Hkv, b = i / (R * Hkv);
        if (r < p(b, read_rows)) wk.row_bias(i) = Merge::row_bias(rows.row(b, h, r));
      });
}

/// y and the readout's log-sum-exp from the two segments' outputs in `work` (partials in T, base-2
/// log-sum-exps lse): for query u < queries(b) of sequence b and head hq (row i = (b M + u) Hq + hq),
/// with l_s = lse(s, i) where segment s has keys (else -inf) and m = max(l_0, l_1), a_s = 2^(l_s - m):
///   y(b, hq, first(b) + u, c) = (a_0 partials(0, i D + c) + a_1 partials(1, i D + c)) / (a_0 + a_1),
///   out_lse(b, hq, first(b) + u) = (m + log2(a_0 + a_1)) ln 2   (where out_lse is not empty),
/// in float32, y rounded once to its type. One segment with keys is copied (a = 1). Runs on any execution
/// space.
template <class ExecSpace, class Counts, class Out, class OutLse, StorageType T>
void flashinfer_merge_segments(const ExecSpace& exec, const Counts& n, int hq_count, int d, const FlashInferShape& sh,
                               const Out& y, const OutLse& out_lse,
                               const FlashInferWork<typename ExecSpace::memory_space, T>& work) {
  const long M = sh.M, Hq = hq_count;
  const int D = d;
  const auto wk = work;
  constexpr float ln2 = 0.69314718055994530942f;
  Kokkos::parallel_for(
      "kvmem::fi_merge", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, sh.B * M * Hq), KOKKOS_LAMBDA(long i) {
        const long hq = i % Hq, u = (i / Hq) % M, b = i / (Hq * M);
        if (u >= n.queries(b)) return;
        const bool has0 = n.keys(0, b) > 0, has1 = n.keys(1, b) > 0;
        const float l0 = has0 ? wk.lse(0, i) : neg_inf(), l1 = has1 ? wk.lse(1, i) : neg_inf();
        const float m = l0 > l1 ? l0 : l1;
        const float a0 = has0 ? Kokkos::exp2(l0 - m) : 0.0f, a1 = has1 ? Kokkos::exp2(l1 - m) : 0.0f;
        const float inv = 1.0f / (a0 + a1);
        const long t = n.first(b) + u;
        for (int c = 0; c < D; ++c) {
          const float y0 = has0 ? to_float(wk.partials(0, i * D + c)) : 0.0f;
          const float y1 = has1 ? to_float(wk.partials(1, i * D + c)) : 0.0f;
          y(b, hq, t, c) = from_float<std::remove_const_t<typename Out::value_type>>((a0 * y0 + a1 * y1) * inv);
        }
        if (out_lse.data() != nullptr) out_lse(b, hq, t) = (m + Kokkos::log2(a0 + a1)) * ln2;
      });
}

/// Host check: whether a readout of at most `max_queries` queries of `q` [B, Hq, T, D] runs on FlashInfer
/// under `path`: flashinfer_readout_built, no row eviction statistics (`needs_lse`: the readout's per-query
/// log-sum-exp feeds the state, which must keep the portable path's bits), D == Dv and instantiated (64,
/// 128), q's channels contiguous, its sequence stride a multiple of its token stride, both strides and the
/// data 16-byte aligned (FlashInfer loads 128-bit vectors), and every index within int32 / uint32 (query
/// rows, pages, page strides).
template <class ExecSpace, StorageType T, class QueriesIn>
[[nodiscard]] bool flashinfer_readout_applies(ReadoutPath path, const MemoryConfig& cfg,
                                              const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                                              const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                                              const QueriesIn& q, bool needs_lse) {
  if constexpr (!flashinfer_readout_built<ExecSpace, T> ||
                !std::is_same_v<std::remove_const_t<typename QueriesIn::value_type>, T>) {
    (void)path, (void)cfg, (void)rows, (void)ring, (void)q, (void)needs_lse;
    return false;
  } else {
    if (path != ReadoutPath::automatic || needs_lse) return false;
    if (cfg.head_dim != cfg.value_dim || !backend::cuda::flashinfer::head_dim_instantiated(cfg.head_dim)) return false;
    const long Hkv = cfg.kv_heads, D = cfg.head_dim, R = rows.capacity(), S = ring.slots();
    return detail::fi_queries_addressable<T>(q) &&
           detail::fi_outputs_addressable(static_cast<long>(q.extent(0)), static_cast<long>(q.extent(2)),
                                          cfg.query_heads, D) &&
           static_cast<long>(q.extent(0)) * Hkv * S < detail::fi_int32_max && Hkv * R * D < detail::fi_uint32_max &&
           S * D < detail::fi_uint32_max;
  }
}

/// Host check: whether exact attention (kernels::exact_causal_attention) of queries `q` [B, Hq, T, D] over
/// keys `k` and values `v` [B, Hkv, P, D] runs on FlashInfer under `path`: flashinfer_readout_built for the
/// keys' storage type, queries of that type addressable as flashinfer_readout_applies asks, D == Dv
/// instantiated (64, 128), keys and values with the same strides, their channels contiguous and their other
/// strides 16-byte aligned and within uint32.
template <class ExecSpace, class In, class InKV>
[[nodiscard]] bool flashinfer_exact_applies(ReadoutPath path, const In& q, const InKV& k, const InKV& v) {
  using T = std::remove_const_t<typename InKV::value_type>;
  if constexpr (!flashinfer_readout_built<ExecSpace, T> || !std::is_same_v<std::remove_const_t<typename In::value_type>, T>) {
    (void)path, (void)q, (void)k, (void)v;
    return false;
  } else {
    if (path != ReadoutPath::automatic) return false;
    const int D = static_cast<int>(q.extent(3));
    if (static_cast<int>(v.extent(3)) != D || !backend::cuda::flashinfer::head_dim_instantiated(D)) return false;
    if (!detail::fi_queries_addressable<T>(q) ||
        !detail::fi_outputs_addressable(static_cast<long>(q.extent(0)), static_cast<long>(q.extent(2)),
                                        static_cast<long>(q.extent(1)), D))
      return false;
    constexpr long vec = 16 / static_cast<long>(sizeof(T));
    for (int i = 0; i < 3; ++i) {
      const long sk = static_cast<long>(k.stride(i));
      if (sk != static_cast<long>(v.stride(i)) || sk % vec != 0 || sk <= 0 || sk >= detail::fi_uint32_max) return false;
    }
    return k.stride(3) == 1 && v.stride(3) == 1 && reinterpret_cast<std::uintptr_t>(k.data()) % 16 == 0 &&
           reinterpret_cast<std::uintptr_t>(v.data()) % 16 == 0;
  }
}

/// The shape of a Memory's tensor-core step of at most `max_queries` queries per sequence (decode: 1) over
/// a state of `row_capacity` rows and a window ring of `slots` slots (for reserve()).
[[nodiscard]] inline FlashInferShape flashinfer_readout_shape(const MemoryConfig& cfg, long batch, long max_queries,
                                                              long row_capacity, long slots) {
  return FlashInferShape(batch, max_queries, cfg.group(), row_capacity, slots);
}

/// The readout of kernels::readout (same arguments and meaning: spec KVM.md §3, OVQ.md §4) on FlashInfer's
/// tensor cores, where flashinfer_readout_applies: writes y [B, Hq, T, Dv] (any strides) at positions
/// [query_begin, query_end) of each plan row and, where `out_lse` [B, Hq, T] is not empty, the readout's
/// natural log-sum-exp. The window must already hold the step's tokens (write_window). A decode step
/// (max_queries = 1) partitions a segment of more than readout_split_keys keys at the portable readout's
/// split positions. `work` grows here unless reserve()d for the step's shape. Numerics: docs/numerics.md,
/// "The readout on tensor cores". Throws std::logic_error on a build or input where it does not apply,
/// std::runtime_error when FlashInfer or CUDA refuses the launch.
template <class Merge, class ExecSpace, StorageType T, class QueriesIn, class Out, class OutLse>
void flashinfer_readout(const ExecSpace& exec, const MemoryConfig& cfg, const LayerWeightsRef& w,
                        const state::StateRows<typename ExecSpace::memory_space, T>& rows,
                        const state::WindowRing<typename ExecSpace::memory_space, T>& ring,
                        const StepPlan<typename ExecSpace::memory_space>& plan, const QueriesIn& q, const Out& y,
                        long max_queries, const OutLse& out_lse,
                        FlashInferWork<typename ExecSpace::memory_space, T>& work) {
#if defined(KVMEM_WITH_FLASHINFER) && defined(KOKKOS_ENABLE_CUDA)
  if constexpr (!flashinfer_readout_built<ExecSpace, T>) {
#endif
    (void)exec, (void)cfg, (void)w, (void)rows, (void)ring, (void)plan, (void)q, (void)y, (void)max_queries,
        (void)out_lse, (void)work;
    throw std::logic_error("kvmem::kernels::flashinfer_readout: not built for this execution space and storage");
#if defined(KVMEM_WITH_FLASHINFER) && defined(KOKKOS_ENABLE_CUDA)
  } else {
    namespace fi = backend::cuda::flashinfer;
    if (!flashinfer_readout_applies<ExecSpace, T>(ReadoutPath::automatic, cfg, rows, ring, q, false))
      throw std::logic_error("kvmem::kernels::flashinfer_readout: called where flashinfer_readout_applies is false");
    const long B = static_cast<long>(plan.device.extent(0));
    if (max_queries <= 0 || B == 0) return;
    const int Hq = cfg.query_heads, Hkv = cfg.kv_heads, D = cfg.head_dim, G = cfg.group();
    const long R = rows.capacity(), S = ring.slots(), M = max_queries;
    const FlashInferShape sh = flashinfer_readout_shape(cfg, B, M, R, S);
    work.reserve(exec, B, M, Hq, Hkv, R, S, D, sh.most_blocks(), sh.most_chunks());

    // The schedule, page tables and lengths, from the step plan on the device; the scales and row bias.
    const auto p = plan.device;
    const PlanCounts<decltype(p), state::WindowRing<typename ExecSpace::memory_space, T>> counts{p, ring, Hkv};
    const long q_step = static_cast<long>(q.stride(0)) / static_cast<long>(q.stride(2));  // sequence stride in tokens
    flashinfer_schedule(exec, counts, q_step, S, sh, G, work);
    flashinfer_readout_scales<Merge>(exec, cfg, w, rows, p, q, sh, work);

    // The state rows: every query sees every row (no mask); a page holds one sequence's rows.
    fi::SegmentLaunch state = detail::fi_launch<T>(q, Hq, Hkv, D, sh, 0, work);
    state.segment = "state rows";
    state.causal = false;
    state.keys = rows.read_keys.data();
    state.values = rows.read_values.data();
    state.page_size = static_cast<std::uint32_t>(R);
    state.stride_page = static_cast<std::uint32_t>(Hkv * R * D);
    state.stride_h = static_cast<std::uint32_t>(R * D);
    state.stride_n = static_cast<std::uint32_t>(D);
    state.page_indices = work.state_pages.data();
    state.page_indptr = detail::fi_at(work.indptr, 2, 0);
    state.last_page_len = detail::fi_at(work.lens, 1, 0);
    state.row_bias = work.row_bias.data();
    state.bias_stride_b = static_cast<std::uint32_t>(Hkv * R);
    state.bias_stride_h = static_cast<std::uint32_t>(R);
    // The window: right-aligned causal over positions [window_begin, query_end); a page is one ring slot.
    fi::SegmentLaunch window = detail::fi_launch<T>(q, Hq, Hkv, D, sh, 1, work);
    window.segment = "window";
    window.causal = true;
    window.keys = ring.keys.data();
    window.values = ring.values.data();
    window.page_size = 1;
    window.stride_page = static_cast<std::uint32_t>(D);
    window.stride_h = static_cast<std::uint32_t>(S * D);
    window.stride_n = static_cast<std::uint32_t>(D);
    window.page_indices = work.window_pages.data();
    window.page_indptr = detail::fi_at(work.indptr, 3, 0);
    window.last_page_len = detail::fi_at(work.lens, 3, 0);
    fi::launch_segment(state, exec.cuda_stream());
    fi::launch_segment(window, exec.cuda_stream());

    // The log-sum-exp merge of the two segments (an empty segment adds nothing), in float32, into y.
    flashinfer_merge_segments(exec, counts, Hq, D, sh, y, out_lse, work);
  }
#endif
}

/// Exact causal attention (kernels::exact_causal_attention: query u of sequence b and head hq at position
/// first_position + u reads keys [0, first_position + u], logits (q_u . k_j) tau[hq] / sqrt(D), tau null:
/// 1) on FlashInfer's tensor cores, where flashinfer_exact_applies: one launch over each sequence's keys and
/// values [B, Hkv, P, D] in place (a page of P positions per sequence), FlashInfer's right-aligned causal
/// mask, then y [B, Hq, T, D] (any strides) written from its output. A decode step (T = 1) over more than
/// readout_split_keys keys is partitioned at every readout_split_keys positions. `work` grows here unless
/// it holds the call's sizes already. Numerics: docs/numerics.md, "The readout on tensor cores". Throws
/// std::logic_error where it does not apply, std::runtime_error when FlashInfer or CUDA refuses the launch.
template <class ExecSpace, class In, class InKV, class Out>
void flashinfer_exact_attention(
    const ExecSpace& exec, const In& q, const InKV& k, const InKV& v, const Out& y, const float* tau,
    long first_position,
    FlashInferWork<typename ExecSpace::memory_space, std::remove_const_t<typename InKV::value_type>>& work) {
#if defined(KVMEM_WITH_FLASHINFER) && defined(KOKKOS_ENABLE_CUDA)
  using T = std::remove_const_t<typename InKV::value_type>;
  if constexpr (!flashinfer_readout_built<ExecSpace, T>) {
#endif
    (void)exec, (void)q, (void)k, (void)v, (void)y, (void)tau, (void)first_position, (void)work;
    throw std::logic_error("kvmem::kernels::flashinfer_exact_attention: not built for this execution space and storage");
#if defined(KVMEM_WITH_FLASHINFER) && defined(KOKKOS_ENABLE_CUDA)
  } else {
    namespace fi = backend::cuda::flashinfer;
    if (!flashinfer_exact_applies<ExecSpace>(ReadoutPath::automatic, q, k, v))
      throw std::logic_error("kvmem::kernels::flashinfer_exact_attention: called where flashinfer_exact_applies is false");
    const long B = static_cast<long>(q.extent(0)), M = static_cast<long>(q.extent(2));
    const int Hq = static_cast<int>(q.extent(1)), Hkv = static_cast<int>(k.extent(1)), D = static_cast<int>(q.extent(3));
    if (B == 0 || M == 0) return;
    const long n_keys = first_position + M;
    const FlashInferShape sh(B, M, Hq / Hkv, n_keys, 0);
    work.reserve(exec, B, M, Hq, Hkv, 0, 0, D, sh.most_blocks(), sh.most_chunks());
    const UniformCounts counts{M, n_keys};
    flashinfer_schedule(exec, counts, static_cast<long>(q.stride(0)) / static_cast<long>(q.stride(2)), 0, sh, Hq / Hkv,
                        work);
    const auto scales = work.scales;
    const float sqrt_d = Kokkos::sqrt(static_cast<float>(D));
    Kokkos::parallel_for(
        "kvmem::fi_scales", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B * M * Hq), KOKKOS_LAMBDA(long i) {
          scales(0, i) = (tau ? tau[i % Hq] : 1.0f) / sqrt_d;  // as exact_causal_attention
        });
    fi::SegmentLaunch s = detail::fi_launch<T>(q, Hq, Hkv, D, sh, 0, work);
    s.segment = "KV cache";
    s.causal = true;
    s.keys = k.data();
    s.values = v.data();
    s.page_size = static_cast<std::uint32_t>(k.extent(2));
    s.stride_page = static_cast<std::uint32_t>(k.stride(0));
    s.stride_h = static_cast<std::uint32_t>(k.stride(1));
    s.stride_n = static_cast<std::uint32_t>(k.stride(2));
    s.page_indices = work.state_pages.data();
    s.page_indptr = detail::fi_at(work.indptr, 2, 0);
    s.last_page_len = detail::fi_at(work.lens, 1, 0);
    fi::launch_segment(s, exec.cuda_stream());
    flashinfer_merge_segments(exec, counts, Hq, D, sh, y, Kokkos::View<float***, Kokkos::LayoutStride,
                                                                   typename ExecSpace::memory_space>{}, work);
  }
#endif
}

}  // namespace kvmem::kernels
