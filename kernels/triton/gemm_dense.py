"""Triton dense linear (``gemm.linear``): ``act(x @ weight.T + bias)`` in one kernel.

Each program computes a BLOCK_M x BLOCK_N tile of y with fp32 accumulation over K,
reading ``weight [N, K]`` in place as the transposed operand (no copy), then applies
bias and activation on the fp32 accumulator before the single rounding to x's dtype.
Ragged M, N and K edges are masked (out-of-range loads read 0).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._aot import per_target, split_tiles, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._gemm_common import (
    activate,
    pick_tiles,
    tile_coords,
)
from graft.kernels.triton._dot import dot_acc, dot_flags

_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

TILES = {
    "large_m": {
        "hopper": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        "cdna3": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
        "default": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        # The interpreter runs programs one by one in numpy: few, mid-sized tiles are fastest.
        "interpreter": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 1, "num_stages": 1},
    },
    # Decode-like M (<= 16 rows): thin row tiles, wide K steps; the weight read dominates.
    "small_m": {
        "hopper": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
        "cdna3": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
        "default": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
        "interpreter": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 1, "num_stages": 1},
    },
}


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr,  # dot flags: see graft.kernels.triton._dot
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    tile_m, tile_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # int64 offsets: M * stride can pass 2^31 for large activations.
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot_acc(a, b, acc, UPCAST, PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = activate(acc, ACTIVATION)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fit_fp32(cfg: dict, dtype, device) -> dict:
    """4-byte tiles on a GPU: at most 3 stages (128x128x64 fp32 in 4 stages needs 262,144 B
    of shared memory, above the 232,448 B a Hopper block may use)."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        cfg = dict(cfg, num_stages=min(cfg["num_stages"], 3))
    return cfg


def _linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = fit_fp32(pick_tiles(TILES, m, x.device), x.dtype, x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    with on_device(x):
        _linear_kernel[grid](
            x, weight, bias if bias is not None else y, y,
            m, n, k,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
            HAS_BIAS=bias is not None,
            ACTIVATION=activation,
            **dot_flags(x.dtype, x.device),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    return y


def _linear_2d_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


linear_op = define_op("gemm_linear_triton", _linear_2d, fake=_linear_2d_fake)


def linear(x, weight, bias=None, activation="none"):
    """``gemm.linear`` on Triton: any leading dims of x are folded into M."""
    k, n = x.shape[-1], weight.shape[0]
    y = linear_op(x.reshape(math.prod(x.shape[:-1]), k), weight, bias, activation)
    return y.reshape(*x.shape[:-1], n)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "gemm.linear", linear, custom_op=linear_op, dtypes=_FLOAT_DTYPES,
        description="Triton tiled GEMM, fp32 accumulation, bias + activation fused in the epilogue",
    ))


def _aot_variants():
    """Both tile tables per target; bf16 with every activation, fp16/fp32 (TF32 and IEEE) with gelu."""
    from graft.ops.gemm import ACTIVATIONS

    for table in ("large_m", "small_m"):
        for target, cfg in per_target(TILES[table]):
            blocks, options = split_tiles(cfg)
            cases = [("bf16", act, "ieee") for act in ("gelu", *ACTIVATIONS)]
            cases += [("fp16", "gelu", "ieee"), ("fp32", "gelu", "ieee"), ("fp32", "gelu", "tf32")]
            for dtype, act, precision in dict.fromkeys(cases):
                flags = dict(HAS_BIAS=True, ACTIVATION=act, UPCAST=False, PRECISION=precision, **blocks)
                fitted = fit_fp32(options, torch.float32, "cuda") if dtype == "fp32" else options
                yield variant(_linear_kernel, flags, pointer=f"*{dtype}", options=fitted, targets=(target,))


AOT_VARIANTS = list(_aot_variants())
