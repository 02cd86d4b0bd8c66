// gemm.w4a16: dequantize GPTQ/AWQ int4 weights into a dense [K, N] matrix of the
// activation dtype; the binding then runs the matmul with the vendor BLAS.
//
// One thread per packed int32: it unpacks its eight 4-bit codes, looks up the
// group's zero point and scale, and writes eight weights. For GPTQ the eight codes
// run down K (coalesced along N across the warp); for AWQ they run along N in the
// interleaved order {0,2,4,6,1,3,5,7}.
#include "compat.cuh"
#include "graft_kernels.h"

namespace graft {
namespace {

constexpr int kPack = 8;  // int4 codes per int32

__device__ __forceinline__ int nibble(uint32_t word, int i) { return static_cast<int>((word >> (4 * i)) & 0xFu); }

// Column offset (within its group of 8) of AWQ nibble i.
__device__ __forceinline__ int awq_column_of_nibble(int i) { return (i % 4) * 2 + i / 4; }

template <typename T>
__global__ void gptq_dequant_kernel(const int32_t* __restrict__ qweight, const T* __restrict__ scales,
                                    const int32_t* __restrict__ qzeros, T* __restrict__ w, int64_t k, int64_t n,
                                    int64_t group_size) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= n) return;
  const int64_t zero_cols = n / kPack;
  for (int64_t packed_row = blockIdx.y; packed_row < k / kPack; packed_row += gridDim.y) {
    const uint32_t word = static_cast<uint32_t>(qweight[packed_row * n + col]);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const int64_t row = packed_row * kPack + j;
      const int64_t group = row / group_size;
      // GPTQ stores zero - 1 (packed along N); no qzeros means symmetric, zero point 8.
      const int zero = qzeros != nullptr
                           ? nibble(static_cast<uint32_t>(qzeros[group * zero_cols + col / kPack]), col % kPack) + 1
                           : 8;
      const float scale = to_float(scales[group * n + col]);
      w[row * n + col] = from_float<T>(static_cast<float>(nibble(word, j) - zero) * scale);
    }
  }
}

template <typename T>
__global__ void awq_dequant_kernel(const int32_t* __restrict__ qweight, const T* __restrict__ scales,
                                   const int32_t* __restrict__ qzeros, T* __restrict__ w, int64_t k, int64_t n,
                                   int64_t group_size) {
  const int64_t packed_col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packed_cols = n / kPack;
  if (packed_col >= packed_cols) return;
  for (int64_t row = blockIdx.y; row < k; row += gridDim.y) {
    const uint32_t word = static_cast<uint32_t>(qweight[row * packed_cols + packed_col]);
    const int64_t group = row / group_size;
    const uint32_t zero_word =
        qzeros != nullptr ? static_cast<uint32_t>(qzeros[group * packed_cols + packed_col]) : 0u;
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
      const int64_t col = packed_col * kPack + awq_column_of_nibble(i);
      const int zero = qzeros != nullptr ? nibble(zero_word, i) : 8;  // AWQ stores the zero point itself
      const float scale = to_float(scales[group * n + col]);
      w[row * n + col] = from_float<T>(static_cast<float>(nibble(word, i) - zero) * scale);
    }
  }
}

// gridDim.y is capped at 65535: longer K is covered by the kernels' row loops.
unsigned grid_rows(int64_t rows) { return static_cast<unsigned>(rows < 65535 ? rows : 65535); }

template <typename T>
cudaError_t int4_dequant_typed(bool awq, const int32_t* qweight, const void* scales, const int32_t* qzeros, void* w,
                               int64_t k, int64_t n, int64_t group_size, cudaStream_t stream) {
  const int threads = 256;
  const T* s = static_cast<const T*>(scales);
  T* out = static_cast<T*>(w);
  if (awq) {
    const dim3 grid(static_cast<unsigned>((n / kPack + threads - 1) / threads), grid_rows(k));
    awq_dequant_kernel<T><<<grid, threads, 0, stream>>>(qweight, s, qzeros, out, k, n, group_size);
  } else {
    const dim3 grid(static_cast<unsigned>((n + threads - 1) / threads), grid_rows(k / kPack));
    gptq_dequant_kernel<T><<<grid, threads, 0, stream>>>(qweight, s, qzeros, out, k, n, group_size);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_int4_dequant(DType dtype, bool awq, const int32_t* qweight, const void* scales,
                                const int32_t* qzeros, void* w, int64_t k, int64_t n, int64_t group_size,
                                cudaStream_t stream) {
  if (k == 0 || n == 0) return cudaSuccess;
  if (group_size <= 0 || k % group_size || (awq ? n % kPack : k % kPack) || (qzeros != nullptr && n % kPack)) {
    return cudaErrorInvalidValue;
  }
  switch (dtype) {
    case DType::kFloat32:
      return int4_dequant_typed<float>(awq, qweight, scales, qzeros, w, k, n, group_size, stream);
    case DType::kFloat16:
      return int4_dequant_typed<__half>(awq, qweight, scales, qzeros, w, k, n, group_size, stream);
    case DType::kBFloat16:
      return int4_dequant_typed<__nv_bfloat16>(awq, qweight, scales, qzeros, w, k, n, group_size, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace graft
