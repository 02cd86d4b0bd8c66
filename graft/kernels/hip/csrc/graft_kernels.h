// Host launchers of graft's CUDA/HIP kernels: a torch-free C++ interface.
//
// The kernel translation units (*.cu) include only this header and compat.cuh, so
// each compiles standalone with nvcc (or hipcc after hipify) without PyTorch; the
// torch binding (bindings.cpp) converts tensors to raw pointers and strides and
// calls these. Every launcher returns the launch's error status.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace graft {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------- fused
// x rows are `x_stride` elements apart (unit stride inside a row); out and
// residual_out are contiguous [rows, hidden]. residual may be null (plain RMSNorm).
// weight is either of `dtype` or float32 (`weight_fp32`).
cudaError_t launch_rms_norm(DType dtype, const void* x, int64_t x_stride, const void* residual,
                            int64_t residual_stride, const void* weight, bool weight_fp32, void* out,
                            void* residual_out, int64_t rows, int64_t hidden, float eps, cudaStream_t stream);

// x [rows, 2*d] with rows `x_stride` apart; out contiguous [rows, d].
cudaError_t launch_silu_and_mul(DType dtype, const void* x, int64_t x_stride, void* out, int64_t rows,
                                int64_t d, cudaStream_t stream);

// ---------------------------------------------------------------- attention
struct PagedDecodeArgs {
  const void* query;  // [num_seqs, num_heads, head_dim], unit inner stride
  int64_t q_stride_seq, q_stride_head;
  const void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], unit inner stride
  int64_t k_stride_block, k_stride_token, k_stride_head;
  const void* value_cache;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], unit inner stride
  int64_t block_tables_stride;
  const int32_t* seq_lens;  // [num_seqs]
  void* out;  // contiguous [num_seqs, num_heads, head_dim]
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  // Bounds for values that are not checked on the device: seq_lens are clamped to
  // [0, max_blocks_per_seq * block_size], table entries outside [0, num_blocks) are skipped.
  int64_t num_blocks, max_blocks_per_seq;
  float scale;
};

// Largest head_dim the decode kernel serves (per-lane accumulators are sized for it).
constexpr int kDecodeMaxHeadDim = 256;

cudaError_t launch_paged_decode(DType dtype, const PagedDecodeArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------- gemm
// Dequantize int4 weights into W [K, N] (row-major, `dtype`); scales [K/g, N] of `dtype`.
// GPTQ: qweight [K/8, N], nibble j of row r is k = 8r + j; qzeros [K/g, N/8] hold zero - 1.
// AWQ:  qweight [K, N/8], nibble i of column c is n = 8c + {0,2,4,6,1,3,5,7}[i]; qzeros hold zero.
// qzeros may be null: symmetric, zero point 8. group_size divides K.
cudaError_t launch_int4_dequant(DType dtype, bool awq, const int32_t* qweight, const void* scales,
                                const int32_t* qzeros, void* w, int64_t k, int64_t n, int64_t group_size,
                                cudaStream_t stream);

// ---------------------------------------------------------------- moe
// logits [tokens, experts] with rows `logits_stride` apart -> weights fp32 [tokens, top_k],
// ids int32 [tokens, top_k]. Softmax (or sigmoid) in fp32, largest first, ties to the lowest id.
cudaError_t launch_topk_routing(DType dtype, const void* logits, int64_t logits_stride, float* weights,
                                int32_t* ids, int64_t tokens, int experts, int top_k, bool renormalize,
                                bool sigmoid, cudaStream_t stream);

}  // namespace graft
