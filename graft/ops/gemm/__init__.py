"""GEMM ops: dense linear with a fused epilogue, W8A8 int8, W4A16 GPTQ/AWQ, and FP8.

* ``gemm.linear(x, weight, bias=None, activation="none")``:
  ``act(x @ weight.T + bias)`` for ``x [..., K]``, ``weight [N, K]`` (the framework
  linear layout), ``bias [N]``; fp16/bf16/fp32 with fp32 accumulation, output in x's
  dtype. ``activation`` is one of :data:`ACTIVATIONS` (``"gelu"`` is the tanh
  approximation, ``"gelu_erf"`` the exact one).
* ``gemm.w8a8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.float16)``:
  ``(x_q @ w_q.T) * x_scale * w_scale + bias`` for int8 ``x_q [M, K]``, ``w_q [N, K]``,
  exact int32 accumulation, fp32 scales: ``x_scale`` per token (``[M]`` or ``[M, 1]``) or
  per tensor (one element), ``w_scale`` per channel (``[N]`` or ``[N, 1]``) or per tensor;
  ``bias [N]`` any float dtype; output fp16 or bf16.
* ``gemm.w4a16(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq")``:
  ``x @ W + bias`` with ``W [K, N]`` dequantized from 4-bit codes packed into int32 in
  GPTQ or AWQ layout, or graft's ``gptq_interleaved`` (GPTQ's, nibbles reordered once by
  :func:`graft.quant.interleave_gptq` for the Triton kernel; K a multiple of 128; see
  :mod:`graft.quant` for the layouts), group-wise ``scales
  [K/g, N]`` and zero points ``qzeros [K/g, N/8]`` (``None``: symmetric, zero point 8).
  ``group_size`` -1 means one group over K (per channel). ``x [..., K]`` fp16/bf16/fp32.

* ``gemm.fp8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16)``:
  ``(x_q * x_scale) @ (w_q * w_scale).T + bias`` for fp8 e4m3 ``x_q [M, K]``, ``w_q [N, K]``
  (``float8_e4m3fn``, or ``float8_e4m3fnuz`` as MI300 uses; both the same), fp32 scales
  either per tensor (one element) / per token (``[M]``, ``[M, 1]``) x per tensor / per
  channel (``[N]``, ``[N, 1]``), or DeepSeek-V3 block scales: ``x_scale [M, ceil(K/128)]``
  (per token per 128 K) with ``w_scale [ceil(N/128), ceil(K/128)]`` (per 128x128 block).
  Output bf16, fp16 or fp32; ``bias [N]`` any float dtype. Quantizers: :mod:`graft.quant`.

References compute in fp32 (dequantize, then matmul) and round once to the output dtype.
"""
from __future__ import annotations

import torch

from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import check_same_device, check_tensor
from graft.ops.gemm.reference import (ACTIVATIONS, apply_activation, fp8_blockwise, fp8_reference, linear_reference,
                                      w4a16_reference, w8a8_reference)
from graft.quant import FORMATS, FP8_BLOCK, INTERLEAVE_K, PACK_FACTOR
from graft.registry import OpSpec


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
W8A8_OUT_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_bias(op: str, bias, n: int, dtypes, device) -> None:
    if bias is None:
        return
    check_tensor(f"{op}: bias", bias, dtypes=dtypes, ndim=1, device=device)
    if bias.shape[0] != n:
        raise GraftInputError(f"{op}: bias has {bias.shape[0]} elements; expected N={n}")


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def validate_linear(x, weight, bias=None, activation="none"):
    # Fast path: the common valid call without bias in a few attribute reads (dispatch cost
    # is per call); anything else goes through the full checks below, which name the problem.
    if (bias is None and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dtype in _FLOAT_SET
            and weight.dtype == x.dtype and weight.ndim == 2 and x.ndim >= 1 and weight.shape[1] == x.shape[-1]
            and x.device == weight.device and activation in ACTIVATIONS):
        return
    check_tensor("gemm.linear: x", x, dtypes=FLOAT_DTYPES)
    check_tensor("gemm.linear: weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if x.dim() < 1:
        raise GraftInputError("gemm.linear: x must have at least one dimension [..., K]")
    check_same_device(x=x, weight=weight)
    if weight.dtype != x.dtype:
        raise GraftInputError(f"gemm.linear: weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if weight.shape[1] != x.shape[-1]:
        raise GraftInputError(
            f"gemm.linear: K mismatch: x has K={x.shape[-1]} (last dim) but weight [N, K] has K={weight.shape[1]}"
        )
    _check_bias("gemm.linear", bias, weight.shape[0], (x.dtype,), x.device)
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise GraftInputError(f"gemm.linear: unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")


def _check_scale(op: str, name: str, scale, rows: int, what: str, device) -> None:
    check_tensor(f"{op}: {name}", scale, dtypes=(torch.float32,), device=device)
    shape = tuple(scale.shape)
    if scale.numel() == 1 or shape in ((rows,), (rows, 1)):
        return
    raise GraftInputError(
        f"{op}: {name} has shape {shape}; expected [{rows}] or [{rows}, 1] ({what}) or a single element (per tensor)"
    )


def validate_w8a8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.float16):
    op = "gemm.w8a8"
    check_tensor(f"{op}: x_q", x_q, dtypes=(torch.int8,), ndim=2)
    check_tensor(f"{op}: w_q", w_q, dtypes=(torch.int8,), ndim=2)
    check_same_device(x_q=x_q, w_q=w_q)
    if w_q.shape[1] != x_q.shape[1]:
        raise GraftInputError(f"{op}: K mismatch: x_q [M, K] has K={x_q.shape[1]} but w_q [N, K] has K={w_q.shape[1]}")
    m, n = x_q.shape[0], w_q.shape[0]
    _check_scale(op, "x_scale", x_scale, m, "per token", x_q.device)
    _check_scale(op, "w_scale", w_scale, n, "per channel", x_q.device)
    _check_bias(op, bias, n, FLOAT_DTYPES, x_q.device)
    if out_dtype not in W8A8_OUT_DTYPES:
        raise GraftInputError(f"{op}: out_dtype {out_dtype} not supported; expected torch.float16 or torch.bfloat16")


def validate_fp8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    op = "gemm.fp8"
    check_tensor(f"{op}: x_q", x_q, dtypes=FP8_DTYPES, ndim=2)
    check_tensor(f"{op}: w_q", w_q, dtypes=FP8_DTYPES, ndim=2)
    check_same_device(x_q=x_q, w_q=w_q)
    if w_q.dtype != x_q.dtype:
        raise GraftInputError(f"{op}: w_q dtype {w_q.dtype} must match x_q dtype {x_q.dtype}")
    (m, k), n = x_q.shape, w_q.shape[0]
    if w_q.shape[1] != k:
        raise GraftInputError(f"{op}: K mismatch: x_q [M, K] has K={k} but w_q [N, K] has K={w_q.shape[1]}")
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
        check_tensor(f"{op}: {name}", scale, dtypes=(torch.float32,), device=x_q.device)
    kg, ng = -(-k // FP8_BLOCK), -(-n // FP8_BLOCK)
    if not fp8_blockwise(x_q, w_q, x_scale, w_scale):
        x_block = x_scale.dim() == 2 and tuple(x_scale.shape) == (m, kg) and kg > 1
        w_block = w_scale.dim() == 2 and tuple(w_scale.shape) == (ng, kg) and kg > 1
        if x_block or w_block:
            raise GraftInputError(
                f"{op}: block scales need both x_scale [M, ceil(K/128)] = [{m}, {kg}] and w_scale "
                f"[ceil(N/128), ceil(K/128)] = [{ng}, {kg}]; got {tuple(x_scale.shape)} and {tuple(w_scale.shape)}"
            )
        _check_scale(op, "x_scale", x_scale, m, f"per token; or [{m}, {kg}] per 128-group with block w_scale", x_q.device)
        _check_scale(op, "w_scale", w_scale, n, f"per channel; or [{ng}, {kg}] per 128x128 block", x_q.device)
    _check_bias(op, bias, n, FLOAT_DTYPES, x_q.device)
    if out_dtype not in FP8_OUT_DTYPES:
        raise GraftInputError(f"{op}: out_dtype {out_dtype} not supported; expected torch.bfloat16, float16 or float32")


def w4a16_dims(x, qweight, format):
    """``(K, N)`` of a W4A16 problem, from x and the packed weight's layout."""
    k = x.shape[-1]
    n = qweight.shape[1] if format in ("gptq", "gptq_interleaved") else qweight.shape[1] * PACK_FACTOR
    return k, n


def validate_w4a16(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    op = "gemm.w4a16"
    check_tensor(f"{op}: x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise GraftInputError(f"{op}: x must have at least one dimension [..., K]")
    if format not in FORMATS:
        raise GraftInputError(f"{op}: unknown format {format!r}; expected one of {', '.join(FORMATS)}")
    check_tensor(f"{op}: qweight", qweight, dtypes=(torch.int32,), ndim=2)
    check_same_device(x=x, qweight=qweight)
    k = x.shape[-1]
    if format == "gptq_interleaved" and k % INTERLEAVE_K:
        raise GraftInputError(f"{op}: the gptq_interleaved layout reorders K in blocks of {INTERLEAVE_K} rows, so K "
                              f"must be a multiple of {INTERLEAVE_K}; got K={k}")
    if format in ("gptq", "gptq_interleaved"):
        if k % PACK_FACTOR:
            raise GraftInputError(f"{op}: GPTQ packs K along int32 rows, so K must be a multiple of 8; got K={k}")
        if qweight.shape[0] * PACK_FACTOR != k:
            raise GraftInputError(
                f"{op}: K mismatch: x has K={k} but GPTQ qweight [K/8, N] has {qweight.shape[0]} rows (K={qweight.shape[0] * 8})"
            )
    elif qweight.shape[0] != k:
        raise GraftInputError(f"{op}: K mismatch: x has K={k} but AWQ qweight [K, N/8] has {qweight.shape[0]} rows")
    _, n = w4a16_dims(x, qweight, format)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise GraftInputError(f"{op}: group_size must be an int, got {group_size!r}")
    if group_size != -1 and (group_size <= 0 or k % group_size):
        raise GraftInputError(f"{op}: group_size {group_size} must be -1 (per channel) or a positive divisor of K={k}")
    groups = 1 if group_size == -1 else k // group_size
    check_tensor(f"{op}: scales", scales, dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(x=x, scales=scales)
    if tuple(scales.shape) != (groups, n):
        raise GraftInputError(f"{op}: scales has shape {tuple(scales.shape)}; expected [K/group_size, N] = [{groups}, {n}]")
    if qzeros is not None:
        check_tensor(f"{op}: qzeros", qzeros, dtypes=(torch.int32,), ndim=2)
        check_same_device(x=x, qzeros=qzeros)
        if n % PACK_FACTOR:
            raise GraftInputError(f"{op}: qzeros pack N along int32 columns, so N must be a multiple of 8; got N={n}")
        if tuple(qzeros.shape) != (groups, n // PACK_FACTOR):
            raise GraftInputError(
                f"{op}: qzeros has shape {tuple(qzeros.shape)}; expected [K/group_size, N/8] = [{groups}, {n // PACK_FACTOR}]"
            )
    _check_bias(op, bias, n, (x.dtype,), x.device)


OPS = [
    OpSpec(
        name="gemm.linear",
        family="gemm",
        signature="linear(x[..., K], weight[N, K], bias[N]=None, activation='none') -> y[..., N]",
        reference=linear_reference,
        description="act(x @ weight.T + bias), fp32 accumulation, activation fused in the epilogue",
        validate=validate_linear,
        validate_cache="always",  # metadata only
        dtypes=FLOAT_DTYPES,
        grad_inputs=(0, 1, 2),
    ),
    OpSpec(
        name="gemm.w8a8",
        family="gemm",
        signature="w8a8(x_q[M, K] int8, w_q[N, K] int8, x_scale[M]|[M,1]|[1], w_scale[N]|[1], bias[N]=None, "
        "out_dtype=float16) -> y[M, N]",
        reference=w8a8_reference,
        description="int8 x int8 -> int32, per-token x per-channel (or per-tensor) fp32 scales, optional bias",
        validate=validate_w8a8,
        validate_cache="always",  # metadata only
        dtypes=(torch.int8,),
    ),
    OpSpec(
        name="gemm.w4a16",
        family="gemm",
        signature="w4a16(x[..., K], qweight int32, scales[K/g, N], qzeros[K/g, N/8]=None, bias[N]=None, "
        "group_size=128, format='gptq'|'awq'|'gptq_interleaved') -> y[..., N]",
        reference=w4a16_reference,
        description="4-bit GPTQ/AWQ weights dequantized group-wise, fp16/bf16 activations",
        validate=validate_w4a16,
        validate_cache="always",  # metadata only
        dtypes=FLOAT_DTYPES,
    ),
    OpSpec(
        name="gemm.fp8",
        family="gemm",
        signature="fp8(x_q[M, K] fp8e4m3, w_q[N, K] fp8e4m3, x_scale[1]|[M]|[M, K/128], w_scale[1]|[N]|[N/128, K/128], "
        "bias[N]=None, out_dtype=bfloat16) -> y[M, N]",
        reference=fp8_reference,
        description="fp8 e4m3 GEMM, fp32 accumulation, per-tensor/row or DeepSeek-V3 128x128 block scales",
        validate=validate_fp8,
        validate_cache="always",  # metadata only
        dtypes=FP8_DTYPES,
    ),
]


def linear(x, weight, bias=None, activation="none"):
    """``act(x @ weight.T + bias)``; see the module docstring."""
    return call("gemm.linear", x, weight, bias, activation)


def w8a8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.float16):
    """``(x_q @ w_q.T) * x_scale * w_scale + bias`` in ``out_dtype``; see the module docstring."""
    return call("gemm.w8a8", x_q, w_q, x_scale, w_scale, bias, out_dtype)


def w4a16(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    """``x @ dequant(qweight) + bias`` for GPTQ/AWQ int4 weights; see the module docstring."""
    return call("gemm.w4a16", x, qweight, scales, qzeros, bias, group_size, format)


def fp8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    """``(x_q * x_scale) @ (w_q * w_scale).T + bias`` in ``out_dtype``; see the module docstring."""
    return call("gemm.fp8", x_q, w_q, x_scale, w_scale, bias, out_dtype)


# The conformance cases, re-exported here (imported last: a cases module may use this module's names).
from graft.ops.gemm.cases import CASES
