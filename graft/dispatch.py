"""Run an op through backend selection: validate input, pick an implementation, call it.

The hot path does no work that can be done once. Per (op, device, dtype) a *plan* is
built on the first call and kept until the configuration is reloaded or the caches are
reset: the implementations that can serve statically, in priority order, up to the first
one without a per-call check. A call then costs the op's input validation, one dict
lookup and the per-call checks of the impls ranked above the chosen one.
"""
from __future__ import annotations

import logging

import torch

from graft import config, selection
from graft.errors import GraftUnsupportedError
from graft.platform import device_info
from graft.plugins import get_registry
from graft.registry import Implementation, key_tensor

log = logging.getLogger("graft.dispatch")


class _Plan:
    """What serves one (op, device, dtype): statically usable impls in order."""

    __slots__ = ("impls", "error", "first", "source", "requested", "strict", "missing")

    def __init__(self, impls, error, source, requested, strict, missing):
        self.impls = impls  # tuple of Implementation, ending at the first one without a check
        self.error = error  # GraftUnsupportedError to raise on every call, or None
        # The common case, one impl and no per-call check: no loop at all.
        self.first = impls[0] if len(impls) == 1 and impls[0].check is None and not (strict and missing) else None
        self.source = source
        self.requested = requested
        self.strict = strict
        self.missing = missing


_plans: dict = {}  # (op, device, dtype) -> _Plan
_entries: dict = {}  # op -> (spec, validate, key_arg)


def _clear() -> None:
    _plans.clear()
    _entries.clear()


selection.on_reset(_clear)


def _entry(op: str):
    entry = _entries.get(op)
    if entry is None:
        spec = get_registry().op(op)
        entry = (spec, spec.validate, spec.key_arg)
        _entries[op] = entry
    return entry


def _build_plan(op: str, device, dtype) -> _Plan:
    registry = get_registry()
    if device is None:
        device_type, arch = "cpu", "cpu"
    else:
        device_type = device.type
        arch = device_info(device).arch if device_type == "cuda" else device_type
    static, source, requested, strict, missing = selection._static_candidates(registry, op, device_type, dtype, arch)
    usable = []
    for cand in static:
        if cand.reason is None:
            usable.append(cand.impl)
            if cand.impl.check is None:
                break
    error = None
    if not usable:
        error = GraftUnsupportedError(
            f"no implementation of {op} can serve this request:\n" + selection._reasons(static))
    else:
        # Statically skipped candidates ranked above the first usable one are logged (or,
        # when explicitly requested under GRAFT_STRICT=1, refused) once, here.
        try:
            selection.decide(registry, op, device_type, dtype, arch)
        except GraftUnsupportedError as exc:
            if strict:
                error = exc
    plan = _Plan(tuple(usable), error, source, requested, strict, missing)
    _plans[(op, device, dtype)] = plan
    return plan


def _choose(op: str, plan: _Plan, args, kwargs) -> Implementation:
    if plan.error is not None:
        raise plan.error
    for impl in plan.impls:
        reason = None if impl.check is None else impl.call_reason(args, kwargs)
        if reason is None:
            if plan.strict:
                selection.check_missing(op, plan.source, plan.requested, plan.missing, impl.backend)
            return impl
        _passed_over(op, plan, impl, reason)
    # Every impl has a per-call check and all declined: explain with the full decision.
    raise GraftUnsupportedError(f"no implementation of {op} can serve this request:\n"
                                + "\n".join(f"  - {i.backend} ({i.provider}): declined this call" for i in plan.impls))


def _passed_over(op: str, plan: _Plan, impl: Implementation, reason: str) -> None:
    explicit = impl.backend in plan.requested
    if explicit and plan.strict:
        raise GraftUnsupportedError(
            f"{plan.source} asks for backend {impl.backend!r} for {op}, which cannot serve this request "
            f"({reason}); GRAFT_STRICT=1 forbids falling back"
        )
    level = logging.WARNING if explicit else logging.INFO
    selection._log_once(level, (op, impl.key, reason, level),
                        f"{op}: {impl.backend} ({impl.provider}) skipped: {reason}; using the next candidate")


def _plan_for(op: str, spec, key_arg: int, args, kwargs) -> _Plan:
    tensor = args[key_arg] if len(args) > key_arg else None
    if not isinstance(tensor, torch.Tensor):
        tensor = key_tensor(spec, args, kwargs)
    if tensor is None:
        device = dtype = None
    else:
        device, dtype = tensor.device, tensor.dtype
    plan = _plans.get((op, device, dtype))
    if plan is None:
        plan = _build_plan(op, device, dtype)
    return plan


def select(op: str, *args, **kwargs) -> Implementation:
    """The implementation that would serve ``op(*args, **kwargs)`` (runs per-call checks, not the op)."""
    spec, _, key_arg = _entry(op)
    return _choose(op, _plan_for(op, spec, key_arg, args, kwargs), args, kwargs)


def run(op: str, *args, **kwargs):
    """Validate, select and run ``op``; returns ``(result, impl)``, ``impl`` being the
    implementation that produced the result (after any run-time fallback).

    Integrations use this to count what served a call without selecting twice.
    """
    entry = _entries.get(op)
    if entry is None:
        entry = _entry(op)
    spec, validate, key_arg = entry
    if validate is not None:
        validate(*args, **kwargs)
    # _plan_for, inlined: this is the per-call path.
    tensor = args[key_arg] if len(args) > key_arg else None
    if isinstance(tensor, torch.Tensor):
        key = (op, tensor.device, tensor.dtype)
        plan = _plans.get(key)
        if plan is None:
            plan = _build_plan(op, tensor.device, tensor.dtype)
    else:
        plan = _plan_for(op, spec, key_arg, args, kwargs)
    impl = plan.first
    if impl is None:
        impl = _choose(op, plan, args, kwargs)
    try:
        out = impl.fn(*args, **kwargs)
    except GraftUnsupportedError as exc:
        return _fall_back(op, impl, exc, args, kwargs)
    if plan.strict and impl.backend != config.REFERENCE_BACKEND:
        verify_output(spec, impl, out, args, kwargs)
    return out, impl


def _expected_output(spec, args, kwargs):
    """The reference's output shapes and dtypes for these arguments, computed on fake
    tensors (no real work), or None when the reference cannot run on fake tensors (it
    reads values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
            return spec.reference(*tree_map(fake, args), **tree_map(fake, kwargs))
    except Exception:
        return None


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


def _same_meta(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
    if isinstance(want, (tuple, list)):
        return (isinstance(got, (tuple, list)) and len(got) == len(want)
                and all(_same_meta(g, w) for g, w in zip(got, want)))
    return (got is None) == (want is None)


def verify_output(spec, impl: Implementation, out, args, kwargs) -> None:
    """Raise GraftError when ``out`` does not have the shapes and dtypes the op's reference
    gives for these arguments (GRAFT_STRICT=1 and conformance check every implementation)."""
    from graft.errors import GraftError

    want = _expected_output(spec, args, kwargs)
    if want is None or _same_meta(out, want):
        return
    raise GraftError(
        f"{spec.name}: {impl.backend} ({impl.provider}) returned {_describe(out)}, but the op's reference "
        f"gives {_describe(want)} for these arguments; the implementation is wrong"
    )


def call(op: str, *args, **kwargs):
    """Validate the arguments once (the same checks for every backend), then run the selected impl.

    An implementation may find out only when it runs that it cannot serve (a lazy
    extension build that fails, say): it raises GraftUnsupportedError after recording
    why, and the call falls back to the next implementation, with the reason logged,
    unless GRAFT_STRICT=1.
    """
    return run(op, *args, **kwargs)[0]


def _fall_back(op: str, impl: Implementation, exc: Exception, args, kwargs):
    if impl.backend == config.REFERENCE_BACKEND or config.parse_bool("GRAFT_STRICT", False):
        raise exc
    selection.reset_caches()
    fallback = select(op, *args, **kwargs)
    if fallback is impl:  # it still claims it can serve: don't loop, report
        raise exc
    log.warning("%s: %s (%s) failed at run time: %s; using %s", op, impl.backend, impl.provider, exc,
                fallback.backend)
    return fallback.fn(*args, **kwargs), fallback
