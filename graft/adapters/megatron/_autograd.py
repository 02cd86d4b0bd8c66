"""Training through graft ops.

Every optimized graft kernel with a backward registers it on its ``torch.library`` op
(``graft.custom_ops.register_backward``), so calling the op's public function is
differentiable as is: the forward and the backward both run graft's kernels.

:func:`call_with_reference_grad` keeps a fallback for implementations that have no
backward (a vendor plugin's forward-only kernel, say): the kernel runs forward and, in
backward, the op's torch reference (which defines its semantics) is recomputed and
differentiated. Each such call is counted as ``fallback.reference_backward`` with its
reason logged once. When the torch reference itself is selected, autograd flows through it
directly and nothing is recomputed.
"""
from __future__ import annotations

import torch

from graft.adapters.megatron.integration import counter
from graft.custom_ops import has_backward
from graft.dispatch import run


class _ReferenceGrad(torch.autograd.Function):
    """Output already computed by a forward-only kernel; backward differentiates the reference."""

    @staticmethod
    def forward(ctx, out, reference, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in tensors])
        ctx.kinds = [isinstance(t, torch.Tensor) for t in tensors]
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in tensors]
        return out

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


def _trains_itself(impl) -> bool:
    """Whether autograd through ``impl``'s output is already right: a torch implementation
    (autograd records its torch ops) or a custom op with a registered backward."""
    known = _TRAINS.get(id(impl))
    if known is None or known[0] is not impl:
        known = _TRAINS[id(impl)] = (impl, impl.backend == "torch" or has_backward(impl.custom_op))
    return known[1]


# id(Implementation) -> (the implementation, whether it trains itself). By id: hashing the
# frozen dataclass would hash all its fields on every call; the entry keeps it alive.
_TRAINS: dict = {}


def call_with_reference_grad(op: str, reference, *args):
    """``graft.dispatch.run(op, *args)`` (one validation and selection), counted under the
    implementation that served it, differentiable.

    The implementation's own autograd is used when it has one (a torch implementation, or a
    kernel with a registered backward); otherwise its output is kept and, in backward,
    ``reference`` (the op's torch reference, same positional arguments) is recomputed and
    differentiated, counted as ``fallback.reference_backward`` and logged.
    """
    out, impl = run(op, *args)
    counter.served(op, impl.backend)
    if _trains_itself(impl) or not torch.is_grad_enabled() \
            or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return out
    counter.fallback("reference_backward", f"{op}: the {impl.backend} implementation has no registered backward; "
                                   "backward recomputes the torch reference")
    return _ReferenceGrad.apply(out.detach(), reference, *args)
