"""Triton W8A8 GEMM (``gemm.w8a8``): int8 x int8 with exact int32 accumulation, then
``acc * x_scale[m] * w_scale[n] + bias[n]`` in fp32 and one rounding to fp16/bf16.

Per-tensor scales ride the same code path as per-token/per-channel ones with a zero
stride, so there is one kernel for every scale granularity. The int8 tl.dot is exact in
Triton's CPU interpreter too (checked against an int64 matmul), so no upcast is needed.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._aot import FAMILY, TARGETS, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._gemm_common import SM_COUNT, gemm_plan, launch_options, tile_constexprs, tile_coords

# Tiles: the shared GEMM table (graft.kernels.triton._gemm_common) at 1-byte operands.


@triton.jit
def _w8a8_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    tile_m, tile_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    x_scale = tl.load(xs_ptr + rows * stride_xs, mask=row_ok, other=0.0)
    w_scale = tl.load(ws_ptr + cols * stride_ws, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _scale_stride(scale: torch.Tensor) -> int:
    # One element: per tensor, the same scale for every row (stride 0).
    return 0 if scale.numel() == 1 else scale.reshape(-1).stride(0)


def _w8a8(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    cfg = gemm_plan(m, n, k, x_q.device, 1, split=False)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    xs, ws = x_scale.reshape(-1), w_scale.reshape(-1)
    with on_device(x_q):
        _w8a8_kernel[grid](
            x_q, w_q, xs, ws, bias if bias is not None else y, y,
            m, n, k,
            x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1),
            _scale_stride(x_scale), _scale_stride(w_scale), y.stride(0), y.stride(1),
            HAS_BIAS=bias is not None,
            **tile_constexprs(cfg), **launch_options(cfg),
        )  # fmt: skip
    return y


def _w8a8_fake(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


w8a8_op = define_op("gemm_w8a8_triton", _w8a8, fake=_w8a8_fake)


def w8a8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.float16):
    return w8a8_op(x_q, w_q, x_scale, w_scale, bias, out_dtype)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "gemm.w8a8", w8a8, custom_op=w8a8_op, dtypes={torch.int8},
        description="Triton int8 GEMM, int32 accumulation, per-token/per-channel scales and bias in the epilogue",
    ))


def _aot_variants():
    """Every M bucket's plan per target (Llama-3-8B N=K=4096), bf16 and fp16 output."""
    types = dict(x_ptr="*i8", w_ptr="*i8", xs_ptr="*fp32", ws_ptr="*fp32")
    for target in TARGETS:
        family = FAMILY[target]
        plans = {}
        for m in (1, 32, 64, 128, 4096):
            cfg = gemm_plan(m, 4096, 4096, "cuda", 1, split=False, family=family, sms=SM_COUNT[family])
            plans.setdefault(tuple(cfg.items()), cfg)
        for cfg in plans.values():
            for out in ("bf16", "fp16"):
                yield variant(_w8a8_kernel, dict(HAS_BIAS=True, **tile_constexprs(cfg)), pointer=f"*{out}",
                              options=launch_options(cfg), targets=(target,), **types)


AOT_VARIANTS = list(_aot_variants())
