/// \file flashinfer_readout.cu
/// The one translation unit that instantiates FlashInfer's FA2 paged prefill for kvmem's readout
/// (include/kvmem/backend/cuda/flashinfer_readout.hpp): storage bfloat16 and float16 x head_dim 64 and 128 x
/// query tiles 16, 64, 128 x mask none (state rows) and right-aligned causal (block sliding window). Compiled
/// by nvcc (through Kokkos' nvcc_wrapper) into kvmem::flashinfer; no Kokkos header is included here.
/// FlashInfer's headers are SYSTEM includes: they warn under -Wall -Wextra.

#include <kvmem/backend/cuda/flashinfer_readout.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/variant_helper.cuh>

#include <stdexcept>
#include <string>

namespace kvmem::backend::cuda::flashinfer {
namespace {

namespace fi = ::flashinfer;

/// FlashInfer's paged-prefill params with kvmem's additions: query and key counts per sequence read from
/// kvmem's schedule (not from q_indptr and the page table: q_indptr only places the queries), the logit scale
/// of every query and head, and the state rows' bias.
template <class DType>
struct ReadoutParams : fi::BatchPrefillPagedParams<DType, DType, DType, std::int32_t> {
  const std::int32_t* qo_lens = nullptr;
  const std::int32_t* kv_lens = nullptr;
  const float* scales = nullptr;  ///< [B, max_queries, Hq]
  std::uint32_t scale_rows = 0;   ///< max_queries
  const float* row_bias = nullptr;
  std::uint32_t bias_stride_b = 0, bias_stride_h = 0;

  __host__ __device__ __forceinline__ std::uint32_t get_qo_len(std::uint32_t b) const { return qo_lens[b]; }
  __host__ __device__ __forceinline__ std::uint32_t get_kv_len(std::uint32_t b) const { return kv_lens[b]; }
};

/// kvmem's attention variant: each query's logit scale of the segment and the row bias, added before the
/// softmax; the kernel then multiplies by log2(e) and takes exp2, so the softmax is the natural one and the
/// log-sum-exp it writes is base 2 (times log2(e)).
struct ReadoutVariant : fi::AttentionVariantBase {
  static constexpr bool use_softmax = true;
  std::uint32_t qo_len, kv_len, window_left;
  float sm_scale_log2;

  template <class Params>
  __device__ __host__ ReadoutVariant(const Params& params, std::uint32_t batch_idx, std::uint8_t* /*smem*/) {
    qo_len = params.get_qo_len(batch_idx);
    kv_len = params.get_kv_len(batch_idx);
    window_left = kv_len;  // no FlashInfer sliding window: the segment holds exactly the keys read
    sm_scale_log2 = fi::math::log2e;
  }

  REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    if (qo_idx >= qo_len) return logits;  // a padding row of the tile: masked, never read
    const float scale = params.scales[(static_cast<std::size_t>(batch_idx) * params.scale_rows + qo_idx) *
                                          params.num_qo_heads +
                                      qo_head_idx];
    const float bias = params.row_bias != nullptr
                           ? params.row_bias[static_cast<std::size_t>(batch_idx) * params.bias_stride_b +
                                             static_cast<std::size_t>(kv_head_idx) * params.bias_stride_h + kv_idx]
                           : 0.0f;
    return fmaf(logits, scale, bias);
  })
};

template <class DType>
ReadoutParams<DType> params_of(const SegmentLaunch& s) {
  ReadoutParams<DType> p;
  fi::paged_kv_t<DType, std::int32_t> kv;
  kv.page_size = fi::uint_fastdiv(s.page_size);
  kv.num_heads = static_cast<std::uint32_t>(s.kv_heads);
  kv.head_dim = static_cast<std::uint32_t>(s.head_dim);
  kv.batch_size = static_cast<std::uint32_t>(s.batch);
  kv.stride_page = kv.v_stride_page = s.stride_page;
  kv.stride_n = kv.v_stride_n = s.stride_n;
  kv.stride_h = kv.v_stride_h = s.stride_h;
  kv.k_data = const_cast<DType*>(static_cast<const DType*>(s.keys));
  kv.v_data = const_cast<DType*>(static_cast<const DType*>(s.values));
  kv.indices = const_cast<std::int32_t*>(s.page_indices);
  kv.indptr = const_cast<std::int32_t*>(s.page_indptr);
  kv.last_page_len = const_cast<std::int32_t*>(s.last_page_len);
  p.q = const_cast<DType*>(static_cast<const DType*>(s.q));
  p.paged_kv = kv;
  p.q_indptr = const_cast<std::int32_t*>(s.q_indptr);
  p.o = static_cast<DType*>(s.out);
  p.lse = s.lse;
  p.group_size = fi::uint_fastdiv(static_cast<std::uint32_t>(s.query_heads / s.kv_heads));
  p.num_qo_heads = static_cast<std::uint32_t>(s.query_heads);
  p.q_stride_n = s.q_stride_n;
  p.q_stride_h = s.q_stride_h;
  p.window_left = -1;
  p.sm_scale = 1.0f;
  p.rope_rcp_scale = p.rope_rcp_theta = 1.0f;
  p.request_indices = const_cast<std::int32_t*>(s.request_indices);
  p.qo_tile_indices = const_cast<std::int32_t*>(s.qo_tile_indices);
  p.kv_tile_indices = const_cast<std::int32_t*>(s.kv_tile_indices);
  p.o_indptr = const_cast<std::int32_t*>(s.o_indptr);
  p.kv_chunk_size_ptr = const_cast<std::int32_t*>(s.kv_chunk_size);
  p.block_valid_mask = const_cast<bool*>(s.block_valid);
  p.max_total_num_rows = static_cast<std::uint32_t>(s.batch) * static_cast<std::uint32_t>(s.max_queries);
  p.padded_batch_size = s.blocks;
  p.partition_kv = s.kv_chunks > 1;  // set again by the launcher from tmp_v
  p.merge_indptr = const_cast<std::int32_t*>(s.merge_indptr);
  p.total_num_rows = const_cast<std::uint32_t*>(s.merged_rows);
  p.qo_lens = s.qo_lens;
  p.kv_lens = s.kv_lens;
  p.scales = s.scales;
  p.scale_rows = static_cast<std::uint32_t>(s.max_queries);
  p.row_bias = s.row_bias;
  p.bias_stride_b = s.bias_stride_b;
  p.bias_stride_h = s.bias_stride_h;
  return p;
}

/// One instantiation: K and V share strides (SAME_KV_STRIDES), no RoPE, float32 QK accumulation; a KV
/// partition where tmp_v is not null (chunk outputs, then FlashInfer's merge).
template <class DType, std::uint32_t HeadDim, std::uint32_t TileQ, fi::MaskMode Mask>
cudaError_t run(const ReadoutParams<DType>& p, DType* tmp_v, float* tmp_s, cudaStream_t stream) {
  return fi::BatchPrefillWithPagedKVCacheDispatched<true, TileQ, HeadDim, HeadDim, fi::PosEncodingMode::kNone, false,
                                                    Mask, ReadoutVariant, ReadoutParams<DType>>(
      p, tmp_v, tmp_s, /*enable_pdl=*/false, stream);
}

template <class DType, std::uint32_t HeadDim, std::uint32_t TileQ>
cudaError_t run_mask(const SegmentLaunch& s, cudaStream_t stream) {
  const auto p = params_of<DType>(s);
  DType* tmp_v = s.kv_chunks > 1 ? static_cast<DType*>(s.chunk_out) : nullptr;
  float* tmp_s = s.kv_chunks > 1 ? s.chunk_lse : nullptr;
  return s.causal ? run<DType, HeadDim, TileQ, fi::MaskMode::kCausal>(p, tmp_v, tmp_s, stream)
                  : run<DType, HeadDim, TileQ, fi::MaskMode::kNone>(p, tmp_v, tmp_s, stream);
}

template <class DType, std::uint32_t HeadDim>
cudaError_t run_tile(const SegmentLaunch& s, cudaStream_t stream) {
  switch (s.cta_tile_q) {
    case 16: return run_mask<DType, HeadDim, 16>(s, stream);
    case 64: return run_mask<DType, HeadDim, 64>(s, stream);
    case 128: return run_mask<DType, HeadDim, 128>(s, stream);
    default:
      throw std::invalid_argument("kvmem flashinfer readout: cta_tile_q = " + std::to_string(s.cta_tile_q) +
                                  " (instantiated: 16, 64, 128)");
  }
}

template <class DType>
cudaError_t run_head_dim(const SegmentLaunch& s, cudaStream_t stream) {
  if (s.head_dim == 64) return run_tile<DType, 64>(s, stream);
  if (s.head_dim == 128) return run_tile<DType, 128>(s, stream);
  throw std::invalid_argument("kvmem flashinfer readout: head_dim = " + std::to_string(s.head_dim) +
                              " (instantiated: 64, 128)");
}

}  // namespace

void launch_segment(const SegmentLaunch& launch, cudaStream_t stream) {
  if (launch.kv_chunks > 1 && launch.max_queries != 1)
    throw std::invalid_argument("kvmem flashinfer readout: kv_chunks = " + std::to_string(launch.kv_chunks) +
                                " with max_queries = " + std::to_string(launch.max_queries) +
                                " (a KV partition takes one query per sequence)");
  const std::string kernel = std::string("kvmem::backend::cuda::flashinfer::launch_segment (FlashInfer's "
                                         "BatchPrefillWithPagedKVCacheKernel") +
                             (launch.kv_chunks > 1 ? " and VariableLengthMergeStates" : "") + " over the " +
                             launch.segment + ", head_dim " + std::to_string(launch.head_dim) + ", query tile " +
                             std::to_string(launch.cta_tile_q) + ")";
  cudaError_t status = cudaSuccess;
  try {
    status = launch.storage == Storage16::bfloat16 ? run_head_dim<nv_bfloat16>(launch, stream)
                                                   : run_head_dim<__half>(launch, stream);
  } catch (const fi::Error& e) {
    throw std::runtime_error(kernel + ": FlashInfer refused the launch: " + e.what());
  }
  if (status != cudaSuccess)
    throw std::runtime_error(kernel + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

}  // namespace kvmem::backend::cuda::flashinfer
