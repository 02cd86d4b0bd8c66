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


def register_backward(op, backward: Callable, setup_context: Callable) -> None:
    """Register ``op``'s backward with ``torch.library.register_autograd`` and record it,
    so that callers (the Megatron modules, the gradient conformance) know the op trains
    without a reference recompute. ``backward`` should itself call custom ops (with fake
    impls) so that it traces under ``torch.compile``."""
    torch.library.register_autograd(_qualname(op), backward, setup_context=setup_context)
    _WITH_BACKWARD.add(_qualname(op))


def has_backward(op) -> bool:
    """True when ``op`` (a graft custom op) has a backward registered through :func:`register_backward`."""
    return op is not None and _qualname(op) in _WITH_BACKWARD
