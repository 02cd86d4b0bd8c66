// moe.topk_routing: per token, softmax (or sigmoid) over the experts in fp32, then the
// top_k largest scores, largest first, ties to the lowest expert id, optionally
// renormalised to sum to one.
//
// One block per token. The token's scores live in shared memory (num_experts
// floats); softmax uses block max/sum reductions and each of the top_k picks is a
// block arg-max (warp shuffles + shared memory) after which the winner is masked.
#include "compat.cuh"
#include "graft_kernels.h"

namespace graft {
namespace {

constexpr int kRoutingThreads = 128;  // a multiple of 64: whole warps on every vendor

template <typename T>
__global__ void __launch_bounds__(kRoutingThreads)
    topk_routing_kernel(const T* __restrict__ logits, int64_t logits_stride, float* __restrict__ weights,
                        int32_t* __restrict__ ids, int experts, int top_k, bool renormalize, bool sigmoid) {
  extern __shared__ float scores[];  // [experts] scores, then [experts] taken flags
  unsigned char* taken = reinterpret_cast<unsigned char*>(scores + experts);
  const int64_t token = blockIdx.x;
  const T* row = logits + token * logits_stride;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) taken[e] = 0;

  float local_max = -INFINITY;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const float v = to_float(row[e]);
    scores[e] = v;
    local_max = fmaxf(local_max, v);
  }
  if (sigmoid) {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
  } else {
    const float row_max = block_max(local_max);
    float local_sum = 0.0f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float p = expf(scores[e] - row_max);
      scores[e] = p;
      local_sum += p;
    }
    const float inv_sum = 1.0f / block_sum(local_sum);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) scores[e] *= inv_sum;
  }
  __syncthreads();

  // Picks rank on keys: a NaN score ranks above every number (torch.sort's order, the
  // reference's), taken experts get -inf. Every comparison is then ordered, so an
  // all-NaN row still picks real ids (0, 1, ...) and best_id never stays INT32_MAX.
  float picked_total = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    // Each thread scans its experts in increasing id order; strict '>' keeps the lowest id on ties.
    float best = -INFINITY;
    int best_id = INT32_MAX;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float key = taken[e] ? -INFINITY : (isnan(scores[e]) ? INFINITY : scores[e]);
      if (key > best || best_id == INT32_MAX) {
        best = key;
        best_id = e;
      }
    }
    block_argmax(best, best_id);
    if (best_id < 0 || best_id >= experts) best_id = 0;  // unreachable (top_k <= experts); never index past the row
    const float weight = scores[best_id];
    picked_total += weight;
    __syncthreads();  // everyone has read scores/taken before thread 0 marks the pick
    if (threadIdx.x == 0) {
      weights[token * top_k + j] = weight;
      ids[token * top_k + j] = best_id;
      taken[best_id] = 1;
    }
    __syncthreads();
  }
  if (renormalize && threadIdx.x == 0) {
    const float inv_total = 1.0f / picked_total;
    for (int j = 0; j < top_k; ++j) weights[token * top_k + j] *= inv_total;
  }
}

template <typename T>
cudaError_t topk_routing_typed(const void* logits, int64_t logits_stride, float* weights, int32_t* ids,
                               int64_t tokens, int experts, int top_k, bool renormalize, bool sigmoid,
                               cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(experts) * (sizeof(float) + 1);
  topk_routing_kernel<T><<<static_cast<unsigned>(tokens), kRoutingThreads, shared, stream>>>(
      static_cast<const T*>(logits), logits_stride, weights, ids, experts, top_k, renormalize, sigmoid);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_topk_routing(DType dtype, const void* logits, int64_t logits_stride, float* weights, int32_t* ids,
                                int64_t tokens, int experts, int top_k, bool renormalize, bool sigmoid,
                                cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (top_k <= 0 || top_k > experts) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return topk_routing_typed<float>(logits, logits_stride, weights, ids, tokens, experts, top_k, renormalize,
                                       sigmoid, stream);
    case DType::kFloat16:
      return topk_routing_typed<__half>(logits, logits_stride, weights, ids, tokens, experts, top_k, renormalize,
                                        sigmoid, stream);
    case DType::kBFloat16:
      return topk_routing_typed<__nv_bfloat16>(logits, logits_stride, weights, ids, tokens, experts, top_k,
                                               renormalize, sigmoid, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace graft
