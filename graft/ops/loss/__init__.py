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

from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import check_same_device, check_tensor, readable_bounds, values_in_range
from graft.ops.loss.reference import fused_linear_cross_entropy_reference
from graft.registry import OpSpec


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


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


# The conformance cases, re-exported here (imported last: a cases module may use this module's names).
from graft.ops.loss.cases import CASES
