// attention.decode_paged: one query token per sequence against a paged KV cache
// (vLLM layout [num_blocks, block_size, num_kv_heads, head_dim], any strides).
//
// One block per (sequence, query head). Each warp walks a strided subset of the
// context's tokens: lanes split head_dim, a warp shuffle reduction gives q.k, and
// the warp keeps an online-softmax state (running max m, normaliser l, weighted V
// accumulator spread over its lanes). The warps' states are merged through shared
// memory at the end. Softmax and accumulation are fp32.
#include "compat.cuh"
#include "graft_kernels.h"

namespace graft {
namespace {

// 256 threads: 8 warps on NVIDIA, 4 wavefronts on AMD CDNA.
constexpr int kDecodeThreads = 256;
constexpr int kDecodeMaxWarps = kDecodeThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_kernel(PagedDecodeArgs args) {
  constexpr int kPerLane = (kDecodeMaxHeadDim + GRAFT_WARP_SIZE - 1) / GRAFT_WARP_SIZE;
  __shared__ float warp_max_s[kDecodeMaxWarps];
  __shared__ float warp_sum_s[kDecodeMaxWarps];
  __shared__ float warp_acc_s[kDecodeMaxWarps * kDecodeMaxHeadDim];

  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int lane = threadIdx.x % GRAFT_WARP_SIZE;
  const int warp = threadIdx.x / GRAFT_WARP_SIZE;
  const int num_warps = blockDim.x / GRAFT_WARP_SIZE;
  const int head_dim = args.head_dim;
  T* out = static_cast<T*>(args.out) + (static_cast<int64_t>(seq) * args.num_heads + head) * head_dim;

  // Clamped to the table's capacity: no read past the sequence's block-table row.
  const int64_t capacity = args.max_blocks_per_seq * args.block_size;
  const int context_len = static_cast<int>(min(max(static_cast<int64_t>(args.seq_lens[seq]), int64_t{0}), capacity));
  if (context_len <= 0) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) out[d] = from_float<T>(0.0f);
    return;
  }
  const int kv_head = head / (args.num_heads / args.num_kv_heads);

  // The query, pre-scaled, split over the lanes: lane l holds dims l, l + W, l + 2W, ...
  const T* q = static_cast<const T*>(args.query) + seq * args.q_stride_seq + head * args.q_stride_head;
  float q_reg[kPerLane];
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * GRAFT_WARP_SIZE;
    q_reg[i] = d < head_dim ? to_float(q[d]) * args.scale : 0.0f;
    acc[i] = 0.0f;
  }

  const T* key_cache = static_cast<const T*>(args.key_cache);
  const T* value_cache = static_cast<const T*>(args.value_cache);
  const int32_t* block_table = args.block_tables + seq * args.block_tables_stride;
  float running_max = -INFINITY;
  float running_sum = 0.0f;
  for (int t = warp; t < context_len; t += num_warps) {
    const int64_t block = block_table[t / args.block_size];
    if (block < 0 || block >= args.num_blocks) continue;  // invalid entry: its tokens are skipped (warp-uniform)
    const int64_t slot = t % args.block_size;
    const T* k = key_cache + block * args.k_stride_block + slot * args.k_stride_token + kv_head * args.k_stride_head;
    const T* v = value_cache + block * args.v_stride_block + slot * args.v_stride_token + kv_head * args.v_stride_head;
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + i * GRAFT_WARP_SIZE;
      if (d < head_dim) partial += q_reg[i] * to_float(k[d]);
    }
    const float score = warp_sum(partial);
    const float new_max = fmaxf(running_max, score);
    const float rescale = expf(running_max - new_max);  // 0 on the first token (max was -inf)
    const float p = expf(score - new_max);
    running_sum = running_sum * rescale + p;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + i * GRAFT_WARP_SIZE;
      const float vd = d < head_dim ? to_float(v[d]) : 0.0f;
      acc[i] = acc[i] * rescale + p * vd;
    }
    running_max = new_max;
  }

  // Merge the warps' softmax states.
  if (lane == 0) {
    warp_max_s[warp] = running_max;
    warp_sum_s[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + i * GRAFT_WARP_SIZE;
    if (d < head_dim) warp_acc_s[warp * kDecodeMaxHeadDim + d] = acc[i];
  }
  __syncthreads();
  float global_max = -INFINITY;
  for (int w = 0; w < num_warps; ++w) global_max = fmaxf(global_max, warp_max_s[w]);
  // Warps that saw no valid token hold max -inf, sum 0: weight 0. No valid token at all
  // (every entry skipped): a zero row, as the reference gives.
  auto weight = [&](int w) { return warp_max_s[w] == -INFINITY ? 0.0f : expf(warp_max_s[w] - global_max); };
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += warp_sum_s[w] * weight(w);
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float value = 0.0f;
    for (int w = 0; w < num_warps; ++w) {
      value += warp_acc_s[w * kDecodeMaxHeadDim + d] * weight(w);
    }
    out[d] = from_float<T>(value * inv_total);
  }
}

template <typename T>
cudaError_t paged_decode_typed(const PagedDecodeArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.num_seqs), static_cast<unsigned>(args.num_heads));
  paged_decode_kernel<T><<<grid, kDecodeThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_paged_decode(DType dtype, const PagedDecodeArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0 || args.num_heads == 0) return cudaSuccess;
  if (args.head_dim > kDecodeMaxHeadDim || args.num_kv_heads <= 0 || args.num_heads % args.num_kv_heads) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::kFloat32:
      return paged_decode_typed<float>(args, stream);
    case DType::kFloat16:
      return paged_decode_typed<__half>(args, stream);
    case DType::kBFloat16:
      return paged_decode_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace graft
