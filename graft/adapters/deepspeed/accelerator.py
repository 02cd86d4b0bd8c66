"""``GraftAccelerator``: wraps the accelerator DeepSpeed picked (CUDA, ROCm, CPU, ...)
and delegates everything to it, except the op builders graft serves.

DeepSpeed reaches every device-specific service through ``get_accelerator()``, and every
compiled op through ``get_accelerator().get_op_builder(name)``. Wrapping (rather than
subclassing one vendor's accelerator) keeps device handling, streams, memory and the
communication backend name exactly what DeepSpeed chose on this machine.
"""
from __future__ import annotations

import inspect

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from graft.adapters.deepspeed import op_builders

# Device types graft op dispatch serves (graft.registry.reference_impl runs on these).
SERVED_DEVICES = ("cpu", "cuda")


def _forward_method(name):
    def method(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Delegates to the wrapped accelerator's {name}()."
    return method


def _forward_attribute(name):
    return property(lambda self: getattr(self._inner, name), lambda self, value: setattr(self._inner, name, value))


class GraftAccelerator(DeepSpeedAccelerator):
    """A DeepSpeed accelerator that is the wrapped one, with graft's op builders."""

    def __init__(self, inner: DeepSpeedAccelerator):
        # Not calling DeepSpeedAccelerator.__init__: it would shadow the inner _name & co.
        object.__setattr__(self, "_inner", inner)
        # DeepSpeed calls its accelerator hundreds of times a step (synchronize, streams,
        # device_count...): the inner accelerator's bound methods go straight into this
        # instance, so a forwarded call costs nothing over calling the accelerator itself.
        for name in _FORWARDED_METHODS:
            object.__setattr__(self, name, getattr(inner, name))

    @property
    def inner(self) -> DeepSpeedAccelerator:
        return self._inner

    def __getattr__(self, name):
        # Only reached for names this class does not define: methods that exist on one
        # vendor's accelerator only (visible_devices_envs, get_compile_backend...) and the
        # _name / _communication_backend_name attributes.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def __repr__(self):
        return f"GraftAccelerator({self._inner.__class__.__name__})"

    # -- the part graft changes ---------------------------------------------------------

    def graft_serves(self, class_name: str) -> bool:
        return class_name in op_builders.BUILDERS and self._inner.device_name() in SERVED_DEVICES

    def get_op_builder(self, class_name):
        if self.graft_serves(class_name):
            return op_builders.BUILDERS[class_name]
        return self._inner.get_op_builder(class_name)

    def create_op_builder(self, class_name):
        if self.graft_serves(class_name):
            return op_builders.BUILDERS[class_name]()
        return self._inner.create_op_builder(class_name)


_FORWARDED_METHODS: list = []


def _install_delegates():
    """Forward every method and attribute of the abstract accelerator to the wrapped one.

    The base class defines concrete methods too (pin_memory, is_fp64_supported...); an
    accelerator may override them, so they are forwarded explicitly instead of relying on
    ``__getattr__`` (which Python only consults for missing names).
    """
    own = set(vars(GraftAccelerator))
    for name, value in inspect.getmembers(DeepSpeedAccelerator):
        if name in own or (name.startswith("__") and name.endswith("__")) or name.startswith("_abc"):
            continue
        if callable(value) and not isinstance(value, type):
            setattr(GraftAccelerator, name, _forward_method(name))
            _FORWARDED_METHODS.append(name)
        else:
            setattr(GraftAccelerator, name, _forward_attribute(name))
    GraftAccelerator.__abstractmethods__ = frozenset()


_install_delegates()
