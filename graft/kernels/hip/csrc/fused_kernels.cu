// fused.rms_norm (plain and with the residual add) and fused.silu_and_mul.
//
// RMSNorm: one block per row; threads stride over the row, sums of squares are
// reduced in fp32 with warp shuffles + shared memory (compat.cuh). With a residual
// the first pass also writes residual_out = x + residual (rounded to T) and the
// second pass recomputes x + residual in fp32, so the norm sees the unrounded sum.
#include "compat.cuh"
#include "graft_kernels.h"

namespace graft {
namespace {

template <typename T, typename W>
__global__ void rms_norm_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ residual,
                                int64_t residual_stride, const W* __restrict__ weight, T* __restrict__ out,
                                T* __restrict__ residual_out, int64_t hidden, float eps) {
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * x_stride;
  const T* res_row = residual != nullptr ? residual + row * residual_stride : nullptr;
  T* out_row = out + row * hidden;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(x_row[i]);
    if (res_row != nullptr) {
      v += to_float(res_row[i]);
      residual_out[row * hidden + i] = from_float<T>(v);
    }
    sum_sq += v * v;
  }
  const float rstd = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(x_row[i]);
    if (res_row != nullptr) v += to_float(res_row[i]);
    out_row[i] = from_float<T>(v * rstd * to_float(weight[i]));
  }
}

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, int64_t x_stride, T* __restrict__ out, int64_t d) {
  const int64_t row = blockIdx.x;
  const T* gate = x + row * x_stride;
  const T* up = gate + d;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; i < d;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    const float g = to_float(gate[i]);
    out[row * d + i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
  }
}

// Block sizes are multiples of 64 so they hold whole warps on every vendor.
int norm_threads(int64_t hidden) {
  if (hidden >= 4096) return 1024;
  if (hidden >= 1024) return 512;
  return 256;
}

template <typename T>
cudaError_t rms_norm_typed(const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                           const void* weight, bool weight_fp32, void* out, void* residual_out, int64_t rows,
                           int64_t hidden, float eps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows));
  const dim3 block(norm_threads(hidden));
  const T* xt = static_cast<const T*>(x);
  const T* rt = static_cast<const T*>(residual);
  T* ot = static_cast<T*>(out);
  T* rot = static_cast<T*>(residual_out);
  if (weight_fp32) {
    rms_norm_kernel<T, float><<<grid, block, 0, stream>>>(xt, x_stride, rt, residual_stride,
                                                          static_cast<const float*>(weight), ot, rot, hidden, eps);
  } else {
    rms_norm_kernel<T, T><<<grid, block, 0, stream>>>(xt, x_stride, rt, residual_stride,
                                                      static_cast<const T*>(weight), ot, rot, hidden, eps);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t silu_and_mul_typed(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d,
                               cudaStream_t stream) {
  const int threads = 256;
  const int64_t tiles = (d + threads - 1) / threads;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(tiles < 65535 ? tiles : 65535));
  silu_and_mul_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(x), x_stride, static_cast<T*>(out), d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm(DType dtype, const void* x, int64_t x_stride, const void* residual,
                            int64_t residual_stride, const void* weight, bool weight_fp32, void* out,
                            void* residual_out, int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return rms_norm_typed<float>(x, x_stride, residual, residual_stride, weight, weight_fp32, out, residual_out,
                                   rows, hidden, eps, stream);
    case DType::kFloat16:
      return rms_norm_typed<__half>(x, x_stride, residual, residual_stride, weight, weight_fp32, out, residual_out,
                                    rows, hidden, eps, stream);
    case DType::kBFloat16:
      return rms_norm_typed<__nv_bfloat16>(x, x_stride, residual, residual_stride, weight, weight_fp32, out,
                                           residual_out, rows, hidden, eps, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_silu_and_mul(DType dtype, const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d,
                                cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return silu_and_mul_typed<float>(x, x_stride, out, rows, d, stream);
    case DType::kFloat16:
      return silu_and_mul_typed<__half>(x, x_stride, out, rows, d, stream);
    case DType::kBFloat16:
      return silu_and_mul_typed<__nv_bfloat16>(x, x_stride, out, rows, d, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace graft
