"""Run an op through backend selection: validate input, pick an implementation, call it."""
from __future__ import annotations

import logging

from graft import config, selection
from graft.errors import GraftUnsupportedError
from graft.platform import device_info
from graft.plugins import get_registry
from graft.registry import Implementation, key_tensor

log = logging.getLogger("graft.dispatch")


def select(op: str, *args, **kwargs) -> Implementation:
    """The implementation that would serve ``op(*args, **kwargs)``."""
    registry = get_registry()
    spec = registry.op(op)
    tensor = key_tensor(spec, args, kwargs)
    if tensor is None:
        device_type, dtype, arch = "cpu", None, "cpu"
    else:
        device_type, dtype = tensor.device.type, tensor.dtype
        arch = device_info(tensor.device).arch if device_type == "cuda" else device_type
    return selection.decide(registry, op, device_type, dtype, arch, args, kwargs).selected


def call(op: str, *args, **kwargs):
    """Run ``op`` through backend selection; see :func:`run`."""
    return run(op, *args, **kwargs)[0]


def run(op: str, *args, **kwargs):
    """(result, the Implementation that served it, after any fallback).

    Validate the arguments once (the same checks for every backend), then run the selected impl.

    An implementation may find out only when it runs that it cannot serve (a lazy
    extension build that fails, say): it raises GraftUnsupportedError after recording
    why, and the call falls back to the next implementation, with the reason logged,
    unless GRAFT_STRICT=1.
    """
    spec = get_registry().op(op)
    if spec.validate is not None:
        spec.validate(*args, **kwargs)
    impl = select(op, *args, **kwargs)
    try:
        return impl.fn(*args, **kwargs), impl
    except GraftUnsupportedError as exc:
        if impl.backend == config.REFERENCE_BACKEND or config.parse_bool("GRAFT_STRICT", False):
            raise
        selection.reset_caches()
        fallback = select(op, *args, **kwargs)
        if fallback is impl:  # it still claims it can serve: don't loop, report
            raise
        log.warning("%s: %s (%s) failed at run time: %s; using %s", op, impl.backend, impl.provider, exc,
                    fallback.backend)
        return fallback.fn(*args, **kwargs), fallback
