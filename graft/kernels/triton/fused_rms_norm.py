"""Triton RMSNorm, plain and fused with the residual add (``fused.rms_norm``).

One program per row. Rows that fit one tile are normalised from registers; longer
rows take two passes over the row (sum of squares, then scale), recomputing
``x + residual`` in fp32 in the second pass so the norm sees the unrounded sum,
exactly like the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._common import on_device, triton_implementation

# max_block: widest tile one program holds; longer rows are streamed in max_block chunks.
# Rows per generation in tiles/<generation>.json ("fused_rms_norm"), loaded once.
TILES = tile_table("fused_rms_norm")


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    H, x_stride, res_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    res_row = res_ptr + row * res_stride
    out_row = out_ptr + row * H
    res_out_row = res_out_ptr + row * H
    if ONE_TILE:
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            v += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_out_row + offs, v.to(res_out_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + offs, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                v += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(res_out_row + offs, v.to(res_out_ptr.dtype.element_ty), mask=mask)
            acc += v * v
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                v += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [rows, H] with a unit inner stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, weight, eps, residual):
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x.numel() // hidden if hidden else 0
    if rows == 0 or hidden == 0:
        return out, res_out
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    cfg = tile_config(TILES, x.device)
    block = min(triton.next_power_of_2(hidden), cfg["max_block"])
    with on_device(x):
        _rms_norm_kernel[(rows,)](
            x2, r2, weight.contiguous(), out, res_out,
            hidden, x2.stride(0), r2.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, ONE_TILE=block >= hidden,
            num_warps=cfg["num_warps"],
        )
    return out, res_out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, None)[0]


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, weight, eps, residual)


def _add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


rms_norm_op = define_op("fused_rms_norm_triton", _rms_norm, fake=_rms_norm_fake)
add_rms_norm_op = define_op("fused_add_rms_norm_triton", _add_rms_norm, fake=_add_rms_norm_fake)


def rms_norm(x, weight, eps=1e-6, residual=None):
    """fused.rms_norm through the Triton custom ops."""
    if residual is None:
        return rms_norm_op(x, weight, float(eps))
    return add_rms_norm_op(x, residual, weight, float(eps))


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "fused.rms_norm", rms_norm, custom_op=rms_norm_op,
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton RMSNorm (one program per row, fp32 reduction, optional fused residual add)",
    ))


def _aot_variants():
    """Per target: one-tile and streamed rows, with and without the residual, each dtype."""
    for target, cfg in per_target(TILES):
        for dtype, residual, one_tile in (("bf16", True, True), ("fp16", False, False), ("fp32", True, False),
                                          ("bf16", False, True)):
            flags = dict(HAS_RESIDUAL=residual, BLOCK=cfg["max_block"] if not one_tile else 4096, ONE_TILE=one_tile)
            yield variant(_rms_norm_kernel, flags, pointer=f"*{dtype}", options={"num_warps": cfg["num_warps"]},
                          targets=(target,), eps="fp32")


# ---------------------------------------------------------------------------- backward
#
# dv = rstd * (g - v * rstd^2 * mean(g * v)) with g = dy * w and v = x (+ residual) in fp32,
# plus the residual output's gradient; dx = dresidual = dv. dweight = sum over rows of
# dy * v * rstd: each program accumulates its rows' share in fp32 into its own row of a
# [programs, H] buffer (no atomics), summed afterwards. rstd is recomputed from x (and the
# residual): a row is read anyway, and nothing but the inputs needs saving.


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, res_ptr, dres_ptr, w_ptr, dx_ptr, dw_ptr,
    rows, H, rows_per_prog, dy_stride, x_stride, res_stride, dres_stride, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_DRES: tl.constexpr, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_prog  # int64 row offsets: the loop variable inherits the type
    last = tl.minimum(first + rows_per_prog, rows)
    dw_row = dw_ptr + pid.to(tl.int64) * H
    if ONE_TILE:
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(first, last):
            row = r
            v = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                v += tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_stride + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
            g = dy * w
            dv = rstd * g - v * (rstd * rstd * rstd * tl.sum(g * v, axis=0) / H)
            if HAS_DRES:
                dv += tl.load(dres_ptr + row * dres_stride + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * H + offs, dv.to(dx_ptr.dtype.element_ty), mask=mask)
            dw_acc += dy * v * rstd
        tl.store(dw_row + offs, dw_acc, mask=mask)
    else:
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dw_row + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < H)
        for r in range(first, last):
            row = r
            sq = tl.zeros([BLOCK], dtype=tl.float32)
            gv = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, H, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < H
                v = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    v += tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * dy_stride + offs, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                sq += v * v
                gv += dy * w * v
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / H + eps)
            coef = rstd * rstd * rstd * tl.sum(gv, axis=0) / H
            for start in range(0, H, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < H
                v = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    v += tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * dy_stride + offs, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                dv = rstd * dy * w - v * coef
                if HAS_DRES:
                    dv += tl.load(dres_ptr + row * dres_stride + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + row * H + offs, dv.to(dx_ptr.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + offs, mask=mask, other=0.0)
                tl.store(dw_row + offs, dw + dy * v * rstd, mask=mask)


def row_programs(rows: int, device: torch.device) -> int:
    """Programs for a row-blocked backward: about two per SM on a GPU (each keeps a dweight
    partial), a handful in the interpreter (it pays per program)."""
    if device.type == "cuda":
        return max(1, min(rows, 2 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                  dres: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // hidden if hidden else 0
    if rows == 0 or hidden == 0:
        return dx.zero_(), torch.zeros_like(weight)
    x2, dy2 = _rows(x), _rows(dy)
    r2 = _rows(residual) if residual is not None else x2
    d2 = _rows(dres) if dres is not None else dy2
    cfg = tile_config(TILES, x.device)
    block = min(triton.next_power_of_2(hidden), cfg["max_block"])
    progs = row_programs(rows, x.device)
    per = triton.cdiv(rows, progs)
    progs = triton.cdiv(rows, per)
    dw_part = torch.empty((progs, hidden), dtype=torch.float32, device=x.device)
    with on_device(x):
        _rms_norm_bwd_kernel[(progs,)](
            dy2, x2, r2, d2, weight.contiguous(), dx, dw_part,
            rows, hidden, per, dy2.stride(0), x2.stride(0), r2.stride(0), d2.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, HAS_DRES=dres is not None, BLOCK=block, ONE_TILE=block >= hidden,
            num_warps=cfg["num_warps"],
        )
    return dx, dw_part.sum(0).to(weight.dtype)


def _rms_norm_bwd_fake(dy: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                       dres: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


rms_norm_bwd_op = define_op("fused_rms_norm_backward_triton", _rms_norm_bwd, fake=_rms_norm_bwd_fake)


def _setup_plain(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward_plain(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_bwd_op(dy, x, None, None, weight, ctx.eps)
    return dx, dw, None


def _setup_residual(ctx, inputs, output):
    x, residual, weight, eps = inputs
    ctx.save_for_backward(x, residual, weight)
    ctx.eps = eps


def _backward_residual(ctx, dy, dres):
    x, residual, weight = ctx.saved_tensors
    if dy is None:  # only residual_out is used downstream
        dy = torch.zeros_like(x)
    dx, dw = rms_norm_bwd_op(dy, x, residual, dres, weight, ctx.eps)
    return dx, dx, dw, None


register_backward(rms_norm_op, _backward_plain, _setup_plain)
register_backward(add_rms_norm_op, _backward_residual, _setup_residual, name="fused.rms_norm (with residual) on triton")


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants()) + [
        variant(_rms_norm_bwd_kernel, dict(HAS_RESIDUAL=residual, HAS_DRES=residual, BLOCK=block, ONE_TILE=one_tile),
                pointer=f"*{dtype}", options={"num_warps": 8}, eps="fp32", dw_ptr="*fp32")
        for dtype, residual, block, one_tile in (("bf16", True, 4096, True), ("fp32", False, 8192, False))
    ]
