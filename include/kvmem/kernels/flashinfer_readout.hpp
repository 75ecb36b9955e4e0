#pragma once
/// \file flashinfer_readout.hpp
/// The block attention readout of kernels::readout on tensor cores: on Kokkos::Cuda with 16-bit storage,
/// in a build that links kvmem::flashinfer (KVMEM_WITH_FLASHINFER), a step's readout is two launches of
/// FlashInfer's FA2 paged prefill (backend/cuda/flashinfer_readout.hpp) -- one over the state rows' read
/// caches, one over the block sliding window's ring, both addressed in place as pages -- joined by their
/// log-sum-exp. Everything FlashInfer reads besides the memory's own views (schedule, page tables, logit
/// scales, row bias) is written here on the device from the step plan: no host planner, no copy per step,
/// so decode_async stays capturable in a CUDA graph. Where it does not apply (float32 storage, other
/// backends, a head_dim not instantiated, row eviction, a query layout FlashInfer cannot address) the
/// portable readout runs. docs/cuda.md, "Tensor cores"; docs/numerics.md, "The readout on tensor cores".

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../backend/cuda/flashinfer_readout.hpp"
#include "../config.hpp"
#include "../dtype.hpp"
#include "../policy/layer_weights.hpp"
#include "../state/state_rows.hpp"
#include "step_launch.hpp"
#include "step_plan.hpp"

namespace kvmem::kernels {

/// Which kernel a memory's readout runs: `automatic` takes FlashInfer's tensor cores where
/// flashinfer_readout_applies says so and the portable readout elsewhere; `portable` always runs the
/// portable readout (kernels::readout, the reference the tensor-core path is tested against).
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

/// Device buffers of the tensor-core readout, grown on the host (reserve), never inside a step, so that a
/// captured decode step replays on the same addresses. Sizes for B sequences, up to max_queries queries per
/// sequence, Hq query heads, Hkv kv-heads, state capacity R rows, window ring S slots, Dv channels:
/// - `lens` [5, B] int32: queries, state rows, window keys, last page of the state (rows), last page of the
///   window (1);
/// - `indptr` [4, B + 1] int32: q_indptr, o_indptr, the state's page indptr (b), the window's (b x S);
/// - `state_pages` [B] (b), `window_pages` [B x S] (the ring slot of each window position, as a page of one
///   token: b x Hkv x S + slot);
/// - `tiles` [3, blocks] int32 (request, query tile, KV tile 0) and `valid` [2, blocks] (state, window);
/// - `scales` [2, B x max_queries x Hq] float32 (state, window: Merge::logit_scale of each query);
///   `row_bias` [B, Hkv, R] float32 (Merge::row_bias);
/// - `partials` [2, B x max_queries, Hq, Dv] in T and `lse` [2, B x max_queries, Hq] float32 (base 2).
template <class MemorySpace, StorageType T>
struct FlashInferWork {
  using ints = Kokkos::View<std::int32_t**, Kokkos::LayoutRight, MemorySpace>;
  ints lens, indptr, tiles;
  Kokkos::View<std::int32_t*, MemorySpace> state_pages, window_pages, chunk_size;
  Kokkos::View<bool**, Kokkos::LayoutRight, MemorySpace> valid;
  Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> scales, lse;
  Kokkos::View<float*, MemorySpace> row_bias;
  Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace> partials;

  /// Whether the buffers hold a step of these sizes (see the struct comment).
  [[nodiscard]] bool holds(long batch, long max_queries, int hq, int hkv, long row_capacity, long slots, int dv,
                           long blocks) const {
    const long rows = batch * max_queries * hq;
    return static_cast<long>(lens.extent(1)) >= batch && static_cast<long>(window_pages.extent(0)) >= batch * slots &&
           static_cast<long>(tiles.extent(1)) >= blocks && static_cast<long>(scales.extent(1)) >= rows &&
           static_cast<long>(row_bias.extent(0)) >= batch * hkv * row_capacity &&
           static_cast<long>(partials.extent(1)) >= rows * dv;
  }
  /// Allocates buffers for a step of these sizes (contents undefined) unless they hold() it already.
  template <class ExecSpace>
  void reserve(const ExecSpace& exec, long batch, long max_queries, int hq, int hkv, long row_capacity, long slots,
               int dv, long blocks) {
    if (holds(batch, max_queries, hq, hkv, row_capacity, slots, dv, blocks)) return;
    const long rows = batch * max_queries * hq;
    auto a = [&](const char* label) { return Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, std::string(label)); };
    lens = ints(a("kvmem::fi_lens"), 5, batch);
    indptr = ints(a("kvmem::fi_indptr"), 4, batch + 1);
    tiles = ints(a("kvmem::fi_tiles"), 3, blocks);
    state_pages = decltype(state_pages)(a("kvmem::fi_state_pages"), batch);
    window_pages = decltype(window_pages)(a("kvmem::fi_window_pages"), batch * slots);
    chunk_size = decltype(chunk_size)(a("kvmem::fi_chunk_size"), 1);
    valid = decltype(valid)(a("kvmem::fi_valid"), 2, blocks);
    scales = decltype(scales)(a("kvmem::fi_scales"), 2, rows);
    lse = decltype(lse)(a("kvmem::fi_lse"), 2, rows);
    row_bias = decltype(row_bias)(a("kvmem::fi_row_bias"), batch * hkv * row_capacity);
    partials = decltype(partials)(a("kvmem::fi_partials"), 2, rows * dv);
  }
};

/// CTAs per kv-head of a tensor-core readout over at most `max_queries` queries per sequence: B x the query
/// tiles of max_queries x G packed rows.
[[nodiscard]] inline long flashinfer_blocks(const MemoryConfig& cfg, long batch, long max_queries) {
  const long packed = max_queries * cfg.group();
  const long tile = backend::cuda::flashinfer::cta_tile_q(packed);
  return batch * ((packed + tile - 1) / tile);
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
    return false;
  } else {
    if (path != ReadoutPath::automatic || needs_lse) return false;
    if (cfg.head_dim != cfg.value_dim || !backend::cuda::flashinfer::head_dim_instantiated(cfg.head_dim)) return false;
    if (q.stride(3) != 1 || q.stride(2) <= 0) return false;
    const long st = static_cast<long>(q.stride(2)), sh = static_cast<long>(q.stride(1)),
               sb = static_cast<long>(q.stride(0));
    constexpr long vec = 16 / static_cast<long>(sizeof(T));  // elements per 16 bytes
    if (sb % st != 0 || st % vec != 0 || sh % vec != 0 || reinterpret_cast<std::uintptr_t>(q.data()) % 16 != 0)
      return false;
    constexpr long int32_max = 2147483647L, uint32_max = 4294967295L;
    const long B = static_cast<long>(q.extent(0)), T_in = static_cast<long>(q.extent(2));
    const long Hkv = cfg.kv_heads, D = cfg.head_dim, R = rows.capacity(), S = ring.slots();
    const long q_rows = (B - 1) * (sb / st) + T_in;  // q_indptr + query index, in token strides
    return q_rows * st < int32_max && sh < int32_max && B * Hkv * S < int32_max && Hkv * R * D < uint32_max &&
           S * D < uint32_max && R * D < uint32_max;
  }
}

/// The readout of kernels::readout (same arguments and meaning: spec KVM.md §3, OVQ.md §4) on FlashInfer's
/// tensor cores, where flashinfer_readout_applies: writes y [B, Hq, T, Dv] (any strides) at positions
/// [query_begin, query_end) of each plan row and, where `out_lse` [B, Hq, T] is not empty, the readout's
/// natural log-sum-exp. The window must already hold the step's tokens (write_window). `work` grows here
/// unless reserve()d. Numerics: docs/numerics.md, "The readout on tensor cores" (probabilities rounded to
/// 16 bits before P.V, each segment's output rounded to T before the log-sum-exp merge). Throws
/// std::logic_error on a build or input where it does not apply, std::runtime_error when FlashInfer or CUDA
/// refuses the launch.
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
    const long packed = M * G;
    const int tile = fi::cta_tile_q(packed);
    const long tiles = (packed + tile - 1) / tile, blocks = B * tiles;
    work.reserve(exec, B, M, Hq, Hkv, R, S, D, blocks);

    // The schedule, page tables and lengths, from the step plan on the device.
    const auto p = plan.device;
    const auto lens = work.lens, indptr = work.indptr, tl = work.tiles;
    const auto state_pages = work.state_pages, window_pages = work.window_pages, chunk = work.chunk_size;
    const auto valid = work.valid;
    const long q_step = static_cast<long>(q.stride(0)) / static_cast<long>(q.stride(2));  // sequence stride in tokens
    const long n_sched = B * S + blocks + B + 1;
    Kokkos::parallel_for(
        "kvmem::fi_plan", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, n_sched), KOKKOS_LAMBDA(long i) {
          if (i < B * S) {  // window page j of sequence b: the ring slot of position window_begin + j
            const long b = i / S, j = i % S;
            window_pages(i) = static_cast<std::int32_t>(b * Hkv * S + ring.slot(p(b, window_begin_pos) + j));
            return;
          }
          i -= B * S;
          if (i < blocks) {  // CTA i: query tile i % tiles of sequence i / tiles
            const long b = i / tiles, t = i % tiles;
            const long queries = p(b, query_end) - p(b, query_begin);
            const bool live = t * tile < queries * G;
            tl(0, i) = static_cast<std::int32_t>(b);
            tl(1, i) = static_cast<std::int32_t>(t);
            tl(2, i) = 0;
            valid(0, i) = live && p(b, read_rows) > 0;
            valid(1, i) = live && p(b, query_end) > p(b, window_begin_pos);
            return;
          }
          i -= blocks;
          const long b = i;  // b == B: the closing entries of the indptr arrays
          if (b < B) {
            const long begin = p(b, query_begin), end = p(b, query_end);
            const bool any = end > begin;
            lens(0, b) = static_cast<std::int32_t>(any ? end - begin : 0);
            lens(1, b) = static_cast<std::int32_t>(any ? p(b, read_rows) : 0);
            lens(2, b) = static_cast<std::int32_t>(any ? end - p(b, window_begin_pos) : 0);
            lens(3, b) = static_cast<std::int32_t>(p(b, read_rows));
            lens(4, b) = 1;
            indptr(0, b) = static_cast<std::int32_t>(b * q_step + (any ? begin - p(b, input_offset) : 0));
            state_pages(b) = static_cast<std::int32_t>(b);
          } else {
            indptr(0, b) = static_cast<std::int32_t>(b * q_step);
            chunk(0) = 2147483647;
          }
          indptr(1, b) = static_cast<std::int32_t>(b * M);
          indptr(2, b) = static_cast<std::int32_t>(b);
          indptr(3, b) = static_cast<std::int32_t>(b * S);
        });

    // Each query's logit scale of both segments (Merge::logit_scale) and the state rows' bias.
    const auto scales = work.scales;
    const auto bias = work.row_bias;
    const auto tau_state = w.tau_state, tau_window = w.tau_window;
    Kokkos::parallel_for(
        "kvmem::fi_scales", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, B * M * Hq + B * Hkv * R),
        KOKKOS_LAMBDA(long i) {
          if (i < B * M * Hq) {
            const long hq = i % Hq, u = (i / Hq) % M, b = i / (Hq * M);
            const long pos = p(b, query_begin) + u;
            if (pos >= p(b, query_end)) return;
            const auto* qu = &q(b, hq, pos - p(b, input_offset), 0);
            scales(0, i) = Merge::logit_scale(tau_state[hq], qu, D);
            scales(1, i) = Merge::logit_scale(tau_window[hq], qu, D);
            return;
          }
          i -= B * M * Hq;
          const long r = i % R, h = (i / R) % Hkv, b = i / (R * Hkv);
          if (r < p(b, read_rows)) bias(i) = Merge::row_bias(rows.row(b, h, r));
        });

    // The two segments.
    fi::SegmentLaunch s;
    s.storage = std::is_same_v<T, bfloat16> ? fi::Storage16::bfloat16 : fi::Storage16::float16;
    s.head_dim = D;
    s.query_heads = Hq;
    s.kv_heads = Hkv;
    s.batch = static_cast<int>(B);
    s.max_queries = static_cast<int>(M);
    s.cta_tile_q = tile;
    s.q = q.data();
    s.q_stride_n = static_cast<std::int32_t>(q.stride(2));
    s.q_stride_h = static_cast<std::int32_t>(q.stride(1));
    s.q_indptr = &indptr(0, 0);
    s.qo_lens = &lens(0, 0);
    s.request_indices = &tl(0, 0);
    s.qo_tile_indices = &tl(1, 0);
    s.kv_tile_indices = &tl(2, 0);
    s.o_indptr = &indptr(1, 0);
    s.kv_chunk_size = chunk.data();
    s.blocks = static_cast<std::uint32_t>(blocks);
    const long rows_out = B * M * Hq;

    fi::SegmentLaunch state = s;  // every query sees every state row: no mask; page = one sequence's rows
    state.causal = false;
    state.keys = rows.read_keys.data();
    state.values = rows.read_values.data();
    state.page_size = static_cast<std::uint32_t>(R);
    state.stride_page = static_cast<std::uint32_t>(Hkv * R * D);
    state.stride_h = static_cast<std::uint32_t>(R * D);
    state.stride_n = static_cast<std::uint32_t>(D);
    state.page_indices = state_pages.data();
    state.page_indptr = &indptr(2, 0);
    state.last_page_len = &lens(3, 0);
    state.kv_lens = &lens(1, 0);
    state.scales = &scales(0, 0);
    state.row_bias = bias.data();
    state.bias_stride_b = static_cast<std::uint32_t>(Hkv * R);
    state.bias_stride_h = static_cast<std::uint32_t>(R);
    state.out = &work.partials(0, 0);
    state.lse = &work.lse(0, 0);
    state.block_valid = &valid(0, 0);

    fi::SegmentLaunch window = s;  // right-aligned causal over positions [window_begin, query_end); page = a slot
    window.causal = true;
    window.keys = ring.keys.data();
    window.values = ring.values.data();
    window.page_size = 1;
    window.stride_page = static_cast<std::uint32_t>(D);
    window.stride_h = static_cast<std::uint32_t>(S * D);
    window.stride_n = static_cast<std::uint32_t>(D);
    window.page_indices = window_pages.data();
    window.page_indptr = &indptr(3, 0);
    window.last_page_len = &lens(4, 0);
    window.kv_lens = &lens(2, 0);
    window.scales = &scales(1, 0);
    window.out = &work.partials(1, 0);
    window.lse = &work.lse(1, 0);
    window.block_valid = &valid(1, 0);

    fi::launch_segment(state, exec.cuda_stream());
    fi::launch_segment(window, exec.cuda_stream());

    // The log-sum-exp merge of the two segments (an empty segment adds nothing), in float32, into y.
    const auto part = work.partials;
    const auto seg_lse = work.lse;
    constexpr float ln2 = 0.69314718055994530942f;
    Kokkos::parallel_for(
        "kvmem::fi_merge", Kokkos::RangePolicy<ExecSpace, step_launch>(exec, 0, rows_out), KOKKOS_LAMBDA(long i) {
          const long hq = i % Hq, u = (i / Hq) % M, b = i / (Hq * M);
          const long pos = p(b, query_begin) + u;
          if (pos >= p(b, query_end)) return;
          const bool has_state = p(b, read_rows) > 0, has_window = p(b, query_end) > p(b, window_begin_pos);
          const float ls = has_state ? seg_lse(0, i) : neg_inf(), lw = has_window ? seg_lse(1, i) : neg_inf();
          const float m = ls > lw ? ls : lw;
          const float as = has_state ? Kokkos::exp2(ls - m) : 0.0f, aw = has_window ? Kokkos::exp2(lw - m) : 0.0f;
          const float inv = 1.0f / (as + aw);
          const long t = pos - p(b, input_offset);
          for (int c = 0; c < D; ++c) {
            const float ys = has_state ? to_float(part(0, i * D + c)) : 0.0f;
            const float yw = has_window ? to_float(part(1, i * D + c)) : 0.0f;
            y(b, hq, t, c) = from_float<typename Out::value_type>((as * ys + aw * yw) * inv);
          }
          if (out_lse.data() != nullptr) out_lse(b, hq, t) = (m + Kokkos::log2(as + aw)) * ln2;
        });
  }
#endif
}

}  // namespace kvmem::kernels
