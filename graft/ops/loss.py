"""Loss ops: the output projection fused with cross-entropy.

``fused_linear_cross_entropy(x [T, H], weight [V, H], target [T] int64, bias [V] | None = None,
ignore_index=-100, reduction="mean")``
    ``cross_entropy(x @ weight.T + bias, target)`` with logits and softmax in fp32; targets
    equal to ``ignore_index`` contribute nothing (``"mean"`` divides by the number of the
    others). Returns an fp32 scalar (``"mean"``, ``"sum"``), or with ``"none"`` the fp32
    per-token losses ``[T]`` (0 for ignored tokens), which a framework that weighs tokens
    itself needs (Megatron's GPTModel returns per-token losses). The point of the op is memory:
    an implementation may process tokens in chunks so the full ``[T, V]`` logits tensor (a
    vocabulary of 128k makes it the largest activation of a language model) never exists.
"""
from __future__ import annotations

import torch

from graft.cases import OpCase
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import acc, acc_dtype, check_same_device, check_tensor, readable_bounds, values_in_range
from graft.registry import OpSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


def fused_linear_cross_entropy_reference(x, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    logits = acc(x) @ acc(weight).t()
    if bias is not None:
        logits = logits + acc(bias)
    # A target outside [0, V) (only reachable with the value checks off) counts as ignored.
    vocab = weight.shape[0]
    ignored = (target == ignore_index) | (target < 0) | (target >= vocab)
    target = torch.where(ignored, torch.full_like(target, ignore_index), target)
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


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


def validate_fused_linear_cross_entropy(x, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    op = "loss.fused_linear_cross_entropy"
    check_tensor(f"{op}: x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(f"{op}: weight", weight, dtypes=(x.dtype,), ndim=2)
    check_tensor(f"{op}: target", target, dtypes=(torch.int64,), ndim=1)
    if weight.shape[1] != x.shape[1]:
        raise GraftInputError(f"{op}: weight [V, H] has H={weight.shape[1]} but x [T, H] has H={x.shape[1]}")
    if target.shape[0] != x.shape[0]:
        raise GraftInputError(f"{op}: target has {target.shape[0]} tokens, x has {x.shape[0]}")
    if bias is not None:
        check_tensor(f"{op}: bias", bias, dtypes=(x.dtype,), ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise GraftInputError(f"{op}: bias has {bias.shape[0]} elements, expected V={weight.shape[0]}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise GraftInputError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise GraftInputError(f"{op}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    check_same_device(x=x, weight=weight, target=target, bias=bias)
    check_fused_linear_cross_entropy_values(weight, target, ignore_index)


def check_fused_linear_cross_entropy_values(weight, target, ignore_index=-100):
    """loss.fused_linear_cross_entropy's check of values (``OpSpec.check_values``): targets
    in the vocabulary or ``ignore_index``."""
    bounds = readable_bounds(target)
    vocab = weight.shape[0]
    # One pass; targets equal to ignore_index (padding) need a second
    if bounds is not None and not (bounds[0] >= 0 and bounds[1] < vocab):
        if not values_in_range(target.masked_fill(target == ignore_index, 0), 0, vocab):
            bad = target[(target != ignore_index) & ((target < 0) | (target >= vocab))]
            raise GraftInputError(f"loss.fused_linear_cross_entropy: targets must lie in [0, V={vocab}) or equal "
                                  f"ignore_index={ignore_index}, got {int(bad[0])} ({bad.numel()} such targets)")


def fused_linear_cross_entropy(x, weight, target, bias=None, ignore_index: int = -100, reduction: str = "mean"):
    """Cross-entropy of ``x @ weight.T + bias`` against ``target`` (see the module doc)."""
    return call("loss.fused_linear_cross_entropy", x, weight, target, bias, ignore_index, reduction)


OPS = [
    OpSpec(
        name="loss.fused_linear_cross_entropy",
        family="loss",
        signature="fused_linear_cross_entropy(x[T, H], weight[V, H], target[T] int64, bias[V] | None = None, "
        "ignore_index: int = -100, reduction: str = 'mean') -> fp32 scalar ('none': fp32 [T])",
        reference=fused_linear_cross_entropy_reference,
        description="output projection + cross-entropy (fp32 softmax), chunked so the [T, V] logits never exist",
        validate=validate_fused_linear_cross_entropy,
        check_values=check_fused_linear_cross_entropy_values,
        grad_inputs=(0, 1, 3),
    ),
]


def _case(name, tokens, hidden, vocab, bias, reduction="mean", ignored=0, tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(device=device, dtype=dtype)
        target = torch.randint(0, vocab, (tokens,), generator=gen)
        target[:ignored] = -100
        b = (0.1 * torch.randn(vocab, generator=gen)).to(device=device, dtype=dtype) if bias else None
        return (x, w, target.to(device), b, -100, reduction), {}

    def flops(args, kwargs):
        return 2.0 * args[0].shape[0] * args[0].shape[1] * args[1].shape[0] * 3  # forward + dx + dw GEMMs

    return OpCase("loss.fused_linear_cross_entropy", name, make, tags=tags, flops=flops,
                  reduction=lambda args, kwargs: args[0].shape[1])


CASES = [
    _case("t7_h32_v50", 7, 32, 50, bias=False),
    _case("t19_h48_v97_bias_ignore3", 19, 48, 97, bias=True, ignored=3),
    _case("t9_h32_v64_sum", 9, 32, 64, bias=False, reduction="sum"),
    _case("t11_h32_v70_none_ignore2", 11, 32, 70, bias=True, reduction="none", ignored=2),
    _case("t4096_h4096_v128256", 4096, 4096, 128256, bias=False, tags=frozenset({"gpu"})),
]
