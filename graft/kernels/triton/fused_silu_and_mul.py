"""Triton SiLU-and-mul (``fused.silu_and_mul``): ``silu(x[..., :D]) * x[..., D:]``.

The gated-MLP activation reads the gate and up halves of each row once and writes
the product, instead of three elementwise passes. Grid: (rows, column tiles).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._aot import variant
from graft.kernels.triton._common import on_device, triton_implementation

# Rows per generation in tiles/<generation>.json ("fused_silu_and_mul"), loaded once.
TILES = tile_table("fused_silu_and_mul")


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, D, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + D + offs, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * D + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = tile_config(TILES, x.device)
    block = min(cfg["block"], triton.next_power_of_2(d))
    grid = (x2.shape[0], triton.cdiv(d, block))
    with on_device(x):
        _silu_and_mul_kernel[grid](x2, out, d, x2.stride(0), BLOCK=block, num_warps=cfg["num_warps"])
    return out


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


silu_and_mul_op = define_op("fused_silu_and_mul_triton", _silu_and_mul, fake=_silu_and_mul_fake)


def silu_and_mul(x):
    return silu_and_mul_op(x)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "fused.silu_and_mul", silu_and_mul, custom_op=silu_and_mul_op,
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton SiLU-and-mul (fp32 math, one read of each half)",
    ))


def _forward_aot_variants() -> list:
    return [
        variant(_silu_and_mul_kernel, dict(BLOCK=block), pointer=f"*{dtype}", options={"num_warps": TILES["default"]["num_warps"]})
        for dtype, block in (("bf16", 1024), ("fp16", 256), ("fp32", 1024))
    ]


# ---------------------------------------------------------------------------- backward
# d gate = dout * up * s * (1 + gate * (1 - s)) with s = sigmoid(gate); d up = dout * silu(gate).


@triton.jit
def _silu_and_mul_bwd_kernel(dout_ptr, x_ptr, dx_ptr, D, dout_stride, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    dout = tl.load(dout_ptr + row * dout_stride + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + D + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dout * up * s * (1.0 + gate * (1.0 - s))
    d_up = dout * gate * s
    ty = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + row * 2 * D + offs, d_gate.to(ty), mask=mask)
    tl.store(dx_ptr + row * 2 * D + D + offs, d_up.to(ty), mask=mask)


def _silu_and_mul_bwd(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    d2 = dout.reshape(-1, d)
    d2 = d2 if d2.stride(-1) == 1 else d2.contiguous()
    cfg = tile_config(TILES, x.device)
    block = min(cfg["block"], triton.next_power_of_2(d))
    with on_device(x):
        _silu_and_mul_bwd_kernel[(x2.shape[0], triton.cdiv(d, block))](
            d2, x2, dx, d, d2.stride(0), x2.stride(0), BLOCK=block, num_warps=cfg["num_warps"])
    return dx


def _silu_and_mul_bwd_fake(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


silu_and_mul_bwd_op = define_op("fused_silu_and_mul_backward_triton", _silu_and_mul_bwd, fake=_silu_and_mul_bwd_fake)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dout):
    (x,) = ctx.saved_tensors
    return silu_and_mul_bwd_op(dout, x)


register_backward(silu_and_mul_op, _backward, _setup)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return _forward_aot_variants() + [
        variant(_silu_and_mul_bwd_kernel, dict(BLOCK=1024), pointer=f"*{dtype}", options={"num_warps": 4})
        for dtype in ("bf16", "fp32")
    ]
