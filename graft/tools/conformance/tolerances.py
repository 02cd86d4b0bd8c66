"""How close an implementation must be to the torch reference, per output dtype.

An element passes when ``|got - expected| <= atol * scale + rtol * |expected|`` where
``scale`` is the RMS of the expected tensor for float outputs (1 for integer outputs). Measuring ``atol`` against the output's
RMS instead of in absolute units keeps the bound meaningful for any input scale and
absorbs cancellation: an element that sums to nearly zero carries the rounding error
of its large terms, which a purely element-relative bound would flag.

Why these numbers (``eps`` = unit roundoff of the output dtype):

* float32 — kernels and the reference both accumulate in fp32 but in different orders;
  reordering a length-K sum moves it by about ``eps32 * sqrt(K)`` of its magnitude
  (random-walk rounding), i.e. ~1e-5 relative at the reduction lengths of the quick cases.
  On CUDA, Triton's ``tl.dot`` runs fp32 inputs as TF32 (10-bit mantissa) unless a kernel
  asks for IEEE, so fp32 on a GPU gets the fp16-like TF32 bound.
* float16 — ``eps = 2**-11``; both sides round the output once (and attention-like kernels
  round an fp16 intermediate), so 2 ulps (~2e-3) plus a little accumulation growth.
* bfloat16 — ``eps = 2**-8``; same argument as fp16 with 8 bits of mantissa: ~1.6e-2.
* int8 outputs (quantize / requantize) — one quantization step: round-half-even versus
  round-half-away and fp32 scale arithmetic in a different order can move a value that sits
  on a rounding boundary to the neighbouring integer; anything beyond that is a bug.
* int8 / int4 *weights* (W8A8, W4A16 GEMMs) — the reference dequantizes the very same
  integers, and int8 x int8 products accumulate exactly in int32, so what is left is the float
  epilogue and the output rounding: the bound of the output's float dtype applies unchanged.
  int4 values never appear as outputs (they are packed two per byte in int8/uint8 tensors),
  so there is no separate int4 output rule; packed tensors are compared exactly.
* other integer and bool outputs (indices, counts, token maps) — exact.

Accumulation length: bounds grow with ``sqrt(K / 256)`` once a case's reduction (the
OpCase ``reduction`` callable, e.g. a GEMM's K) is longer than 256 terms — below that the
base bound already covers it. Cases may override ``atol``/``rtol`` for one op
(``OpCase.atol`` / ``OpCase.rtol``, a float or a ``{dtype: float}`` dict).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graft.platform import dtype_name

_GROWTH_START = 256  # reduction length the base bounds already cover


@dataclass(frozen=True)
class Tolerance:
    atol: float  # times the RMS of the expected output
    rtol: float  # times |expected| element-wise
    rule: str  # which rule produced it, for messages and the report
    # Integer outputs count in quantization steps: their atol is absolute, not RMS-relative.
    atol_is_absolute: bool = False

    def as_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "rule": self.rule, "atol_is_absolute": self.atol_is_absolute}


# dtype -> (atol, rtol, why). Float entries are the base bounds before accumulation growth.
_FLOAT_BASE = {
    torch.float32: (1e-5, 1e-5, "fp32: reordered fp32 accumulation (~eps32*sqrt(K))"),
    torch.float16: (2e-3, 2e-3, "fp16: 2 ulps of output rounding (eps=2^-11)"),
    torch.bfloat16: (1.6e-2, 1.6e-2, "bf16: 2 ulps of output rounding (eps=2^-8)"),
    torch.float64: (1e-10, 1e-10, "fp64: reordered fp64 accumulation"),
}
_TF32 = (2e-3, 2e-3, "fp32 on cuda: TF32 tensor-core dot (10-bit mantissa)")
_INT8 = (1.0, 0.0, "int8: one quantization step (rounding-mode ties)")



def accumulation_growth(reduction_len: int | None) -> float:
    """Factor the float bounds grow by for a length-``reduction_len`` sum (>= 1)."""
    if not reduction_len or reduction_len <= _GROWTH_START:
        return 1.0
    return math.sqrt(reduction_len / _GROWTH_START)


def _override(value, dtype):
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get(dtype)
    return float(value)


def tolerance_for(
    out_dtype: torch.dtype,
    *,
    reduction_len: int | None = None,
    device_type: str = "cpu",
    atol=None,
    rtol=None,
    compute_dtype: torch.dtype | None = None,
) -> Tolerance:
    """The bound for one output tensor of dtype ``out_dtype``.

    ``compute_dtype`` is the case's dtype: an fp32 output of an fp16 case (e.g. an fp32
    logsumexp next to an fp16 attention output) is held to the fp16 bound, since its
    inputs were only fp16-accurate. ``atol``/``rtol`` are the case's overrides.
    """
    if out_dtype.is_floating_point:
        key = out_dtype
        if compute_dtype is not None and compute_dtype.is_floating_point and compute_dtype in _FLOAT_BASE:
            # the looser of the output's and the inputs' precision
            if _FLOAT_BASE[compute_dtype][0] > _FLOAT_BASE.get(out_dtype, (0,))[0]:
                key = compute_dtype
        if key == torch.float32 and device_type == "cuda":
            base_atol, base_rtol, rule = _TF32
        else:
            base_atol, base_rtol, rule = _FLOAT_BASE.get(key, _FLOAT_BASE[torch.float32])
        growth = accumulation_growth(reduction_len)
        if growth > 1.0:
            rule += f", x{growth:.2f} for a {reduction_len}-term reduction"
        a, r = base_atol * growth, base_rtol * growth
    elif out_dtype == torch.int8:
        a, r, rule = _INT8
    else:
        a, r, rule = 0.0, 0.0, f"{dtype_name(out_dtype)}: exact"
    oa, orr = _override(atol, compute_dtype or out_dtype), _override(rtol, compute_dtype or out_dtype)
    if oa is not None or orr is not None:
        a = a if oa is None else oa
        r = r if orr is None else orr
        rule += " (case override)"
    return Tolerance(atol=a, rtol=r, rule=rule, atol_is_absolute=not out_dtype.is_floating_point)


# --------------------------------------------------------------------------- gradients
#
# Gradient checks (``graft conformance --grad``) compare each input's gradient from an
# implementation's registered backward with the gradient torch autograd takes through the
# op's reference, for the same output cotangent. Bounds, again RMS-relative:
#
# * The backward is a second chain of reductions on top of the forward's: attention's dq sums
#   over keys, dk/dv over queries (and over the query heads of a GQA group), a weight gradient
#   over every row of the batch. The accumulation-growth rule applies with the longest of them
#   (``reduction_len``: the case's own reduction or the number of rows reduced, whichever is
#   longer).
# * fp16/bf16: the reference differentiates in fp32 and rounds each gradient once; a Triton
#   backward (like flash-attention's and every fused-kernel backward) rounds intermediates that
#   become GEMM operands to the input dtype (attention's P and dS, the activation gradient
#   before dx/dw, the MoE gate/up gradient), one extra rounding propagated through a GEMM:
#   twice the forward's output-rounding bound, the same argument as MoE's forward.
# * fp32: reordered fp32 accumulation only, so twice the forward bound covers the two chains.
# * attention.prefill in fp16/bf16: two rounded operands, not one (P before dV = P^T dO, and
#   dS = P * (dP - delta) before dQ = dS K and dK = dS^T Q), and dS cancels by construction
#   (each row of dS sums to zero), so dQ/dK are differences of terms much larger than
#   themselves and the rounding of those terms shows up relative to the result. Twice the
#   generic gradient bound. (flash-attention's own tests allow twice the error of a same-dtype
#   PyTorch implementation; here the reference computes in fp32, so the bound is stated
#   against the output-rounding unit instead.) fp32 keeps the generic bound: measured errors
#   there are ~1e-7 relative, so a real backward bug cannot hide behind this factor.
_GRAD_FACTOR = 2.0
_GRAD_OP_FACTOR = {"attention.prefill": {torch.float16: 4.0, torch.bfloat16: 4.0}}


def grad_tolerance_for(grad_dtype: torch.dtype, *, reduction_len: int | None = None, device_type: str = "cpu",
                       compute_dtype: torch.dtype | None = None, op: str | None = None) -> Tolerance:
    """The bound for one input's gradient of ``op`` (see the reasoning above)."""
    base = tolerance_for(grad_dtype, reduction_len=reduction_len, device_type=device_type,
                         compute_dtype=compute_dtype)
    factor = _GRAD_OP_FACTOR.get(op or "", {}).get(compute_dtype or grad_dtype, _GRAD_FACTOR)
    return Tolerance(atol=base.atol * factor, rtol=base.rtol * factor,
                     rule=f"gradient: {factor:g}x ({base.rule})", atol_is_absolute=base.atol_is_absolute)
