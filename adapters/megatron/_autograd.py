"""Training through graft ops: forward on the selected implementation, gradients from the
torch reference.

Optimized graft kernels are forward-only ``torch.library`` ops. When one of them serves a
call that needs gradients, :func:`call_with_reference_grad` runs the kernel forward and,
in backward, recomputes the op's torch reference (which defines the op's semantics) and
differentiates that. When the torch reference itself is selected, autograd flows through
it directly and nothing is recomputed.
"""
from __future__ import annotations

import torch

from graft.adapters.megatron.stats import count


class _ReferenceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, reference, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in tensors])
        ctx.kinds = [isinstance(t, torch.Tensor) for t in tensors]
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in tensors]
        return fn(*tensors)

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        inputs = []
        for is_tensor, other, need in zip(ctx.kinds, ctx.others, ctx.needs_input_grad[2:]):
            t = next(saved) if is_tensor else other
            if is_tensor and t is not None:
                t = t.detach().requires_grad_(need)
            inputs.append(t)
        wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
            grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True)
        by_id = {id(t): g for t, g in zip(wanted, grads)}
        return (None, None) + tuple(by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs)


def call_with_reference_grad(op: str, entry_point, reference, *args):
    """``entry_point(*args)`` (a graft op's public function), differentiable.

    ``reference`` is the op's torch reference with the same positional arguments.
    """
    from graft.dispatch import select

    backend = select(op, *args).backend
    count(f"{op}:{backend}")
    needs_grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not needs_grad or backend == "torch":
        return entry_point(*args)
    return _ReferenceGrad.apply(entry_point, reference, *args)
