"""Pieces shared by the attention kernels: the fp32-accumulating dot and launch flags."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graft.platform import triton_interpret

# Scores are kept in the log2 domain (exp2 is the native instruction): s * scale * log2(e).
LOG2E = 1.4426950408889634

# Finite "minus infinity" for running maxima: a fully masked tile then gives exp2(-inf - m) = 0
# instead of exp2(-inf - (-inf)) = NaN, so rows that see no key end with sum 0 and output 0.
NEG_BIG = tl.constexpr(-1.0e30)  # constexpr: compiled kernels may only read constexpr globals

MAX_HEAD_DIM = 256


@triton.jit
def dot_f32(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b accumulated in fp32.

    UPCAST: Triton's CPU interpreter returns garbage for tl.dot on bf16 operands (fp16 and
    fp32 are exact there), so interpreted bf16 runs upcast to fp32 first; compiled GPU
    runs keep the native bf16 tensor-core dot. PRECISION: "ieee" for fp32 inputs so they
    match an fp32 reference, "tf32"/default otherwise.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32)


def dot_flags(dtype: torch.dtype) -> dict:
    """Constexpr flags for dot_f32 on inputs of ``dtype``."""
    return {
        "UPCAST": bool(triton_interpret() and dtype == torch.bfloat16),
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded (and masked) to a power of two, at least 16 for tl.dot."""
    return max(16, triton.next_power_of_2(head_dim))


def head_dim_reason(head_dim: int) -> str | None:
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} not supported (1..{MAX_HEAD_DIM}, padded to a power of two)"
    return None


def resolve_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
