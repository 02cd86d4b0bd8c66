"""Backward of the Triton ``gemm.linear`` (``act(x @ w.T + b)``), through graft's own GEMM.

With ``dz = dy * act'(z)`` (``z = x @ w.T + b``, recomputed by the same Triton GEMM when an
activation is fused, since the forward keeps only its output):

* ``dx = dz @ w`` — the forward kernel on ``(dz, w.T)``; it reads ``w.T`` through strides,
* ``dw = dz.T @ x`` — the forward kernel on ``(dz.T, x.T)``, strided views again, no copies,
* ``db = sum over rows of dz`` in fp32.

The GEMM is the forward's kernel (``gemm_linear.linear_op``), called through :func:`_matmul`
so this module does not depend on how that kernel is tiled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._aot import variant
from graft.kernels.triton._common import on_device
from graft.kernels.triton import gemm_linear

BLOCK = 1024


@triton.jit
def _activation_grad_kernel(dy_ptr, z_ptr, dz_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """dz = dy * act'(z), elementwise in fp32 (derivatives of graft.ops.gemm.ACTIVATIONS)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "relu":
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == "gelu":
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    elif ACTIVATION == "gelu_erf":
        d = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACTIVATION == "silu":
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    else:
        d = tl.full([BLOCK], 1.0, dtype=tl.float32)
    tl.store(dz_ptr + offs, (dy * d).to(dz_ptr.dtype.element_ty), mask=mask)


def _activation_grad(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    dy, z = dy.contiguous(), z.contiguous()
    dz = torch.empty_like(z)
    n = z.numel()
    if n:
        with on_device(z):
            _activation_grad_kernel[(triton.cdiv(n, BLOCK),)](dy, z, dz, n, ACTIVATION=activation, BLOCK=BLOCK,
                                                               num_warps=4)
    return dz


def _activation_grad_fake(dy: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.empty_like(z, memory_format=torch.contiguous_format)


activation_grad_op = define_op("gemm_linear_activation_backward_triton", _activation_grad, fake=_activation_grad_fake)


def _matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` on graft's Triton GEMM (either operand may be a strided view)."""
    return gemm_linear.linear_op(a, b_t, None, "none")


def _setup(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.save_for_backward(x, weight, bias if activation != "none" else None)
    ctx.activation, ctx.has_bias = activation, bias is not None


def _backward(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    if ctx.activation == "none":
        dz = dy
    else:
        dz = activation_grad_op(dy, gemm_linear.linear_op(x, weight, bias, "none"), ctx.activation)
    dx = _matmul(dz, weight.t()) if ctx.needs_input_grad[0] else None
    dw = _matmul(dz.t(), x.t()) if ctx.needs_input_grad[1] else None
    db = dz.float().sum(0).to(dz.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db, None


register_backward(gemm_linear.linear_op, _backward, _setup)

def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return [
        variant(_activation_grad_kernel, dict(ACTIVATION=act, BLOCK=BLOCK), pointer=f"*{dtype}", options={"num_warps": 4})
        for dtype, act in (("bf16", "silu"), ("fp16", "gelu"), ("fp32", "gelu_erf"), ("bf16", "relu"))
    ]
