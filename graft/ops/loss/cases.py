"""loss.fused_linear_cross_entropy's conformance cases."""
from __future__ import annotations

import torch

from graft.cases import OpCase


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
