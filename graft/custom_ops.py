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
    return op


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
