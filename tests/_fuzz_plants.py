"""Broken implementations of fused.silu_and_mul (backend ``plant``) that ``graft fuzz`` must catch:
imported into its children with ``--import _fuzz_plants`` (tests/test_fuzz.py)."""
import os

import torch

from graft.ops.fused import silu_and_mul_reference
from graft.plugins import get_registry
from graft.registry import Implementation


def _aborts_on_a_strided_view(x):
    """A kernel that assumes unit strides and takes the process down otherwise."""
    if not x.is_contiguous():
        os.abort()
    return silu_and_mul_reference(x)


class _SilentSecondDerivative(torch.autograd.Function):
    """Right first derivative, computed from detached values: under create_graph=True its
    gradient does not depend on x, so a second derivative is silently zero."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_and_mul_reference(x)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            grad, = torch.autograd.grad(silu_and_mul_reference(xd), xd, g.detach())
        return grad


def _silent_second_derivative(x):
    return _SilentSecondDerivative.apply(x)


PLANT = os.environ.get("GRAFT_FUZZ_PLANT", "abort")
get_registry().add_impl(Implementation(
    op="fused.silu_and_mul", backend="plant", provider="plant", devices=frozenset({"cpu"}),
    fn=_aborts_on_a_strided_view if PLANT == "abort" else _silent_second_derivative))
