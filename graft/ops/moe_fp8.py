"""FP8 block-scaled mixture of experts (DeepSeek-V3 style): ``moe.fused_experts_fp8``.

``fused_experts_fp8(hidden [T, H], w13_q [E, 2I, H], w2_q [E, H, I], w13_scale, w2_scale,
topk_weights [T, k], topk_ids int32 [T, k], activation="silu")``
    The MoE of :func:`graft.ops.moe.fused_experts` with fp8 e4m3 expert weights
    (``float8_e4m3fn``, or ``float8_e4m3fnuz`` on MI300) and fp32 scales per 128x128 block:
    ``w13_scale [E, ceil(2I/128), ceil(H/128)]``, ``w2_scale [E, ceil(H/128), ceil(I/128)]``
    (:func:`graft.quant.quantize_fp8_block` makes both). Activations are quantized to the
    weights' fp8 format per token per 128 features, as DeepSeek-V3 runs: ``hidden`` before
    GEMM 1, and the SiLU-and-mul output, rounded to hidden's dtype, before GEMM 2
    (:func:`graft.quant.quantize_fp8_per_token_group`). ``hidden`` is fp16/bf16/fp32; the
    result [T, H] has its dtype. Kept a separate op (not a flag of ``moe.fused_experts``) so
    that op's signature and every backend of it stay as they are.

The reference dequantizes those very fp8 values and computes in fp32, so an
implementation differs from it by accumulation order and roundings only.
"""
from __future__ import annotations

import torch

from graft.cases import OpCase
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import check_tensor
from graft.ops.moe import FLOAT_DTYPES, make_moe_inputs, validate_fused_experts
from graft.registry import OpSpec
from graft.quant import FP8_BLOCK, dequantize_fp8, quantize_fp8_block, quantize_fp8_per_token_group

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def validate_fused_experts_fp8(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    op = "moe.fused_experts_fp8"
    check_tensor(f"{op}: w13_q", w13_q, dtypes=FP8_DTYPES, ndim=3)
    check_tensor(f"{op}: w2_q", w2_q, dtypes=FP8_DTYPES, ndim=3)
    if w2_q.dtype != w13_q.dtype:
        raise GraftInputError(f"{op}: w2_q dtype {w2_q.dtype} must match w13_q dtype {w13_q.dtype}")
    check_tensor(f"{op}: hidden", hidden, dtypes=FLOAT_DTYPES, ndim=2)
    # Shapes, routing tensors and devices: the bf16 op's checks, on zero-memory stand-ins
    # of the weights' shapes in hidden's dtype.
    def stand_in(w):
        return torch.empty((), device=w.device, dtype=hidden.dtype).expand(w.shape)

    try:
        validate_fused_experts(hidden, stand_in(w13_q), stand_in(w2_q), topk_weights, topk_ids, activation)
    except GraftInputError as exc:
        raise GraftInputError(str(exc).replace("moe.fused_experts:", f"{op}:").replace("w13 ", "w13_q ")
                              .replace("w2 ", "w2_q ")) from None
    e, two_i, h = w13_q.shape
    inter = two_i // 2
    for name, scale, shape in (("w13_scale", w13_scale, (e, _blocks(two_i), _blocks(h))),
                               ("w2_scale", w2_scale, (e, _blocks(h), _blocks(inter)))):
        check_tensor(f"{op}: {name}", scale, dtypes=(torch.float32,), ndim=3, device=hidden.device)
        if tuple(scale.shape) != shape:
            raise GraftInputError(f"{op}: {name} has shape {tuple(scale.shape)}; expected one scale per 128x128 "
                                  f"block: {list(shape)}")


def quantize_act(x: torch.Tensor, fp8_dtype) -> tuple:
    """Per token per 128 features, as both GEMMs' activations are quantized."""
    return quantize_fp8_per_token_group(x, FP8_BLOCK, fp8_dtype)


def fused_experts_fp8_reference(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    num_tokens, hidden_size = hidden.shape
    inter = w13_q.shape[1] // 2
    fmt = w13_q.dtype
    x = dequantize_fp8(*quantize_act(hidden, fmt), (1, FP8_BLOCK))
    w13 = dequantize_fp8(w13_q, w13_scale, (FP8_BLOCK, FP8_BLOCK))
    w2 = dequantize_fp8(w2_q, w2_scale, (FP8_BLOCK, FP8_BLOCK))
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    weights, ids = topk_weights.float(), topk_ids.long()
    for expert in range(w13_q.shape[0]):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[expert].t()
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        act = dequantize_fp8(*quantize_act(act, fmt), (1, FP8_BLOCK))
        out.index_add_(0, tokens, (act @ w2[expert].t()) * weights[tokens, slots].unsqueeze(1))
    return out.to(hidden.dtype)


def fused_experts_fp8(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    """fp8 block-scaled expert MLPs; see the module docstring."""
    return call("moe.fused_experts_fp8", hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation)


def quantize_experts(w13, w2, fp8_dtype=torch.float8_e4m3fn):
    """bf16/fp32 expert weights -> ``(w13_q, w2_q, w13_scale, w2_scale)`` with 128x128 block scales."""
    (w13_q, w13_s), (w2_q, w2_s) = quantize_fp8_block(w13, dtype=fp8_dtype), quantize_fp8_block(w2, dtype=fp8_dtype)
    return w13_q, w2_q, w13_s, w2_s


OPS = [
    OpSpec(
        name="moe.fused_experts_fp8",
        family="moe",
        signature="(hidden[T,H], w13_q fp8[E,2I,H], w2_q fp8[E,H,I], w13_scale[E,2I/128,H/128], "
        "w2_scale[E,H/128,I/128], topk_weights[T,k], topk_ids int32[T,k], activation:str='silu') -> [T,H]",
        reference=fused_experts_fp8_reference,
        description="DeepSeek-V3-style fp8 experts: 128x128 block-scaled weights, per-token-group fp8 activations",
        validate=validate_fused_experts_fp8,
    ),
]


def _fp8_case(num_tokens, num_experts, top_k, hidden_size, inter, tags=("quick",)):
    def make(device, dtype, gen):
        (hidden, w13, w2, weights, ids), _ = make_moe_inputs(num_tokens, num_experts, top_k, hidden_size, inter,
                                                             "cpu", torch.float32, gen)
        w13_q, w2_q, w13_s, w2_s = quantize_experts(w13, w2)
        to = lambda t: t.to(device)  # noqa: E731
        return (hidden.to(device, dtype), to(w13_q), to(w2_q), to(w13_s), to(w2_s), to(weights), to(ids)), {}

    def flops(args, kwargs):
        hidden, w13_q, ids = args[0], args[1], args[6]
        return 6.0 * hidden.shape[0] * ids.shape[1] * hidden.shape[1] * (w13_q.shape[1] // 2)

    name = f"t{num_tokens}_e{num_experts}_k{top_k}_h{hidden_size}_i{inter}"
    # The act is rounded to hidden's dtype, then re-quantized to fp8 per 128-group: where the
    # kernel's and the reference's sums round to neighbouring values, a group's scale and codes
    # can move by one fp8 step (6%): for bf16, where that happens most, a few fp8 steps.
    return OpCase("moe.fused_experts_fp8", name, make, dtypes=(torch.float16, torch.bfloat16), tags=frozenset(tags),
                  flops=flops, atol={torch.float16: 8e-3, torch.bfloat16: 0.16},
                  reduction=lambda args, kwargs: max(args[0].shape[1], args[2].shape[2]))


CASES = [
    _fp8_case(1, 4, 1, 48, 40),
    _fp8_case(17, 8, 2, 200, 136),
    _fp8_case(0, 4, 2, 48, 40),
    _fp8_case(2048, 256, 8, 7168, 2048, tags=("gpu",)),
]
