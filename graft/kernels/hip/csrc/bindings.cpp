// PyTorch binding of graft's CUDA/HIP kernels: tensors in, raw pointers + strides to
// the torch-free launchers (graft_kernels.h), tensors out. Compiled by
// torch.utils.cpp_extension (hipified on ROCm). Python-side validation
// (graft.ops.*) has already run; the TORCH_CHECKs here guard layout assumptions.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>

#include "graft_kernels.h"

namespace {

graft::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return graft::DType::kFloat32;
    case at::kHalf:
      return graft::DType::kFloat16;
    case at::kBFloat16:
      return graft::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "graft hip kernels support float32, float16 and bfloat16, got ", t.scalar_type());
  }
}

void check_launch(cudaError_t status, const char* kernel) {
  TORCH_CHECK(status == cudaSuccess, "graft ", kernel, " kernel launch failed: ", cudaGetErrorString(status));
}

void check_cuda_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "graft hip kernels: ", name, " must be a CUDA/ROCm tensor, got ", t.device());
}

// [..., H] -> [rows, H] with unit inner stride (a view when the layout allows).
at::Tensor as_rows(const at::Tensor& t) {
  at::Tensor rows = t.reshape({-1, t.size(-1)});
  return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

at::Tensor inner_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps) {
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.numel() == 0) {  // nothing to do; also keeps reshape({-1, 0}) out of the way
    return {at::empty(x.sizes(), x.options()), residual.has_value() ? at::empty(x.sizes(), x.options()) : at::Tensor()};
  }
  const at::Tensor x_rows = as_rows(x);
  const bool weight_fp32 = weight.scalar_type() != x.scalar_type();
  const at::Tensor w = weight_fp32 ? weight.to(at::kFloat).contiguous() : weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor residual_out;
  at::Tensor res_rows;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "residual must have x's dtype");
    res_rows = as_rows(*residual);
    residual_out = at::empty(x.sizes(), x.options());
  }
  check_launch(graft::launch_rms_norm(dtype_of(x), x_rows.data_ptr(), x_rows.stride(0),
                                      residual.has_value() ? res_rows.data_ptr() : nullptr,
                                      residual.has_value() ? res_rows.stride(0) : 0, w.data_ptr(), weight_fp32,
                                      out.data_ptr(), residual.has_value() ? residual_out.data_ptr() : nullptr,
                                      x_rows.size(0), x_rows.size(1), static_cast<float>(eps),
                                      c10::cuda::getCurrentCUDAStream()),
               "rms_norm");
  return {out, residual_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_impl(x, std::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, residual, weight, eps);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cuda_tensor(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t d = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  const at::Tensor x_rows = as_rows(x);
  check_launch(graft::launch_silu_and_mul(dtype_of(x), x_rows.data_ptr(), x_rows.stride(0), out.data_ptr(),
                                          x_rows.size(0), d, c10::cuda::getCurrentCUDAStream()),
               "silu_and_mul");
  return out;
}

at::Tensor decode_paged(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_cuda_tensor(query, "query");
  const c10::cuda::CUDAGuard guard(query.device());
  TORCH_CHECK(query.size(2) <= graft::kDecodeMaxHeadDim, "head_dim ", query.size(2), " > ",
              graft::kDecodeMaxHeadDim);
  const at::Tensor q = inner_contiguous(query);
  const at::Tensor k = inner_contiguous(key_cache);
  const at::Tensor v = inner_contiguous(value_cache);
  const at::Tensor tables = inner_contiguous(block_tables.to(at::kInt));
  const at::Tensor lens = seq_lens.to(at::kInt).contiguous();
  at::Tensor out = at::empty(query.sizes(), query.options());
  graft::PagedDecodeArgs args;
  args.query = q.data_ptr();
  args.q_stride_seq = q.stride(0);
  args.q_stride_head = q.stride(1);
  args.key_cache = k.data_ptr();
  args.k_stride_block = k.stride(0);
  args.k_stride_token = k.stride(1);
  args.k_stride_head = k.stride(2);
  args.value_cache = v.data_ptr();
  args.v_stride_block = v.stride(0);
  args.v_stride_token = v.stride(1);
  args.v_stride_head = v.stride(2);
  args.block_tables = tables.data_ptr<int32_t>();
  args.block_tables_stride = tables.stride(0);
  args.seq_lens = lens.data_ptr<int32_t>();
  args.out = out.data_ptr();
  args.num_seqs = static_cast<int>(query.size(0));
  args.num_heads = static_cast<int>(query.size(1));
  args.head_dim = static_cast<int>(query.size(2));
  args.block_size = static_cast<int>(key_cache.size(1));
  args.num_kv_heads = static_cast<int>(key_cache.size(2));
  args.num_blocks = key_cache.size(0);
  args.max_blocks_per_seq = block_tables.size(1);
  args.scale = static_cast<float>(scale);
  check_launch(graft::launch_paged_decode(dtype_of(query), args, c10::cuda::getCurrentCUDAStream()), "paged_decode");
  return out;
}

at::Tensor int4_dequant(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& qzeros,
                        int64_t group_size, bool awq, int64_t k, int64_t n) {
  check_cuda_tensor(qweight, "qweight");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const at::Tensor qw = qweight.contiguous();
  const at::Tensor s = scales.contiguous();
  at::Tensor qz;
  if (qzeros.has_value()) qz = qzeros->contiguous();
  at::Tensor w = at::empty({k, n}, scales.options());
  check_launch(graft::launch_int4_dequant(dtype_of(scales), awq, qw.data_ptr<int32_t>(), s.data_ptr(),
                                          qzeros.has_value() ? qz.data_ptr<int32_t>() : nullptr, w.data_ptr(), k, n,
                                          group_size, c10::cuda::getCurrentCUDAStream()),
               "int4_dequant");
  return w;
}

std::tuple<at::Tensor, at::Tensor> topk_routing(const at::Tensor& logits, int64_t top_k, bool renormalize,
                                                bool sigmoid) {
  check_cuda_tensor(logits, "router_logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor rows = inner_contiguous(logits);
  const int64_t tokens = logits.size(0);
  at::Tensor weights = at::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({tokens, top_k}, logits.options().dtype(at::kInt));
  check_launch(graft::launch_topk_routing(dtype_of(logits), rows.data_ptr(), rows.stride(0),
                                          weights.data_ptr<float>(), ids.data_ptr<int32_t>(), tokens,
                                          static_cast<int>(logits.size(1)), static_cast<int>(top_k), renormalize,
                                          sigmoid, c10::cuda::getCurrentCUDAStream()),
               "topk_routing");
  return {weights, ids};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "graft CUDA/HIP kernels";
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm: (out, x + residual)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :D]) * x[..., D:]");
  m.def("decode_paged", &decode_paged, "paged-KV single-token decode attention");
  m.def("int4_dequant", &int4_dequant, "GPTQ/AWQ int4 -> dense [K, N]");
  m.def("topk_routing", &topk_routing, "softmax/sigmoid + top-k per token");
}
