"""Expose optimized implementations as ``torch.library`` custom ops.

Each optimized kernel is registered once per process, at import of its module, as
``torch.ops.graft.<name>`` with a fake (meta) implementation, so it can be traced by
``torch.compile`` and checked with ``torch.library.opcheck``::

    attention_prefill_triton = define_op(
        "attention_prefill_triton", _prefill_impl, fake=_prefill_fake)

The real implementation and the fake must take the same annotated arguments (torch
infers the schema from the annotations).
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, Sequence

import torch

NAMESPACE = "graft"


def custom_op_name(op: str, backend: str) -> str:
    """``("attention.prefill", "triton")`` -> ``"attention_prefill_triton"``."""
    return f"{op}.{backend}".replace(".", "_").replace("-", "_")


def define_op(
    name: str,
    fn: Callable,
    fake: Callable,
    mutates_args: Iterable[str] = (),
    device_types: str | Sequence[str] | None = None,
):
    """Register ``fn`` as ``torch.ops.graft.<name>`` with fake impl ``fake``; returns the op."""
    qualname = f"{NAMESPACE}::{name}"
    op = torch.library.custom_op(qualname, fn, mutates_args=tuple(mutates_args), device_types=device_types)
    op.register_fake(fake)
    op.__class__ = _DirectCustomOp  # eager calls that need none of the dispatcher skip it
    op._graft_direct = (fn, None if device_types is None else frozenset(  # type: ignore[attr-defined]
        [device_types] if isinstance(device_types, str) else device_types))
    return op


from torch._library.custom_ops import CustomOpDef as _CustomOpDef  # noqa: E402 (what custom_op returns)


_Tensor = torch.Tensor


def _plain(values, grad: bool) -> bool:
    """Only plain tensors (no subclass) with no gradient to record, or non-tensors (one level
    of lists: tensor-list arguments)."""
    for value in values:
        if type(value) is _Tensor:
            if grad and value.requires_grad:
                return False
        elif isinstance(value, torch.Tensor):
            return False
        elif type(value) in (list, tuple) and not _plain(value, grad):
            return False
    return True


def _device_type(args) -> str | None:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0].device.type
    return None


_is_compiling = torch.compiler.is_compiling
_mode_on = torch._C._is_torch_function_mode_enabled
_transforms_on = torch._C._are_functorch_transforms_active
_grad_on = torch.is_grad_enabled


class _DirectCustomOp(_CustomOpDef):  # type: ignore[misc, valid-type]
    """A graft custom op whose eager call runs its function directly when the dispatcher
    would add nothing but cost (about 10-15 us a call on the CPU through ``torch.ops``): no
    tracing (torch.compile, fake or other dispatch modes, torch function modes, functorch
    transforms), only plain tensors, and no gradient to record. Everything else goes through
    ``torch.ops.graft.<name>`` as before: its fake impl, registered backward and schema."""

    def __call__(self, *args, **kwargs):
        fn, devices = self._graft_direct
        if (fn is not None and not _is_compiling() and _dispatch_mode() is None and not _mode_on()
                and not _transforms_on()):
            grad = _grad_on()
            if _plain(args, grad) and (not kwargs or _plain(kwargs.values(), grad)) and (
                    devices is None or _device_type(args) in devices):
                return fn(*args, **kwargs)
        return self._opoverload(*args, **kwargs)

    def register_kernel(self, *args, **kwargs):  # another kernel: always through the dispatcher
        self._graft_direct = (None, None)
        return super().register_kernel(*args, **kwargs)


from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode  # noqa: E402


# Qualified names ("graft::fused_rms_norm_triton") of custom ops with a registered backward.
_WITH_BACKWARD: set = set()


def _qualname(op) -> str:
    return getattr(op, "_qualname", None) or str(op)


def register_backward(op, backward: Callable, setup_context: Callable, *, name: str | None = None) -> None:
    """Register ``op``'s backward with ``torch.library.register_autograd`` and record it,
    so that callers (the Megatron modules, the gradient conformance) know the op trains
    without a reference recompute. ``backward`` should itself call custom ops (with fake
    impls) so that it traces under ``torch.compile``.

    Such a backward is a kernel (or products of gradients the forward saved): it cannot be
    differentiated again. Under ``create_graph=True`` its gradients are therefore made to
    raise "no double backward for <op> on <backend>" when differentiated, instead of
    silently contributing nothing (torch's ``once_differentiable``, with a message that
    names the op). ``name`` is "<op> on <backend>"; by default it is read from the custom
    op's name (``graft::loss_fused_linear_cross_entropy_triton``)."""
    qualname = _qualname(op)
    described = name or _describe(qualname)
    op_name = described.split(" ")[0]
    var = "GRAFT_" + op_name.upper().replace(".", "_")  # graft.config.op_env_var (not imported here)
    message = (f"no double backward for {described} ({qualname}): its backward is a kernel that cannot be "
               f"differentiated again; for higher-order gradients select the torch backend "
               f"({var}=torch) or differentiate the op's reference").encode()

    def backward_once(ctx, *grads):
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return backward(ctx, *grads)
        # create_graph=True: the double-backward graph is being built.
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        defined = [i for i, g in enumerate(outputs) if isinstance(g, torch.Tensor)]
        if not defined:
            return outputs[0] if single else outputs
        from torch._C import _functions

        # The op's inputs go in too, so that differentiating these gradients with respect
        # to any input reaches the error (rather than "appears to not have been used").
        inputs = [t for t in (ref() for ref in getattr(ctx, "_graft_inputs", ())) if t is not None]
        err = _functions.DelayedError(message, len(defined) + len(inputs))
        wrapped = err(*[outputs[i].detach().requires_grad_(True) for i in defined], *inputs)
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        result = list(outputs)
        for i, g in zip(defined, wrapped):
            result[i] = g
        return result[0] if single else tuple(result)

    def setup_and_keep_inputs(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        # Weakly: the forward must not keep its inputs alive for a backward that rarely
        # builds a graph (one still alive then is what a double backward differentiates).
        ctx._graft_inputs = tuple(weakref.ref(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)

    torch.library.register_autograd(qualname, backward_once, setup_context=setup_and_keep_inputs)
    _WITH_BACKWARD.add(qualname)


def _describe(qualname: str) -> str:
    """``graft::fused_rms_norm_triton`` -> ``fused.rms_norm on triton``."""
    parts = qualname.split("::")[-1].split("_")
    if len(parts) < 3:
        return qualname
    return f"{parts[0]}.{'_'.join(parts[1:-1])} on {parts[-1]}"


def has_backward(op) -> bool:
    """True when ``op`` (a graft custom op) has a backward registered through :func:`register_backward`."""
    return op is not None and _qualname(op) in _WITH_BACKWARD


def _double_backward_message(described: str, detail: str) -> bytes:
    return (f"no double backward for {described} ({detail}); for higher-order gradients differentiate "
            f"the op's torch reference (graft.plugins.get_registry().op(name).reference)").encode()


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on the inputs of a composite torch computation whose own backward cannot be
    differentiated again (torch's fused SDPA kernels): first-order gradients pass through
    unchanged; under ``create_graph=True`` they are made to raise the named error when
    differentiated, instead of torch's "derivative for aten::<kernel>_backward is not
    implemented" (which names no graft op)."""

    @staticmethod
    def forward(ctx, message, *tensors):
        ctx.message = message
        ctx.save_for_backward(*tensors)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.is_grad_enabled():
            return (None, *grads)
        from torch._C import _functions

        defined = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        if not defined:
            return (None, *grads)
        inputs = [t for t in ctx.saved_tensors if t.requires_grad]
        err = _functions.DelayedError(ctx.message, len(defined) + len(inputs))
        wrapped = err(*[grads[i].detach().requires_grad_(True) for i in defined], *inputs)
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        result = list(grads)
        for i, g in zip(defined, wrapped):
            result[i] = g
        return (None, *result)


def no_double_backward(described: str, detail: str, *tensors: torch.Tensor) -> tuple:
    """``tensors`` unchanged, except that when a gradient is being recorded through them the
    gradients they receive raise "no double backward for <described> (<detail>)" if
    differentiated again (``described`` is "<op> on <backend>"). For composite torch code
    whose kernels have no double backward; a no-op (the same tensors) when no input needs
    a gradient or under ``torch.compile``."""
    if (not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)
            or torch.compiler.is_compiling()):
        return tensors
    return _NoDoubleBackward.apply(_double_backward_message(described, detail), *tensors)
