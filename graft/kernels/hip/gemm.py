"""HIP/CUDA kernel for gemm.w4a16 (csrc/gemm_kernels.cu): GPTQ/AWQ int4 weights are
dequantized group-wise into a dense [K, N] matrix of the activation dtype, then
multiplied with torch.matmul (the vendor BLAS)."""
from __future__ import annotations

import torch

from graft.custom_ops import define_op
from graft.kernels.hip._build import load_extension
from graft.kernels.hip._common import hip_implementation
from graft.quant import PACK_FACTOR


def _dims(x: torch.Tensor, qweight: torch.Tensor, awq: bool) -> tuple[int, int]:
    k = x.shape[-1]
    return k, qweight.shape[1] * PACK_FACTOR if awq else qweight.shape[1]


def _w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
           bias: torch.Tensor | None, group_size: int, awq: bool) -> torch.Tensor:
    k, n = _dims(x, qweight, awq)
    group = k if group_size == -1 else group_size
    weight = load_extension().int4_dequant(qweight, scales.to(x.dtype), qzeros, group, awq, k, n)
    y = torch.matmul(x.reshape(-1, k), weight)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n)


def _w4a16_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                bias: torch.Tensor | None, group_size: int, awq: bool) -> torch.Tensor:
    _, n = _dims(x, qweight, awq)
    return x.new_empty((*x.shape[:-1], n))


w4a16_op = define_op("gemm_w4a16_hip", _w4a16, fake=_w4a16_fake, device_types="cuda")


def w4a16(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    return w4a16_op(x, qweight, scales, qzeros, bias, int(group_size), format == "awq")


def check(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    if format not in ("gptq", "awq"):
        return f"format {format!r}: the HIP kernel unpacks GPTQ and AWQ words only"
    return None


def register(registry) -> None:
    registry.add_impl(hip_implementation(
        "gemm.w4a16", w4a16, w4a16_op,
        "HIP/CUDA int4 dequantize (GPTQ and AWQ packing) into fp16/bf16 weights + torch.matmul", check=check,
        check_scalars=("format",)))
