"""The torch definitions of the GEMM ops (dequantise, then one fp32 matmul; the epilogue activations)."""
from __future__ import annotations

import torch

from graft.errors import GraftInputError
from graft.ops._validate import acc
from graft.quant import dequantize_fp8, dequantize_int4, FP8_BLOCK, unpack_int4


ACTIVATIONS = ("none", "relu", "gelu", "gelu_erf", "silu")


def apply_activation(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The epilogue activations, on an fp32 tensor."""
    if activation == "none":
        return y
    if activation == "relu":
        return torch.relu(y)
    if activation == "gelu":
        return torch.nn.functional.gelu(y, approximate="tanh")
    if activation == "gelu_erf":
        return torch.nn.functional.gelu(y)
    if activation == "silu":
        return torch.nn.functional.silu(y)
    raise GraftInputError(f"gemm.linear: unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")


def linear_reference(x, weight, bias=None, activation="none"):
    y = acc(x) @ acc(weight).t()
    if bias is not None:
        y = y + acc(bias)
    return apply_activation(y, activation).to(x.dtype)


def w8a8_reference(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.float16):
    # Integer-valued fp32 matmul (exact while K * 127^2 < 2^24, i.e. K < 1040), then the scales.
    acc = x_q.float() @ w_q.float().t()
    y = acc * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def w4a16_reference(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    q, zeros = unpack_int4(qweight, qzeros, format)
    w = dequantize_int4(q, zeros, scales, group_size)  # [K, N] fp32
    y = x.float().reshape(-1, x.shape[-1]) @ w
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], w.shape[1]).to(x.dtype)


def fp8_blockwise(x_q, w_q, x_scale, w_scale) -> bool:
    """True when the scales are DeepSeek-V3 block scales (see the module docstring). Where a
    shape fits both readings (K <= 128: [M, 1]) the two readings compute the same thing."""
    (m, k), n = x_q.shape, w_q.shape[0]
    kg, ng = -(-k // FP8_BLOCK), -(-n // FP8_BLOCK)
    return (x_scale.dim() == 2 and w_scale.dim() == 2 and tuple(x_scale.shape) == (m, kg)
            and tuple(w_scale.shape) == (ng, kg))


def fp8_reference(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    if fp8_blockwise(x_q, w_q, x_scale, w_scale):
        x = dequantize_fp8(x_q, x_scale, (1, FP8_BLOCK))
        w = dequantize_fp8(w_q, w_scale, (FP8_BLOCK, FP8_BLOCK))
    else:
        x = x_q.float() * x_scale.float().reshape(-1, 1)
        w = w_q.float() * w_scale.float().reshape(-1, 1)
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
