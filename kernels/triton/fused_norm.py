"""Triton RMSNorm, plain and fused with the residual add (``fused.rms_norm``).

One program per row. Rows that fit one tile are normalised from registers; longer
rows take two passes over the row (sum of squares, then scale), recomputing
``x + residual`` in fp32 in the second pass so the norm sees the unrounded sum,
exactly like the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._autotune import tile_config
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._common import on_device, triton_implementation

# max_block: widest tile one program holds; longer rows are streamed in max_block chunks.
TILES = {
    "default": {"max_block": 8192, "num_warps": 8},
    "cdna3": {"max_block": 8192, "num_warps": 8},
    "interpreter": {"max_block": 2048, "num_warps": 1},
}


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


AOT_VARIANTS = list(_aot_variants())
