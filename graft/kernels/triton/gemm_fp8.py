"""Triton FP8 GEMM (``gemm.fp8``): fp8 e4m3 x fp8 e4m3 with fp32 accumulation and either
per-tensor / per-token x per-channel scales or DeepSeek-V3 block scales (activations per
token per 128-wide K group, weights per 128x128 block).

Scale handling follows where the scale varies:

* per tensor / per row: the scale is constant along K, so the K loop is a plain fp8 MMA
  chain and ``acc * x_scale[m] * w_scale[n]`` is applied once after it (zero strides make
  per-tensor scales the same code path);
* block scales: the scales change every 128 along K, so each K step (BLOCK_K divides 128,
  so a step stays in one group) does its fp8 MMA into a fresh fp32 tile and adds it to the
  accumulator times ``x_scale[m, g] * w_scale[n // 128, g]``, as DeepSeek-V3's kernels do.

Tiles and split-K come from the shared GEMM plan at 1-byte operands (graft.kernels.triton.
_gemm_common); split partials are already scaled, so the fixed-order reduce only adds
bias. Interpreted, the fp8 tiles are widened to fp32 before the dot (the same policy as
bf16 in graft.kernels.triton._dot: interpreters differ in fp8 support; GPUs keep the fp8 MMA).
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
    splitk_reduce,
    splitk_workspace,
    store_tile,
    tile_constexprs,
)
from graft.platform import device_info, fp8_flavour_reason, triton_interpret

SCALE_BLOCK = 128  # DeepSeek-V3's block: 128 K per activation scale, 128x128 per weight scale
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})


@triton.jit
def _fp8_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk,
    stride_xs_m, stride_xs_g, stride_ws_n, stride_ws_g, stride_ym, stride_yn,
    BLOCKWISE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr = False,  # the plan's: every K step of every split inside K (no K mask)
):  # fmt: skip
    k_start, rows, cols, row_ok, col_ok = split_tile(M, N, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs, x_step = a_tile_ptrs(x_ptr, rows, k_start, stride_xm, stride_xk, BLOCK_K)
    w_ptrs, w_step = b_tile_ptrs(w_ptr, cols, k_start, stride_wn, stride_wk, BLOCK_K)
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xs_m
    ws_cols = ws_ptr + (cols // 128).to(tl.int64) * stride_ws_n  # 128: SCALE_BLOCK (blockwise only)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Trip count from arguments only (Triton 3.6's interpreter cannot range over program_id
    # values); the last split's steps past K load nothing (masked) and add zero.
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_start + kk
        k_ok = ks < K - k0
        a, b = load_tiles(x_ptrs, w_ptrs, row_ok, col_ok, k_ok, 0.0, EVEN_K)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if BLOCKWISE:
            group = k0 // 128
            # no scale read for a step past K (last split); k0 as a vector: see gemm_w4a16
            if EVEN_K:
                xs = tl.load(xs_rows + group * stride_xs_g, mask=row_ok, other=0.0)
                ws = tl.load(ws_cols + group * stride_ws_g, mask=col_ok, other=0.0)
            else:
                xs = tl.load(xs_rows + group * stride_xs_g, mask=row_ok & ((rows * 0 + k0) < K), other=0.0)
                ws = tl.load(ws_cols + group * stride_ws_g, mask=col_ok & ((cols * 0 + k0) < K), other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * xs[:, None] * ws[None, :]
        else:
            # On Hopper the fp8 MMA accumulates over the whole K in the tensor core's ~14-bit
            # precision (Triton's sm_90 default), as vLLM's Triton scaled_mm and cuBLAS's fast
            # accumulation do. Promoting to fp32 every K step (max_num_imprecise_acc=BLOCK_K)
            # was measured on an H200 at 0.27-0.30x _scaled_mm at M=4096 against 0.93-1.05x
            # without (the add waits for each wgmma): the error stays within 2e-3 of the
            # output's scale at these K (tests/test_gemm_fp8.py's GPU tolerance).
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        x_ptrs += x_step
        w_ptrs += w_step
    if not BLOCKWISE:
        xs = tl.load(xs_rows, mask=row_ok, other=0.0)
        ws = tl.load(ws_ptr + cols.to(tl.int64) * stride_ws_n, mask=col_ok, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    store_tile(acc, y_ptr, bias_ptr, rows, cols, M, N, stride_ym, stride_yn, HAS_BIAS, "none", SPLIT_K, False)


def _scale_strides(scale: torch.Tensor, blockwise: bool) -> tuple[int, int]:
    """(stride along rows, stride along K groups); 0 where the scale is shared."""
    if blockwise:
        return scale.stride(0), scale.stride(1)
    return (0 if scale.numel() == 1 else scale.reshape(-1).stride(0)), 0


def plan(m: int, n: int, k: int, device, blockwise: bool, split_k: Optional[int] = None, **what_if) -> dict:
    return gemm_plan(m, n, k, device, 1, k_multiple_of=SCALE_BLOCK if blockwise else 0, split_k=split_k,
                     kind="fp8_block" if blockwise else None, **what_if)


def _fp8(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    from graft.ops.gemm import fp8_blockwise

    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(torch.zeros((m, n), device=y.device) + (bias.float() if bias is not None else 0))
    blockwise = fp8_blockwise(x_q, w_q, x_scale, w_scale)
    cfg = plan(m, n, k, x_q.device, blockwise)
    splits = cfg["SPLIT_K"]
    target = splitk_workspace(cfg, m, n, x_q) if splits > 1 else y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    xs_m, xs_g = _scale_strides(x_scale, blockwise)
    ws_n, ws_g = _scale_strides(w_scale, blockwise)
    with on_device(x_q):
        _fp8_kernel[grid](
            x_q, w_q, x_scale, w_scale, bias if bias is not None else y, target,
            m, n, k, cfg["K_PER_SPLIT"],
            x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1),
            xs_m, xs_g, ws_n, ws_g, y.stride(0), y.stride(1),
            BLOCKWISE=blockwise, HAS_BIAS=bias is not None, SPLIT_K=splits, UPCAST=triton_interpret(),
            EVEN_K=cfg["EVEN_K"],
            **tile_constexprs(cfg), **launch_options(cfg),
        )  # fmt: skip
        if splits > 1:
            splitk_reduce(target, bias, y)
    return y


def _fp8_fake(x_q, w_q, x_scale, w_scale, bias, out_dtype):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


fp8_op = define_op("gemm_fp8_triton", _fp8, fake=_fp8_fake)


def fp8(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    return fp8_op(x_q, w_q, x_scale, w_scale, bias, out_dtype)


def check(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    if x_q.dtype != w_q.dtype:
        return f"x_q is {x_q.dtype} but w_q is {w_q.dtype}: the fp8 MMA takes one format"
    if x_q.device.type == "cuda":  # the interpreter runs both flavours exactly
        return fp8_flavour_reason(x_q.dtype, device_info(x_q.device).arch)
    return None


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "gemm.fp8", fp8, custom_op=fp8_op, dtypes=FP8_DTYPES, check=check, check_scalars=(),
        description="Triton fp8 e4m3 GEMM, fp32 accumulation, per-tensor/row or 128x128 block scales, split-K",
    ))


# Contiguous fp8 activations [M, K] and weight [N, K], contiguous output; DeepSeek-V3's
# 128x128 block scales at K = 7168: x_scale [M, 56] and w_scale [N/128, 56] (56: no
# divisibility hint, as at that launch); row scales [M, 1] and [N, 1].
BLOCK_STRIDES = dict(stride_xk=1, stride_wk=1, stride_yn=1, stride_xs_m=56, stride_xs_g=1, stride_ws_n=56,
                     stride_ws_g=1)
ROW_STRIDES = dict(stride_xk=1, stride_wk=1, stride_yn=1, stride_xs_m=1, stride_xs_g=0, stride_ws_n=1, stride_ws_g=0)


def _aot_variants():
    """Every M bucket's plan per target (N=K=4096), block and row scales; fp8 e4m3 is
    ``fp8e4nv`` on sm_90, the fnuz ``fp8e4b8`` on gfx942 (MI300's native format)."""
    fp8_type = {"sm_90": "*fp8e4nv", "gfx942": "*fp8e4b8"}
    for target in TARGETS:
        generation = GENERATION[target]
        for blockwise in (True, False):
            plans = {}
            for m in (1, 32, 64, 128, 4096):
                cfg = plan(m, 4096, 4096, "cuda", blockwise, generation=generation, sms=SM_COUNT[generation])
                cfg["SPLIT_K"] = min(cfg["SPLIT_K"], 2)  # only switches the store path
                # keyed by every plan entry but K_PER_SPLIT (EVEN_K included: it is a constexpr)
                plans.setdefault(tuple(sorted((k, v) for k, v in cfg.items() if k != "K_PER_SPLIT")), cfg)
            for cfg in plans.values():
                flags = dict(BLOCKWISE=blockwise, HAS_BIAS=True, SPLIT_K=cfg["SPLIT_K"], UPCAST=False,
                             EVEN_K=cfg["EVEN_K"], **tile_constexprs(cfg))
                yield variant(_fp8_kernel, flags, pointer="*bf16", options=launch_options(cfg), targets=(target,),
                              values=BLOCK_STRIDES if blockwise else ROW_STRIDES,
                              x_ptr=fp8_type[target], w_ptr=fp8_type[target], xs_ptr="*fp32", ws_ptr="*fp32")


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
