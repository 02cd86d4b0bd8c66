"""Triton ``loss.fused_linear_cross_entropy``: output projection + cross-entropy, chunked over
tokens so the ``[T, V]`` logits never exist (the Liger-Kernel technique).

Per chunk of C tokens: the chunk's logits ``[C, V]`` come from graft's Triton GEMM; one program
per row computes the log-sum-exp in fp32 (online, lane-wise), the row's loss, and overwrites the
logits in place with their gradient ``(softmax - onehot(target)) * scale`` (scale = 1/valid
tokens for "mean"); then ``dx[chunk] = dlogits @ W`` and ``dW += dlogits^T @ x[chunk]`` on the
same GEMM, ``db += sum(dlogits)``. The gradients are computed in the forward, when a gradient
is needed, and scaled by the loss's incoming gradient in backward, so the logits buffer is
freed chunk by chunk: peak extra memory is ``C x V`` instead of ``T x V``. The chunk size
follows Liger: about ``T / ceil(V / H)`` rows, so a chunk's logits are about as large as x.

``reduction="none"`` (per-token losses, each with its own incoming gradient, as Megatron's
GPTModel returns them) cannot fold the gradient into a precomputed ``dW``: the forward keeps
no gradient, and the backward recomputes each chunk's logits, turns them into
``(softmax - onehot) * dloss[row]`` with the same row kernel and runs the dx / dW GEMMs;
still no ``[T, V]`` tensor, for one more GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._aot import variant
from graft.kernels.triton._attention_common import NEG_BIG
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton.gemm_linear import linear_op, matmul

OP = "loss.fused_linear_cross_entropy"
# Rows per generation in tiles/<generation>.json ("loss_fused_linear_cross_entropy"), loaded once.
# Small chunks in the interpreter so short test inputs still span several of them.
TILES = tile_table("loss_fused_linear_cross_entropy")


@triton.jit
def _ce_rows_kernel(logits_ptr, target_ptr, loss_ptr, scale_ptr, V, stride, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(target_ptr + row)
    m = tl.full([BLOCK_V], NEG_BIG, dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
    # A target outside [0, V) (value checks off) counts as ignored, as in the reference: never
    # read out of the row.
    valid = (target != ignore_index) & (target >= 0) & (target < V)
    z_t = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_t, 0.0))
    g = tl.where(valid, tl.load(scale_ptr), 0.0)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        d = (tl.exp(z - lse) - tl.where(offs == target, 1.0, 0.0)) * g
        tl.store(base + offs, d.to(logits_ptr.dtype.element_ty), mask=mask)


def chunk_rows(tokens: int, hidden: int, vocab: int, max_chunk: int) -> int:
    ratio = triton.cdiv(vocab, max(hidden, 1))
    return max(1, min(tokens, max_chunk, triton.next_power_of_2(triton.cdiv(tokens, ratio))))


def _flce(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
          ignore_index: int, reduction: str, compute_grad: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    cfg = tile_config(TILES, x.device)
    losses = torch.zeros(tokens, dtype=torch.float32, device=x.device)
    # on the device: no host sync; targets outside [0, V) count as ignored (see the kernel)
    valid = ((target != ignore_index) & (target >= 0) & (target < vocab)).sum().to(torch.float32)
    scale = (1.0 / valid if reduction == "mean" else torch.ones((), device=x.device)).reshape(1)
    compute_grad = compute_grad and reduction != "none"  # "none": the backward recomputes (module doc)
    dx = torch.empty_like(x) if compute_grad else x.new_empty(0)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if compute_grad else None
    db = torch.zeros(vocab, dtype=torch.float32, device=x.device) if compute_grad and bias is not None else None
    chunk = chunk_rows(tokens, hidden, vocab, cfg["max_chunk"])
    block_v = min(cfg["block_v"], triton.next_power_of_2(vocab))
    with on_device(x):
        for start in range(0, tokens, chunk):
            xc, tc = x[start:start + chunk], target[start:start + chunk]
            logits = linear_op(xc, weight, bias, "none")  # [C, V]: the only vocabulary-sized buffer
            _ce_rows_kernel[(xc.shape[0],)](logits, tc, losses[start:], scale, vocab, logits.stride(0),
                                            int(ignore_index), BLOCK_V=block_v, num_warps=cfg["num_warps"])
            if compute_grad:  # logits now hold dlogits
                dx[start:start + chunk] = linear_op(logits, weight.t(), None, "none")
                matmul(logits.t(), xc, out=dw, accumulate=True)  # dW += in fp32, in place
                if db is not None:
                    db += logits.float().sum(0)
    if reduction == "none":
        return losses, x.new_empty(0), weight.new_empty(0), x.new_empty(0)
    total = losses.sum()
    loss = total / valid if reduction == "mean" else total
    return (loss, dx, dw.to(weight.dtype) if dw is not None else weight.new_empty(0),
            db.to(bias.dtype) if db is not None and bias is not None else x.new_empty(0))


def _flce_fake(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
               ignore_index: int, reduction: str, compute_grad: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    if not compute_grad or reduction == "none":
        return loss, x.new_empty(0), weight.new_empty(0), x.new_empty(0)
    return loss, torch.empty_like(x), torch.empty_like(weight), (torch.empty_like(bias) if bias is not None
                                                                 else x.new_empty(0))


flce_op = define_op("loss_fused_linear_cross_entropy_triton", _flce, fake=_flce_fake)


def _flce_backward_none(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                        ignore_index: int, dloss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the per-token losses (``reduction="none"``) for incoming ``dloss [T]``,
    recomputing one chunk of logits at a time."""
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    cfg = tile_config(TILES, x.device)
    unit = torch.ones(1, dtype=torch.float32, device=x.device)
    losses = torch.empty(tokens, dtype=torch.float32, device=x.device)  # recomputed, not needed
    dloss = dloss.to(torch.float32)
    dx = torch.empty_like(x)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    db = torch.zeros(vocab, dtype=torch.float32, device=x.device) if bias is not None else None
    chunk = chunk_rows(tokens, hidden, vocab, cfg["max_chunk"])
    block_v = min(cfg["block_v"], triton.next_power_of_2(vocab))
    with on_device(x):
        for start in range(0, tokens, chunk):
            xc, tc = x[start:start + chunk], target[start:start + chunk]
            logits = linear_op(xc, weight, bias, "none")
            # scale 1: the rows become softmax - onehot (0 for ignored targets) ...
            _ce_rows_kernel[(xc.shape[0],)](logits, tc, losses[start:], unit, vocab, logits.stride(0),
                                            int(ignore_index), BLOCK_V=block_v, num_warps=cfg["num_warps"])
            logits.mul_(dloss[start:start + chunk, None].to(logits.dtype))  # ... times each row's dloss
            dx[start:start + chunk] = linear_op(logits, weight.t(), None, "none")
            matmul(logits.t(), xc, out=dw, accumulate=True)  # dW += in fp32, in place
            if db is not None:
                db += logits.float().sum(0)
    return dx, dw.to(weight.dtype), db.to(bias.dtype) if db is not None and bias is not None else x.new_empty(0)


def _flce_backward_none_fake(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             bias: Optional[torch.Tensor], ignore_index: int, dloss: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias) if bias is not None else x.new_empty(0)


flce_backward_none_op = define_op("loss_fused_linear_cross_entropy_backward_none_triton", _flce_backward_none,
                                  fake=_flce_backward_none_fake)


def _setup(ctx, inputs, output):
    _, dx, dw, db = output
    x, weight, target, bias, ignore_index, reduction, _ = inputs
    ctx.has_bias = bias is not None
    ctx.none = reduction == "none"
    if ctx.none:  # the backward recomputes from the inputs
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(x, weight, target, bias)
    else:
        ctx.save_for_backward(dx, dw, db)


def _backward(ctx, dloss, _ddx, _ddw, _ddb):
    if ctx.none:
        x, weight, target, bias = ctx.saved_tensors
        dx, dw, db = flce_backward_none_op(x, weight, target, bias, ctx.ignore_index, dloss)
        return dx, dw, None, db if ctx.has_bias else None, None, None, None
    dx, dw, db = ctx.saved_tensors
    if dx.numel() == 0 and dw.numel() == 0:
        raise RuntimeError("loss.fused_linear_cross_entropy: the forward ran without gradients "
                           "(call it through graft.ops.loss so it knows a gradient is needed)")
    return (dx * dloss.to(dx.dtype), dw * dloss.to(dw.dtype), None,
            db * dloss.to(db.dtype) if ctx.has_bias else None, None, None, None)


register_backward(flce_op, _backward, _setup)


def fused_linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    """The op on the custom op: gradients are computed in the forward only when one is needed
    (and never for ``reduction="none"``, whose backward recomputes)."""
    wants = [t for t in (x, weight, bias) if t is not None]
    grad = reduction != "none" and torch.is_grad_enabled() and any(t.requires_grad for t in wants)
    # The kernel reads target with unit stride: a strided or expanded view would read other values.
    return flce_op(x, weight, target.contiguous(), bias, int(ignore_index), str(reduction), grad)[0]


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, fused_linear_cross_entropy, custom_op=flce_op, dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="chunked linear + cross-entropy (Liger-style): logits of one chunk at a time, gradients in the "
                    "forward, no [T, V] tensor",
    ))


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return [
        variant(_ce_rows_kernel, dict(BLOCK_V=4096), pointer="*bf16", options={"num_warps": 8}, target_ptr="*i64",
                loss_ptr="*fp32", scale_ptr="*fp32", ignore_index="i64"),
    ]
