"""Triton LayerNorm (``fused.layer_norm``), forward and backward.

Forward: one program per row, the row in registers: fp32 mean and biased variance, then
``(x - mean) * rstd * w + b`` rounded once. Backward (Liger-style row blocks): each
program walks a contiguous block of rows, writes ``dx`` and accumulates its rows' share of
``dweight = sum(dy * xhat)`` and ``dbias = sum(dy)`` in fp32 registers, stored as one row
of a ``[programs, H]`` partial buffer and summed afterwards (no atomics, deterministic).
``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * w``. The mean and
rstd are recomputed from x in backward: the row is read anyway, nothing extra is saved.

Rows wider than :data:`MAX_HIDDEN` are not served (the per-call check says so and the
next implementation runs).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._aot import variant
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton.fused_rms_norm import _rows, row_programs

MAX_HIDDEN = 16384
# Rows per generation in tiles/<generation>.json ("fused_layer_norm"), loaded once.
TILES = tile_table("fused_layer_norm")


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, H, x_stride, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    v = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(v, axis=0) / H
    c = tl.where(mask, v - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(c * c, axis=0) / H + eps)
    y = c * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, db_ptr,
    rows, H, rows_per_prog, dy_stride, x_stride, eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_prog
    last = tl.minimum(first + rows_per_prog, rows)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(first, last):
        v = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_stride + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(v, axis=0) / H
        c = tl.where(mask, v - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(c * c, axis=0) / H + eps)
        xhat = c * rstd
        g = dy * w
        dx = rstd * (g - tl.sum(g, axis=0) / H - xhat * (tl.sum(g * xhat, axis=0) / H))
        tl.store(dx_ptr + row * H + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(dw_ptr + pid.to(tl.int64) * H + offs, dw_acc, mask=mask)
    tl.store(db_ptr + pid.to(tl.int64) * H + offs, db_acc, mask=mask)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return out
    x2 = _rows(x)
    with on_device(x):
        _layer_norm_fwd_kernel[(rows,)](
            x2, weight.contiguous(), bias.contiguous() if bias is not None else weight, out,
            hidden, x2.stride(0), float(eps),
            HAS_BIAS=bias is not None, BLOCK=triton.next_power_of_2(hidden),
            num_warps=tile_config(TILES, x.device)["num_warps"],
        )
    return out


def _layer_norm_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    x2, dy2 = _rows(x), _rows(dy)
    progs = row_programs(rows, x.device)
    per = triton.cdiv(rows, progs)
    progs = triton.cdiv(rows, per)
    dw_part = torch.empty((progs, hidden), dtype=torch.float32, device=x.device)
    db_part = torch.empty((progs, hidden), dtype=torch.float32, device=x.device)
    with on_device(x):
        _layer_norm_bwd_kernel[(progs,)](
            dy2, x2, weight.contiguous(), dx, dw_part, db_part,
            rows, hidden, per, dy2.stride(0), x2.stride(0), float(eps),
            BLOCK=triton.next_power_of_2(hidden), num_warps=tile_config(TILES, x.device)["num_warps"],
        )
    return dx, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)


def _layer_norm_bwd_fake(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), torch.empty_like(weight)


layer_norm_op = define_op("fused_layer_norm_triton", _layer_norm, fake=_layer_norm_fake)
layer_norm_bwd_op = define_op("fused_layer_norm_backward_triton", _layer_norm_bwd, fake=_layer_norm_bwd_fake)


def _setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd_op(dy, x, weight, ctx.eps)
    return dx, dw, (db if ctx.has_bias else None), None


register_backward(layer_norm_op, _backward, _setup)


def layer_norm(x, weight, bias=None, eps=1e-5):
    return layer_norm_op(x, weight, bias, float(eps))


def check(x, weight, bias=None, eps=1e-5):
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} > {MAX_HIDDEN} (the Triton LayerNorm keeps a row in registers)"
    return None


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "fused.layer_norm", layer_norm, custom_op=layer_norm_op, check=check, check_scalars=(),
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton LayerNorm (row in registers, fp32 statistics; backward with row-block weight partials)",
    ))


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return [
        variant(_layer_norm_fwd_kernel, dict(HAS_BIAS=True, BLOCK=4096), pointer="*bf16", options={"num_warps": 8},
                eps="fp32"),
        variant(_layer_norm_fwd_kernel, dict(HAS_BIAS=False, BLOCK=1024), pointer="*fp32", options={"num_warps": 8},
                eps="fp32"),
        variant(_layer_norm_bwd_kernel, dict(BLOCK=4096), pointer="*bf16", options={"num_warps": 8}, eps="fp32",
                dw_ptr="*fp32", db_ptr="*fp32"),
    ]
