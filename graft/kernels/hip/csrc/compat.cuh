// Vendor-neutral device helpers for graft's CUDA-flavoured kernels.
//
// The kernels are written once in CUDA syntax. nvcc compiles them as is; on ROCm,
// PyTorch's hipify rewrites the CUDA names (cudaStream_t, cuda_fp16.h, ...) and
// hipcc compiles the result. What hipify cannot fix is semantics, so this header
// owns the two things that differ between the vendors:
//
//   * the warp width: 32 lanes on NVIDIA, 64 on AMD CDNA (gfx9), 32 on RDNA;
//   * the shuffle intrinsic: __shfl_xor_sync (mask) on CUDA, __shfl_xor on HIP.
//
// Reductions below never assume a width: they loop over GRAFT_WARP_SIZE, and
// blocks combine per-warp partials through shared memory sized for the narrowest
// warp (so a 256-thread block is 8 warps on NVIDIA and 4 wavefronts on AMD).
// No inline PTX/GCN assembly anywhere in the portable path.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define GRAFT_HIP 1
#else
#define GRAFT_HIP 0
#endif

// Device-side warp width. __AMDGCN_WAVEFRONT_SIZE is set by hipcc per target
// (64 for gfx9 CDNA, 32 for RDNA); the host pass never uses GRAFT_WARP_SIZE.
#if GRAFT_HIP
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define GRAFT_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define GRAFT_WARP_SIZE 64
#endif
#else
#define GRAFT_WARP_SIZE 32
#endif

// Most warps a block can hold (block sizes are at most 1024 threads; narrowest warp 32).
#define GRAFT_MAX_WARPS 32

namespace graft {

// ------------------------------------------------------------------ shuffles

template <typename T>
__device__ __forceinline__ T shfl_xor(T value, int lane_mask) {
#if GRAFT_HIP
  return __shfl_xor(value, lane_mask, GRAFT_WARP_SIZE);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask, GRAFT_WARP_SIZE);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = GRAFT_WARP_SIZE / 2; offset > 0; offset >>= 1) v += shfl_xor(v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = GRAFT_WARP_SIZE / 2; offset > 0; offset >>= 1) v = fmaxf(v, shfl_xor(v, offset));
  return v;
}

// Largest value, lowest index on ties (the order torch's stable descending sort gives).
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
#pragma unroll
  for (int offset = GRAFT_WARP_SIZE / 2; offset > 0; offset >>= 1) {
    float other_value = shfl_xor(value, offset);
    int other_index = shfl_xor(index, offset);
    if (other_value > value || (other_value == value && other_index < index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// ------------------------------------------------------------------ block reductions
// Every thread of the block must call these; every thread gets the result.

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[GRAFT_MAX_WARPS];
  const int lane = threadIdx.x % GRAFT_WARP_SIZE;
  const int warp = threadIdx.x / GRAFT_WARP_SIZE;
  const int num_warps = (blockDim.x + GRAFT_WARP_SIZE - 1) / GRAFT_WARP_SIZE;
  v = warp_sum(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < num_warps ? partial[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[GRAFT_MAX_WARPS];
  const int lane = threadIdx.x % GRAFT_WARP_SIZE;
  const int warp = threadIdx.x / GRAFT_WARP_SIZE;
  const int num_warps = (blockDim.x + GRAFT_WARP_SIZE - 1) / GRAFT_WARP_SIZE;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < num_warps ? partial[lane] : -INFINITY;
  return warp_max(v);
}

__device__ __forceinline__ void block_argmax(float& value, int& index) {
  __shared__ float partial_value[GRAFT_MAX_WARPS];
  __shared__ int partial_index[GRAFT_MAX_WARPS];
  const int lane = threadIdx.x % GRAFT_WARP_SIZE;
  const int warp = threadIdx.x / GRAFT_WARP_SIZE;
  const int num_warps = (blockDim.x + GRAFT_WARP_SIZE - 1) / GRAFT_WARP_SIZE;
  warp_argmax(value, index);
  __syncthreads();
  if (lane == 0) {
    partial_value[warp] = value;
    partial_index[warp] = index;
  }
  __syncthreads();
  value = lane < num_warps ? partial_value[lane] : -INFINITY;
  index = lane < num_warps ? partial_index[lane] : INT32_MAX;
  warp_argmax(value, index);
}

// ------------------------------------------------------------------ element conversions

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

}  // namespace graft
