"""The torch definition of loss.fused_linear_cross_entropy (one fp32 matmul, then torch's cross entropy)."""
from __future__ import annotations

import torch

from graft.ops._validate import acc


def fused_linear_cross_entropy_reference(x, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    logits = acc(x) @ acc(weight).t()
    if bias is not None:
        logits = logits + acc(bias)
    # A target outside [0, V) (only reachable with the value checks off) counts as ignored.
    vocab = weight.shape[0]
    ignored = (target == ignore_index) | (target < 0) | (target >= vocab)
    target = torch.where(ignored, torch.full_like(target, ignore_index), target)
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
