"""Run an op through backend selection: validate input, pick an implementation, call it."""
from __future__ import annotations

from graft.platform import device_info
from graft.plugins import get_registry
from graft.registry import Implementation, key_tensor
from graft.selection import decide


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
    return decide(registry, op, device_type, dtype, arch, args, kwargs).selected


def call(op: str, *args, **kwargs):
    """Validate the arguments once (the same checks for every backend), then run the selected impl."""
    spec = get_registry().op(op)
    if spec.validate is not None:
        spec.validate(*args, **kwargs)
    return select(op, *args, **kwargs).fn(*args, **kwargs)
