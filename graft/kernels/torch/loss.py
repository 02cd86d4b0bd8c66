"""graft's torch backend of loss.fused_linear_cross_entropy: the logits in row chunks, never all at
once, ranked above the reference (:mod:`graft.ops.loss.reference`)."""
from __future__ import annotations

import torch

from graft.ops._validate import acc, acc_dtype


def _chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: about ``T / ceil(V / H)`` (Liger's rule), so one chunk's fp32 logits
    are about as large as ``x``."""
    ratio = max(1, -(-vocab // max(hidden, 1)))
    return max(1, min(tokens, 1 << max(0, (-(-tokens // ratio) - 1).bit_length())))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: per chunk of rows, fp32 logits -> log-sum-exp and the row's loss; keeps only the
    inputs and the ``[T]`` log-sum-exps. Backward: recomputes each chunk's logits and applies
    ``(softmax - onehot) * dloss`` to the dx / dW / db products."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, reduction):
        tokens, hidden = x.shape
        vocab = weight.shape[0]
        ignored = (target == ignore_index) | (target < 0) | (target >= vocab)
        safe = torch.where(ignored, torch.zeros_like(target), target)
        wf = acc(weight)
        bf = None if bias is None else acc(bias)
        lse = torch.empty(tokens, dtype=acc_dtype(x), device=x.device)
        losses = torch.empty(tokens, dtype=acc_dtype(x), device=x.device)
        chunk = _chunk_rows(tokens, hidden, vocab)
        for start in range(0, tokens, chunk):
            logits = acc(x[start:start + chunk]) @ wf.t()
            if bf is not None:
                logits += bf
            rows = torch.logsumexp(logits, dim=-1)
            lse[start:start + chunk] = rows
            picked = logits.gather(1, safe[start:start + chunk, None])[:, 0]
            losses[start:start + chunk] = rows - picked
            del logits
        losses = losses.masked_fill(ignored, 0.0)
        valid = (~ignored).sum().to(acc_dtype(x))
        ctx.save_for_backward(x, weight, bias, safe, ignored, lse, valid)
        ctx.reduction = reduction
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / valid if reduction == "mean" else total

    @staticmethod
    def backward(ctx, dloss):
        x, weight, bias, safe, ignored, lse, valid = ctx.saved_tensors
        tokens, hidden = x.shape
        vocab = weight.shape[0]
        if ctx.reduction == "none":
            scale = acc(dloss)
        else:
            scale = (acc(dloss) / valid if ctx.reduction == "mean" else acc(dloss)).expand(tokens)
        scale = scale.masked_fill(ignored, 0.0)
        need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # create_graph=True: these gradients will be differentiated
            return _differentiable_grads(x, weight, bias, safe, scale, need_x, need_w, need_b)
        wf = acc(weight)
        bf = None if bias is None else acc(bias)
        dx = torch.empty(x.shape, dtype=acc_dtype(x), device=x.device) if need_x else None
        dw = torch.zeros(weight.shape, dtype=acc_dtype(x), device=x.device) if need_w else None
        db = torch.zeros(vocab, dtype=acc_dtype(x), device=x.device) if need_b and bias is not None else None
        chunk = _chunk_rows(tokens, hidden, vocab)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            xc = acc(x[start:end])
            d = xc @ wf.t()
            if bf is not None:
                d += bf
            d.sub_(lse[start:end, None]).exp_()  # softmax
            d[torch.arange(end - start, device=x.device), safe[start:end]] -= 1.0
            d.mul_(scale[start:end, None])
            if dx is not None:
                dx[start:end] = d @ wf
            if dw is not None:
                dw.addmm_(d.t(), xc)
            if db is not None:
                db += d.sum(0)
            del d
        return (None if dx is None else dx.to(x.dtype), None if dw is None else dw.to(weight.dtype), None,
                None if db is None else db.to(bias.dtype), None, None)


def _differentiable_grads(x, weight, bias, safe, scale, need_x, need_w, need_b):
    """The same gradients as _ChunkedLinearCrossEntropy.backward, in out-of-place torch ops
    on the inputs themselves, so that autograd differentiates them again (double backward,
    ``create_graph=True``): the log-sum-exp is recomputed here rather than read from the
    forward, which saved it without a graph. Chunked over tokens the same way."""
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    wf = acc(weight)
    bf = None if bias is None else acc(bias)
    chunk = _chunk_rows(tokens, hidden, vocab)
    dxs, dw, db = [], None, None
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        xc = acc(x[start:end])
        logits = xc @ wf.t()
        if bf is not None:
            logits = logits + bf
        onehot = torch.nn.functional.one_hot(safe[start:end], vocab).to(logits.dtype)
        d = (torch.softmax(logits, dim=-1) - onehot) * scale[start:end, None]
        if need_x:
            dxs.append(d @ wf)
        if need_w:
            part = d.t() @ xc
            dw = part if dw is None else dw + part
        if need_b and bias is not None:
            part = d.sum(0)
            db = part if db is None else db + part
    dx = torch.cat(dxs).to(x.dtype) if need_x and dxs else (torch.zeros_like(x) if need_x else None)
    if need_w:
        dw = torch.zeros_like(weight) if dw is None else dw.to(weight.dtype)
    if need_b and bias is not None:
        db = torch.zeros_like(bias) if db is None else db.to(bias.dtype)
    return dx, dw, None, db, None, None


def fused_linear_cross_entropy_torch(x, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    """graft's torch backend of the op: the reference's math chunked over tokens with torch
    ops, so that, as in the Triton kernel, no ``[T, V]`` logits tensor exists in forward or
    backward (the backward recomputes one chunk's logits at a time)."""
    return _ChunkedLinearCrossEntropy.apply(x, weight, target, bias, ignore_index, reduction)


def torch_implementations():
    """graft's torch backend of loss.fused_linear_cross_entropy (ranks above the reference)."""
    from graft.registry import torch_fast_path

    return [torch_fast_path("loss.fused_linear_cross_entropy", fused_linear_cross_entropy_torch,
                            "chunked over tokens with torch ops (no [T, V] logits; backward recomputes)")]
