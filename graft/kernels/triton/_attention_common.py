"""Pieces shared by the attention kernels: softmax constants, head-dim limits, scale.

The dot precision policy is graft.kernels.triton._dot's, as for every kernel family."""
from __future__ import annotations

import math

import triton
import triton.language as tl

# Scores are kept in the log2 domain (exp2 is the native instruction): s * scale * log2(e).
LOG2E = 1.4426950408889634

# Finite "minus infinity" for running maxima: a fully masked tile then gives exp2(-inf - m) = 0
# instead of exp2(-inf - (-inf)) = NaN, so rows that see no key end with sum 0 and output 0.
NEG_BIG = tl.constexpr(-1.0e30)  # constexpr: compiled kernels may only read constexpr globals

MAX_HEAD_DIM = 256


@triton.jit
def seq_bounds(cu_seqlens, seq, total):
    """(start, length) of sequence ``seq`` of a cu_seqlens tensor, clamped to the packed
    tensor's ``total`` rows: cu_seqlens that are out of range or decreasing (value checks off)
    can never make a kernel read or write outside it (the reference clamps the same way)."""
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    end = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return start, end - start


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded (and masked) to a power of two, at least 16 for tl.dot."""
    return max(16, triton.next_power_of_2(head_dim))


def head_dim_reason(head_dim: int) -> str | None:
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} not supported (1..{MAX_HEAD_DIM}, padded to a power of two)"
    return None


def resolve_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
