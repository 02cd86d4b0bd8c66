"""The framework's own code as a backend: the candidate graft must beat.

Each framework integration (vLLM, DeepSpeed, Megatron-core, TorchTitan, a vendor's) returns,
from the ``graft_framework_implementations`` hook, one :class:`~graft.registry.Implementation`
per graft op it replaces, running the code the framework would have run without graft. The
backend is named after the framework (``GRAFT_FUSED_RMS_NORM=vllm`` selects it like any
other), ``graft info`` lists it, and the integrations' call counters count it
(``fused.rms_norm:vllm``).

Ranking (see :mod:`graft.selection`): where no ``GRAFT_*`` variable sets an op's order, a
usable framework implementation ranks first, and a tuning table (:mod:`graft.tuning`) moves
graft's implementation in front only for the shape buckets where it was measured faster.

A framework implementation serves only in a process where it was enabled: by the
framework's integration when it activates (its code is loaded and configured there) or by
``graft tune``, which measures it. Elsewhere it is skipped with that reason, so importing a
framework somewhere in a process never changes what serves graft's public ops.
"""
from __future__ import annotations

import threading
from typing import Callable

from graft.registry import Implementation

_enabled: set = set()
_lock = threading.Lock()


def enable(framework: str) -> None:
    """Let ``framework``'s own implementations serve in this process (its integration calls
    this from ``activate``). Cached decisions are dropped (a cold-path event)."""
    with _lock:
        if framework in _enabled:
            return
        _enabled.add(framework)
    from graft import config

    config.reload()  # plans and static decisions are keyed by the configuration generation


def disable(framework: str) -> None:
    """The reverse of :func:`enable` (tests)."""
    with _lock:
        if framework not in _enabled:
            return
        _enabled.discard(framework)
    from graft import config

    config.reload()


def enabled(framework: str) -> bool:
    return framework in _enabled


def implementation(framework: str, op: str, fn: Callable, description: str = "",
                   devices=frozenset({"cpu", "cuda"}), dtypes=None, check=None,
                   available: Callable[[], "str | None"] | None = None, check_scalars=None) -> Implementation:
    """An implementation of ``op`` by ``framework``'s own code ``fn`` (called with the op's
    arguments, returning the op's result: adapt the framework's calling convention in ``fn``).
    ``available`` adds an environment check of its own (a compiled extension present...);
    ``check``/``check_scalars`` as in :class:`graft.registry.Implementation`."""

    def usable() -> str | None:
        if framework not in _enabled:
            return (f"{framework}'s own code serves only where {framework} runs (its graft integration is not "
                    "active in this process)")
        return available() if available is not None else None

    return Implementation(op=op, backend=framework, fn=fn, description=description or f"{framework}'s own code",
                          devices=frozenset(devices), dtypes=None if dtypes is None else frozenset(dtypes),
                          available=usable, check=check, check_scalars=check_scalars, framework=framework)


def is_framework(impl: Implementation) -> bool:
    return bool(impl.framework)


def framework_backends(registry) -> set:
    """The backend names that are a framework's own code."""
    return {i.backend for impls in registry.impls.values() for i in impls if i.framework}
