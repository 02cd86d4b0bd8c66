"""Triton W8A8 GEMM (``gemm.w8a8``): int8 x int8 with exact int32 accumulation, then
``acc * x_scale[m] * w_scale[n] + bias[n]`` in fp32 and one rounding to fp16/bf16.

Per-tensor scales ride the same code path as per-token/per-channel ones with a zero
stride, so there is one kernel for every scale granularity. The int8 tl.dot is exact in
Triton's CPU interpreter too (checked against an int64 matmul), so no upcast is needed.

Split-K: at small M the (M, N) tile grid leaves most SMs idle (N=4096, 64-wide tiles: 64
programs on 132 SMs), so K is split as the dense GEMM does (the shared plan per M range,
fitted to shared memory at 1-byte operands). Each split writes its raw int32 partial tile
to a ``[SPLIT_K, M, N]`` int32 workspace; a second pass sums the splits in int32 (integer
addition is exact and order-free, so the result equals the unsplit kernel's bit for bit)
and applies the scales and bias once. No atomics: deterministic and CUDA-graph safe.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._aot import GENERATION, TARGETS, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._gemm_common import (
    SM_COUNT,
    a_tile_ptrs,
    b_tile_ptrs,
    gemm_plan,
    launch_options,
    load_tiles,
    split_tile,
    tile_constexprs,
)

# Tiles: the shared GEMM table (graft.kernels.triton._gemm_common) at 1-byte operands.


@triton.jit
def _w8a8_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr = False,  # the plan's: every K step of every split inside K (no K mask)
):  # fmt: skip
    k_start, rows, cols, row_ok, col_ok = split_tile(M, N, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs, step_x = a_tile_ptrs(x_ptr, rows, k_start, stride_xm, stride_xk, BLOCK_K)
    w_ptrs, step_w = b_tile_ptrs(w_ptr, cols, k_start, stride_wn, stride_wk, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    # Trip count from arguments only (Triton 3.6's interpreter cannot range over program_id
    # values); the last split's steps past K load nothing (masked) and add zero.
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k_ok = ks < K - (k_start + kk)
        a, b = load_tiles(x_ptrs, w_ptrs, row_ok, col_ok, k_ok, 0, EVEN_K)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        x_ptrs += step_x
        w_ptrs += step_w
    if SPLIT_K > 1:  # raw int32 partial into this split's slab; the reduce pass scales once
        slab = tl.program_id(1).to(tl.int64) * M * N
        ws_ptrs = y_ptr + slab + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(ws_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])
        return
    x_scale = tl.load(xs_ptr + rows * stride_xs, mask=row_ok, other=0.0)
    w_scale = tl.load(ws_ptr + cols * stride_ws, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w8a8_reduce_kernel(
    part_ptr, xs_ptr, ws_ptr, bias_ptr, y_ptr, M, N, stride_xs, stride_ws, stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[m, n-block] = (sum of the int32 partials) * x_scale[m] * w_scale[n] + bias[n]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0)
    w_scale = tl.load(ws_ptr + cols * stride_ws, mask=ok, other=0.0)
    y = acc.to(tl.float32) * tl.load(xs_ptr + row * stride_xs) * w_scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols.to(tl.int64) * stride_yn, y.to(y_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK_N = 1024


def plan(m: int, n: int, k: int, device, split_k: Optional[int] = None, **what_if) -> dict:
    """Launch plan at 1-byte operands (tiles, stages, SPLIT_K, K_PER_SPLIT); ``split_k``
    forces a split count (tests)."""
    return gemm_plan(m, n, k, device, 1, split_k=split_k, **what_if)


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
    split_k: Optional[int] = None,
) -> torch.Tensor:
    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    cfg = plan(m, n, k, x_q.device, split_k)
    splits = cfg["SPLIT_K"]
    target = torch.empty((splits, m, n), dtype=torch.int32, device=x_q.device) if splits > 1 else y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    xs, ws = x_scale.reshape(-1), w_scale.reshape(-1)
    xs_stride, ws_stride = _scale_stride(x_scale), _scale_stride(w_scale)
    b = bias if bias is not None else y
    with on_device(x_q):
        _w8a8_kernel[grid](
            x_q, w_q, xs, ws, b, target,
            m, n, k, cfg["K_PER_SPLIT"],
            x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1),
            xs_stride, ws_stride, y.stride(0), y.stride(1),
            HAS_BIAS=bias is not None, SPLIT_K=splits, EVEN_K=cfg["EVEN_K"],
            **tile_constexprs(cfg), **launch_options(cfg),
        )  # fmt: skip
        if splits > 1:
            block_n = min(REDUCE_BLOCK_N, triton.next_power_of_2(n))
            _w8a8_reduce_kernel[(m, triton.cdiv(n, block_n))](
                target, xs, ws, b, y, m, n, xs_stride, ws_stride, y.stride(0), y.stride(1),
                SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK_N=block_n,
                num_warps=4 if block_n >= 512 else 1,
            )  # fmt: skip
    return y


def _w8a8_2d(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _w8a8(x_q, w_q, x_scale, w_scale, bias, out_dtype)


def _w8a8_fake(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


w8a8_op = define_op("gemm_w8a8_triton", _w8a8_2d, fake=_w8a8_fake)


def w8a8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.float16):
    return w8a8_op(x_q, w_q, x_scale, w_scale, bias, out_dtype)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "gemm.w8a8", w8a8, custom_op=w8a8_op, dtypes={torch.int8},
        description="Triton int8 GEMM, int32 accumulation, per-token/per-channel scales and bias in the epilogue",
    ))


# Row-major int8 activations and [N, K] weight, per-token and per-channel scales, contiguous
# output: the unit strides a model's launch passes (the JIT makes them constants).
UNIT_STRIDES = dict(stride_xk=1, stride_wk=1, stride_xs=1, stride_ws=1, stride_yn=1)


def _aot_variants():
    """Every plan the dispatcher launches per target over Llama-3 shapes and the M buckets
    (split ones with SPLIT_K=2: SPLIT_K only switches the store path), bf16 and fp16
    output; the int32 reduce pass."""
    types = dict(x_ptr="*i8", w_ptr="*i8", xs_ptr="*fp32", ws_ptr="*fp32")
    for target in TARGETS:
        generation = GENERATION[target]
        plans = {}
        for m in (1, 16, 32, 64, 128, 4096):
            for n, k in ((4096, 4096), (28672, 4096), (8192, 1024)):
                cfg = plan(m, n, k, "cuda", generation=generation, sms=SM_COUNT[generation])
                key = (tuple(tile_constexprs(cfg).items()), cfg["SPLIT_K"] > 1, tuple(launch_options(cfg).items()),
                       cfg["EVEN_K"])
                plans.setdefault(key, cfg)
        for cfg in plans.values():
            for out in ("bf16", "fp16"):
                flags = dict(HAS_BIAS=True, SPLIT_K=2 if cfg["SPLIT_K"] > 1 else 1, EVEN_K=cfg["EVEN_K"],
                             **tile_constexprs(cfg))
                yield variant(_w8a8_kernel, flags, pointer=f"*{out}", options=launch_options(cfg),
                              targets=(target,), values=UNIT_STRIDES, **types)
    for out, split in (("bf16", 4), ("fp16", 16)):
        yield variant(_w8a8_reduce_kernel, dict(SPLIT_K=split, HAS_BIAS=True, BLOCK_N=REDUCE_BLOCK_N),
                      pointer=f"*{out}", part_ptr="*i32", xs_ptr="*fp32", ws_ptr="*fp32", options={"num_warps": 4},
                      values=dict(stride_xs=1, stride_ws=1, stride_yn=1))


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
