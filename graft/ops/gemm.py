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

import math

import torch

from graft.cases import OpCase
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import acc, check_same_device, check_tensor
from graft.quant import FORMATS, FP8_BLOCK, INTERLEAVE_K, PACK_FACTOR, dequantize_fp8, dequantize_int4, unpack_int4
from graft.registry import OpSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
W8A8_OUT_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = ("none", "relu", "gelu", "gelu_erf", "silu")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- references


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


# --------------------------------------------------------------------------- validation


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


# --------------------------------------------------------------------------- ops and entry points

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


# --------------------------------------------------------------------------- cases


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _linear_inputs(lead, n, k, bias, activation):
    def make(device, dtype, gen):
        x = _randn(gen, *lead, k).to(device, dtype)
        w = _randn(gen, n, k, scale=1.0 / math.sqrt(k)).to(device, dtype)
        b = _randn(gen, n).to(device, dtype) if bias else None
        return (x, w, b, activation), {}

    return make


def _w8a8_inputs(m, n, k, per_tensor, bias):
    def make(device, out_dtype, gen):
        x_q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        # Scales sized so the output is O(1): uniform int8 codes have std ~73, so x_q * xs
        # is ~unit and w_q * ws ~1/sqrt(K).
        xs0, ws0 = 1.0 / 73.0, 1.0 / (73.0 * math.sqrt(k))
        if per_tensor:
            xs, ws = torch.tensor(xs0), torch.tensor(ws0)
        else:
            xs = (torch.rand(m, 1, generator=gen) + 0.5) * xs0
            ws = (torch.rand(n, generator=gen) + 0.5) * ws0
        b = _randn(gen, n).to(out_dtype) if bias else None
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return (to(x_q), to(w_q), to(xs.float()), to(ws.float()), to(b), out_dtype), {}

    return make


def _w4a16_inputs(lead, n, k, group_size, fmt, zeros=True, bias=False):
    from graft.quant import pack_int4

    def make(device, dtype, gen):
        g = k if group_size == -1 else group_size
        q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        z = torch.randint(1, 16, (k // g, n), generator=gen, dtype=torch.int32) if zeros else None
        qweight, qzeros = pack_int4(q, z, fmt)
        scales = (torch.rand(k // g, n, generator=gen) + 0.5) / (4.0 * math.sqrt(k))
        x = _randn(gen, *lead, k)
        b = _randn(gen, n).to(device, dtype) if bias else None
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return (x.to(device, dtype), to(qweight), scales.to(device, dtype), to(qzeros), b, group_size, fmt), {}

    return make


def _fp8_inputs(m, n, k, scales, bias):
    from graft.quant import quantize_fp8_block, quantize_fp8_per_tensor, quantize_fp8_per_token_group

    def make(device, out_dtype, gen):
        x = _randn(gen, m, k)
        w = _randn(gen, n, k, scale=1.0 / math.sqrt(k))
        if scales == "block":
            (x_q, xs), (w_q, ws) = quantize_fp8_per_token_group(x), quantize_fp8_block(w)
        elif scales == "tensor":
            (x_q, xs), (w_q, ws) = quantize_fp8_per_tensor(x), quantize_fp8_per_tensor(w)
        else:  # per token x per channel
            whole_row = max(k, 1)  # one group spanning K: one scale per row
            (x_q, xs), (w_q, ws) = quantize_fp8_per_token_group(x, whole_row), quantize_fp8_per_token_group(w, whole_row)
        b = _randn(gen, n).to(out_dtype) if bias else None
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return (to(x_q), to(w_q), to(xs.float()), to(ws.float()), to(b), out_dtype), {}

    return make


def _reduction_k(args, kwargs):
    return args[0].shape[-1]


def _flops_linear(args, kwargs):
    x, w = args[0], args[1]
    return 2.0 * x.numel() * w.shape[0]


def _flops_w8a8(args, kwargs):
    x_q, w_q = args[0], args[1]
    return 2.0 * x_q.shape[0] * x_q.shape[1] * w_q.shape[0]


def _flops_fp8(args, kwargs):
    return _flops_w8a8(args, kwargs)


def _flops_w4a16(args, kwargs):
    x, qweight, fmt = args[0], args[1], args[6]
    _, n = w4a16_dims(x, qweight, fmt)
    return 2.0 * x.numel() * n


_QUICK = frozenset({"quick"})
_GPU = frozenset({"gpu"})
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _case(op, name, make, dtypes, tags, flops):
    return OpCase(op, name, make, dtypes, tags, flops=flops, reduction=_reduction_k)


def _lead_name(lead):
    return "x".join(map(str, lead))


def _cases():
    cases = []
    for lead, n, k, bias, act in [
        ((1,), 7, 16, False, "none"),
        ((3,), 48, 33, True, "relu"),
        ((17,), 129, 128, True, "gelu"),
        ((64,), 48, 96, False, "gelu_erf"),
        ((2, 5), 33, 64, True, "silu"),
    ]:
        name = f"m{_lead_name(lead)}_n{n}_k{k}{'_bias' if bias else ''}_{act}"
        make = _linear_inputs(lead, n, k, bias, act)
        cases.append(_case("gemm.linear", name, make, FLOAT_DTYPES, _QUICK, _flops_linear))
    for m, n, k, act in [(4096, 4096, 4096, "none"), (16, 4096, 4096, "none"), (2048, 11008, 4096, "silu")]:
        make = _linear_inputs((m,), n, k, False, act)
        cases.append(_case("gemm.linear", f"m{m}_n{n}_k{k}_{act}", make, _HALF_DTYPES, _GPU, _flops_linear))
    for m, n, k, per_tensor, bias in [(1, 7, 16, False, False), (17, 48, 33, True, True), (64, 129, 128, False, True)]:
        name = f"m{m}_n{n}_k{k}_{'per_tensor' if per_tensor else 'per_token'}{'_bias' if bias else ''}"
        make = _w8a8_inputs(m, n, k, per_tensor, bias)
        cases.append(_case("gemm.w8a8", name, make, W8A8_OUT_DTYPES, _QUICK, _flops_w8a8))
    for m, n, k in [(4096, 4096, 4096), (16, 4096, 4096)]:
        make = _w8a8_inputs(m, n, k, False, False)
        cases.append(_case("gemm.w8a8", f"m{m}_n{n}_k{k}_per_token", make, W8A8_OUT_DTYPES, _GPU, _flops_w8a8))
    for fmt in FORMATS:
        # gptq_interleaved needs K in blocks of 128; its group of 32 takes 2 MMA slices per step
        ks = (128, 128, 128, 256) if fmt == "gptq_interleaved" else (32, 64, 128, 256)
        for (lead, n, g, zeros, bias), k in zip([
            ((1,), 8, 32, True, False),
            ((3,), 24, -1, True, True),
            ((17,), 136, 64, False, False),
            ((2, 3), 16, 128, True, False),
        ], ks):
            name = f"{fmt}_m{_lead_name(lead)}_n{n}_k{k}_g{g}{'' if zeros else '_sym'}{'_bias' if bias else ''}"
            make = _w4a16_inputs(lead, n, k, g, fmt, zeros, bias)
            cases.append(_case("gemm.w4a16", name, make, _HALF_DTYPES, _QUICK, _flops_w4a16))
        for m, n, k in [(16, 4096, 4096), (4096, 4096, 4096)]:
            make = _w4a16_inputs((m,), n, k, 128, fmt)
            cases.append(_case("gemm.w4a16", f"{fmt}_m{m}_n{n}_k{k}_g128", make, _HALF_DTYPES, _GPU, _flops_w4a16))
    for m, n, k, scales, bias in [(1, 7, 16, "tensor", False), (17, 48, 33, "row", True), (5, 130, 300, "block", False),
                                  (64, 129, 128, "block", True)]:
        make = _fp8_inputs(m, n, k, scales, bias)
        cases.append(_case("gemm.fp8", f"m{m}_n{n}_k{k}_{scales}{'_bias' if bias else ''}", make, _HALF_DTYPES, _QUICK,
                           _flops_fp8))
    for m, n, k in [(16, 4096, 4096), (4096, 4096, 4096)]:
        make = _fp8_inputs(m, n, k, "block", False)
        cases.append(_case("gemm.fp8", f"m{m}_n{n}_k{k}_block", make, _HALF_DTYPES, _GPU, _flops_fp8))
    return cases


CASES = _cases()
