"""Backend selection: which implementation serves a request, and why.

Order of candidates for an op:

1. the op's priority list (``GRAFT_<OP>``), else its family's (``GRAFT_<FAMILY>``),
   else ``GRAFT_BACKENDS``, else the default ``hip,triton,torch``;
2. backends not in that list follow in default order (so a list only reorders);
3. the torch reference is last unless the list names it earlier;
4. where no variable set the order, a framework's own implementation that can serve
   (``graft.framework_backend``: enabled where the framework runs) comes first; a tuning
   table (``graft.tuning``, read by dispatch) puts graft's first for the shape buckets
   where it was measured faster.

A candidate is skipped when it is disabled, cannot serve the device/dtype/arch, is
unavailable in this environment, or rejects the call's arguments. Skipping a backend
the user asked for explicitly is logged once as a warning (with ``GRAFT_STRICT=1`` it
raises instead); routine skips are logged once at INFO.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from graft import config
from graft.errors import GraftUnsupportedError
from graft.platform import dtype_name
from graft.registry import Implementation, Registry

log = logging.getLogger("graft.selection")

FRAMEWORK_FIRST = "default (the framework's own code first: graft serves where a tuning table or a GRAFT_* variable says)"

_logged: set = set()
_static_cache: dict = {}
_settings_cache: dict = {}  # (registry id, device type, arch, config generation) -> Settings


@dataclass
class Candidate:
    impl: Implementation
    reason: str | None  # None: can serve


@dataclass
class Decision:
    op: str
    selected: Implementation | None
    candidates: list = field(default_factory=list)
    source: str = "default"  # which variable decided the order
    requested: tuple = ()  # the explicit priority list, if a variable set one

    @property
    def fell_back(self) -> bool:
        """True when an explicitly requested first-choice backend could not serve."""
        return bool(self.requested) and self.selected is not None and self.selected.backend != self.requested[0]

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "selected": None if self.selected is None else _impl_dict(self.selected),
            "source": self.source,
            "requested": list(self.requested),
            "fell_back": self.fell_back,
            "candidates": [dict(_impl_dict(c.impl), usable=c.reason is None, reason=c.reason) for c in self.candidates],
        }


def _impl_dict(impl: Implementation) -> dict:
    return {"backend": impl.backend, "provider": impl.provider, "description": impl.description,
            "checks_each_call": impl.check is not None}


def _ordered_backends(priority: tuple, default: tuple, registry_backends: set) -> list:
    order = [b for b in priority]
    for b in tuple(default) + tuple(sorted(registry_backends)):
        if b not in order and b != config.REFERENCE_BACKEND:
            order.append(b)
    if config.REFERENCE_BACKEND not in order:
        order.append(config.REFERENCE_BACKEND)
    return order


def settings_for(registry: Registry, device_type: str, arch) -> config.Settings:
    """The parsed selection settings for a device, cached per configuration generation."""
    generation = config.current().generation
    key = (id(registry), device_type, arch, generation)
    settings = _settings_cache.get(key)
    if settings is None:
        default = registry.default_priority(device_type, arch) if registry.default_priority else None
        settings = config.load_settings(registry.backends(), registry.families(), default_priority=default)
        _settings_cache[key] = settings
    return settings


def _static_candidates(registry: Registry, op: str, device_type: str, dtype, arch):
    """Candidates in priority order with their static reasons; cached per config generation."""
    key = (id(registry), len(registry.impls.get(op, ())), op, device_type, dtype, arch, config.current().generation)
    hit = _static_cache.get(key)
    if hit is not None:
        return hit
    spec = registry.op(op)
    settings = settings_for(registry, device_type, arch)
    priority, var = settings.priority_for(op, spec.family)
    requested = tuple(priority) if var is not None else ()
    if var is None:  # no variable chose the order: the per-op default (measured preferences) applies
        from graft import priorities

        priority, why = priorities.apply(op, device_type, tuple(priority))
        var = f"default (graft.priorities: {why})" if why else None
    by_backend: dict = {}
    for impl in registry.implementations(op):
        by_backend.setdefault(impl.backend, []).append(impl)
    candidates = []
    whole_op_off = settings.is_disabled("all", op, spec.family)
    op_rejects = None
    if dtype is not None and spec.dtypes and dtype not in spec.dtypes:
        accepted = ", ".join(dtype_name(d) for d in spec.dtypes)
        op_rejects = f"{op} does not accept dtype {dtype_name(dtype)} (accepts {accepted})"
    for backend in _ordered_backends(tuple(priority), settings.global_priority, set(by_backend)):
        for impl in by_backend.get(backend, []):
            off = settings.is_disabled(backend)
            if op_rejects:
                reason = op_rejects
            elif whole_op_off and backend != config.REFERENCE_BACKEND:
                reason = f"disabled by GRAFT_DISABLE={whole_op_off}"
            elif off and backend != config.REFERENCE_BACKEND:
                reason = f"disabled by GRAFT_DISABLE={off}"
            else:
                reason = impl.static_reason(device_type, dtype, arch)
            candidates.append(Candidate(impl, reason))
    if var is None or var.startswith("default"):
        # No variable chose the order: the framework's own code serves first where it can
        # (graft.framework_backend); a tuning table moves graft's in front per shape bucket.
        first = [c for c in candidates if c.impl.framework and c.reason is None]
        if first:
            candidates = first + [c for c in candidates if not any(c is f for f in first)]
            var = FRAMEWORK_FIRST
    # Requested backends with no implementation of this op at all: GRAFT_STRICT=1 refuses
    # to run anything ranked below them.
    missing = tuple(b for b in requested if b not in by_backend)
    result = (candidates, var or "default", requested, settings.strict, missing)
    if len(_static_cache) > 4096:
        _static_cache.clear()
    _static_cache[key] = result
    return result


def _log_once_eager(level: int, key: str, message: str) -> None:
    # No lock: a rare race between threads only logs a line twice.
    if key in _logged:
        return
    _logged.add(key)
    log.log(level, message)


def _define_log_op() -> None:
    # Under torch.compile selection runs while Dynamo traces, where Python logging would
    # break the graph (or, inlined, be dropped silently). A side-effecting custom op is kept
    # in the graph and logs when the compiled graph runs, still once per key.
    from graft.custom_ops import define_op

    op = define_op("selection_log", _log_once_eager, fake=lambda level, key, message: None)
    torch.fx.node.has_side_effect(op._opoverload)


_define_log_op()


def _log_once(level: int, key: tuple, message: str) -> None:
    if torch.compiler.is_compiling():
        torch.ops.graft.selection_log(level, repr(key), message)
    else:
        _log_once_eager(level, repr(key), message)


def decide(
    registry: Registry,
    op: str,
    device_type: str = "cpu",
    dtype: torch.dtype | None = None,
    arch: str | None = None,
    args: tuple | None = None,
    kwargs: dict | None = None,
) -> Decision:
    """Choose the implementation for one request. ``args`` enables per-call checks."""
    static, source, requested, strict, missing = _static_candidates(registry, op, device_type, dtype, arch)
    candidates = []
    selected = None
    for cand in static:
        reason = cand.reason
        if reason is None and args is not None and cand.impl.check is not None:
            reason = cand.impl.call_reason(args, kwargs or {})
        candidates.append(Candidate(cand.impl, reason))
        if reason is None and selected is None:
            selected = cand.impl
    decision = Decision(op, selected, candidates, source, requested)
    if selected is None:
        raise GraftUnsupportedError(f"no implementation of {op} can serve this request:\n" + _reasons(candidates))
    if strict:
        check_missing(op, source, requested, missing, selected.backend)
    # Only candidates ranked above the selected one were really passed over.
    for cand in candidates[: candidates.index(next(c for c in candidates if c.impl is selected))]:
        explicit = cand.impl.backend in requested
        if explicit and strict:
            raise GraftUnsupportedError(
                f"{source} asks for backend {cand.impl.backend!r} for {op}, which cannot serve this request "
                f"({cand.reason}); GRAFT_STRICT=1 forbids falling back"
            )
        level = logging.WARNING if explicit else logging.INFO
        _log_once(
            level,
            (op, cand.impl.key, cand.reason, level),  # an explicit request still warns after a routine INFO
            f"{op}: {cand.impl.backend} ({cand.impl.provider}) skipped: {cand.reason}; using {selected.backend}",
        )
    return decision


def check_missing(op: str, source: str, requested: tuple, missing: tuple, selected_backend: str) -> None:
    """Under GRAFT_STRICT=1, refuse when a requested backend ranked above the selected one
    has no implementation of ``op`` at all."""
    for backend in requested:
        if backend == selected_backend:
            return
        if backend in missing:
            raise GraftUnsupportedError(
                f"{source} asks for backend {backend!r} for {op}, which has no {backend} implementation; "
                f"GRAFT_STRICT=1 forbids falling back to {selected_backend!r}"
            )


def _reasons(candidates) -> str:
    return "\n".join(f"  - {c.impl.backend} ({c.impl.provider}): {c.reason}" for c in candidates) or "  (no implementations)"


def explain(registry: Registry, op: str, device=None, dtype=None, arch=None) -> Decision:
    """What would serve ``op`` on ``device`` (default: this machine's) for ``dtype``;
    ``arch`` ("sm_90", "gfx942") asks about a GPU this machine need not have."""
    from graft.platform import device_info

    info = device_info(device, arch=arch)
    try:
        return decide(registry, op, info.type, dtype, info.arch)
    except GraftUnsupportedError:
        static, source, requested, _, _ = _static_candidates(registry, op, info.type, dtype, info.arch)
        return Decision(op, None, list(static), source, requested)


def reset_caches() -> None:
    """Forget cached decisions and which messages were logged, and read the GRAFT_*
    variables again (tests, and code that changed os.environ, use this)."""
    config.reload()
    _static_cache.clear()
    _settings_cache.clear()
    _logged.clear()
    for listener in list(_reset_listeners):
        listener()


def forget(op: str | None = None) -> None:
    """Drop cached decisions for ``op`` (None: every op) without reading the environment
    again: an implementation found out at run time that it cannot serve (its static
    reason now says why), so the next call decides again under the configuration in force.
    Which messages were logged is kept. With ``op`` None, the caches built on top of
    selection (dispatch's plans) are dropped too; for one op, dispatch drops its own."""
    if op is None:
        _static_cache.clear()
        for listener in list(_reset_listeners):
            listener()
        return
    for key in [k for k in list(_static_cache) if k[2] == op]:
        _static_cache.pop(key, None)


# Caches built on top of selection (dispatch's per-call plans) register here.
_reset_listeners: list = []


def on_reset(listener) -> None:
    _reset_listeners.append(listener)


def _on_reload(snapshot) -> None:
    # Cached decisions are keyed by generation; drop the stale ones now rather than let
    # them accumulate. Which messages were logged is kept: a reload is not a reset.
    _static_cache.clear()
    _settings_cache.clear()
    for listener in list(_reset_listeners):
        listener()


config.on_reload(_on_reload)
