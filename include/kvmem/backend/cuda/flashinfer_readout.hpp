#pragma once
/// \file flashinfer_readout.hpp
/// One segment of the block attention readout (state rows, or the block sliding window) on tensor cores,
/// through FlashInfer's FA2 paged prefill template (BatchPrefillWithPagedKVCacheDispatched, FlashInfer
/// 0.7.2.post1, Apache-2.0) with kvmem's own params and attention variant. This header describes a launch in
/// plain pointers and strides and includes neither Kokkos nor FlashInfer; the templates are instantiated once,
/// in src/backend/cuda/flashinfer_readout.cu (library target kvmem::flashinfer, CMake option
/// KVMEM_FLASHINFER), which defines KVMEM_WITH_FLASHINFER for its users. kernels/readout/flashinfer.hpp fills
/// a SegmentLaunch from a memory's state and step plan; docs/cuda.md, "Tensor cores".

#include <cstdint>

#ifdef KVMEM_WITH_FLASHINFER  // defined by kvmem::flashinfer, a Cuda build only
#include <cuda_runtime_api.h>
#endif

namespace kvmem::backend::cuda::flashinfer {

/// The FlashInfer version whose C++ templates kvmem instantiates (its C++ API changes between releases; the
/// CMake option checks the installed distribution against it).
inline constexpr const char* pinned_version = "0.7.2.post1";

/// 16-bit storage types FlashInfer's tensor-core prefill reads: bfloat16 (nv_bfloat16) and float16 (__half),
/// bit for bit kvmem::bfloat16 and kvmem::float16.
enum class Storage16 : int { bfloat16, float16 };

/// Head dims (channels per head, D == Dv) instantiated.
[[nodiscard]] constexpr bool head_dim_instantiated(int head_dim) { return head_dim == 64 || head_dim == 128; }

/// Query rows per CTA tile for `packed_rows` = queries x group size G of a (sequence, kv-head): FlashInfer's
/// own FA2 rule (16 up to 16 rows, 64 up to 64, else 128); the three tiles are instantiated.
[[nodiscard]] constexpr int cta_tile_q(long packed_rows) { return packed_rows > 64 ? 128 : packed_rows > 16 ? 64 : 16; }

/// One launch over one segment of the key list of every (sequence b, kv-head h), all device pointers.
/// Indices are int32 (FlashInfer's IdType); strides are in elements.
/// - Queries: query u of sequence b, head hq is q + (q_indptr[b] + u) * q_stride_n + hq * q_stride_h, D
///   contiguous channels (kvmem's q [B, Hq, T, D] read in place: q_stride_n = its token stride, q_indptr[b] =
///   (b's offset + first query's offset) / q_stride_n).
/// - Keys: key j of (b, h) is keys + page_indices[page_indptr[b] + j / page_size] * stride_page + h *
///   stride_h + (j % page_size) * stride_n; values the same offsets from `values` (K and V share strides).
/// - qo_lens[b] queries and kv_lens[b] keys per sequence; causal: FlashInfer's right-aligned causal mask
///   (query u sees keys j <= u + kv_lens[b] - qo_lens[b]); otherwise every query sees every key.
/// - logit(u, j) = (q_u . k_j) * scales[(b * max_queries + u) * query_heads + hq] + row_bias[b *
///   bias_stride_b + h * bias_stride_h + j] (no bias where row_bias is null), in natural-log units.
/// - out [B * max_queries, Hq, D] in the storage type: row b * max_queries + u holds softmax(logits) . V;
///   lse [B * max_queries, Hq] float32 the base-2 log-sum-exp of the logits times log2(e).
/// - Schedule (kvmem writes it on the device, FlashInfer's host planners are not used): `blocks` CTAs per
///   kv-head; CTA x handles query tile qo_tile_indices[x] (of cta_tile_q packed rows) of sequence
///   request_indices[x], KV chunk kv_tile_indices[x] (keys [c kv_chunk_size, (c + 1) kv_chunk_size)), when
///   block_valid[x]; o_indptr[b] = b * max_queries; kv_chunk_size one int.
/// - KV partition (kv_chunks > 1, one query per sequence): CTA x writes its chunk's output to chunk_out
///   [rows, Hq, D] and chunk_lse [rows, Hq] at row o_indptr[b] + c (o_indptr then holds the partition
///   offsets), and FlashInfer's merge (VariableLengthMergeStates) joins rows [merge_indptr[r],
///   merge_indptr[r + 1]) into out and lse row r for r < *merged_rows (= batch).
struct SegmentLaunch {
  const char* segment = "";  ///< what the launch reads ("state rows", "window", "KV cache"), for error messages
  Storage16 storage = Storage16::bfloat16;
  int head_dim = 0, query_heads = 0, kv_heads = 0, batch = 0, max_queries = 0, cta_tile_q = 16;
  bool causal = false;
  const void* q = nullptr;
  std::int32_t q_stride_n = 0, q_stride_h = 0;
  const std::int32_t* q_indptr = nullptr;
  const void* keys = nullptr;
  const void* values = nullptr;
  std::uint32_t page_size = 1, stride_page = 0, stride_n = 0, stride_h = 0;
  const std::int32_t* page_indices = nullptr;
  const std::int32_t* page_indptr = nullptr;
  const std::int32_t* last_page_len = nullptr;
  const std::int32_t* qo_lens = nullptr;
  const std::int32_t* kv_lens = nullptr;
  const float* scales = nullptr;
  const float* row_bias = nullptr;
  std::uint32_t bias_stride_b = 0, bias_stride_h = 0;
  void* out = nullptr;
  float* lse = nullptr;
  const std::int32_t* request_indices = nullptr;
  const std::int32_t* qo_tile_indices = nullptr;
  const std::int32_t* kv_tile_indices = nullptr;
  const std::int32_t* o_indptr = nullptr;
  const std::int32_t* kv_chunk_size = nullptr;
  const bool* block_valid = nullptr;
  std::uint32_t blocks = 0;
  std::uint32_t kv_chunks = 1;
  const std::int32_t* merge_indptr = nullptr;
  void* chunk_out = nullptr;
  float* chunk_lse = nullptr;
  const std::uint32_t* merged_rows = nullptr;
};

#ifdef KVMEM_WITH_FLASHINFER  // defined by kvmem::flashinfer, a Cuda build only
/// Launches FlashInfer's FA2 paged prefill for `launch` on `stream` (no host synchronization, capturable in
/// a CUDA graph). Throws std::invalid_argument for a head_dim not instantiated (head_dim_instantiated), a
/// cta_tile_q other than 16, 64, 128, or kv_chunks > 1 with max_queries != 1, and std::runtime_error naming the kernel, the segment and FlashInfer's
/// or CUDA's message when the launch fails (e.g. the GPU lacks the shared memory of the tile, or an
/// architecture below sm_80).
void launch_segment(const SegmentLaunch& launch, cudaStream_t stream);
#endif

}  // namespace kvmem::backend::cuda::flashinfer
