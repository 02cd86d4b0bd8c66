"""Backend selection, in one place: which implementation serves a call, and why.

Everything that decides is here; dispatch only caches the answer (per op, device, dtype,
and per tuned shape bucket). The order of candidates for an op:

1. the op's priority list (``GRAFT_<OP>``), else its family's (``GRAFT_<FAMILY>``), else
   ``GRAFT_BACKENDS`` (:attr:`Origin.OP_VARIABLE` ... :attr:`Origin.GLOBAL_VARIABLE`);
2. else the installed plugins' default order (``graft_default_backend_priority``,
   :attr:`Origin.PLUGIN_DEFAULT`), else the shipped default ``hip,triton,torch``
   (:attr:`Origin.SHIPPED_DEFAULT`);
3. backends not in that list follow in default order (a list only reorders), and the torch
   reference is last unless the list names it earlier;
4. where no variable set the order, a framework's own implementation that can serve
   (:mod:`graft.framework_backend`) comes first (:attr:`Origin.FRAMEWORK_FIRST`), unless a
   tuning table (:mod:`graft.tuning`) has an entry for the call's shape bucket: then the
   entry's backend comes first (:attr:`Origin.TUNING_TABLE`).

A candidate is skipped when it is disabled, cannot serve the device/dtype/arch, is
unavailable in this environment, or rejects the call's arguments. Skipping a backend
the user asked for explicitly is logged once as a warning (with ``GRAFT_STRICT=1`` it
raises instead); routine skips are logged once at INFO.

Whether a framework integration replaces a layer at all is decided here too
(:func:`graft_wanted`, :func:`op_unavailable`): graft steps aside where it is not known
faster. No other module reads the priority settings or a tuning table's choices
(tests/test_selection_one_room.py checks it).
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field

import torch

from graft import config, tuning
from graft.errors import GraftError, GraftUnsupportedError
from graft.platform import default_device, device_info, dtype_name
from graft.registry import Implementation, Registry, key_tensor

log = logging.getLogger("graft.selection")

FRAMEWORK_FIRST = "default (the framework's own code first: graft serves where a tuning table or a GRAFT_* variable says)"


class Origin(enum.Enum):
    """What set the order of an op's candidates (decisions compare these, never message text)."""

    OP_VARIABLE = "GRAFT_<OP>"
    FAMILY_VARIABLE = "GRAFT_<FAMILY>"
    GLOBAL_VARIABLE = "GRAFT_BACKENDS"
    PLUGIN_DEFAULT = "the installed plugins' default order"
    SHIPPED_DEFAULT = "graft's default order (hip, triton, torch)"
    FRAMEWORK_FIRST = "the framework's own code first (graft is not known faster here)"
    TUNING_TABLE = "a tuning table entry for the call's shape bucket"

    @property
    def explicit(self) -> bool:
        """Set by a GRAFT_* variable: never reordered by a default, framework or table."""
        return self in (Origin.OP_VARIABLE, Origin.FAMILY_VARIABLE, Origin.GLOBAL_VARIABLE)


_logged: set = set()
_static_cache: dict = {}
_settings_cache: dict = {}  # (registry id, device type, arch, config generation) -> Settings


@dataclass
class Candidate:
    impl: Implementation
    reason: str | None  # None: can serve


@dataclass(frozen=True)
class Static:
    """What selection knows before seeing a call's arguments, for one (op, device, dtype)."""

    op: str
    candidates: tuple  # Candidate, in order, each with its static reason
    origin: Origin
    source: str  # the variable that set the order, or "default", or FRAMEWORK_FIRST
    requested: tuple  # the explicit priority list, if a variable set one
    strict: bool
    missing: tuple  # requested backends with no implementation of the op at all
    table: dict | None  # tuning choices per shape bucket (None: no entry, or a variable set the order)

    def usable(self) -> list:
        return [c.impl for c in self.candidates if c.reason is None]


@dataclass
class Decision:
    op: str
    selected: Implementation | None
    candidates: list = field(default_factory=list)
    source: str = "default"  # which variable decided the order (text, for people)
    requested: tuple = ()  # the explicit priority list, if a variable set one
    origin: Origin = Origin.SHIPPED_DEFAULT
    choice: tuning.Choice | None = None  # the tuning table entry that put the selected one first
    bucket: str | None = None  # the call's shape bucket (explain_call)

    @property
    def fell_back(self) -> bool:
        """True when an explicitly requested first-choice backend could not serve."""
        return bool(self.requested) and self.selected is not None and self.selected.backend != self.requested[0]

    @property
    def why(self) -> str:
        """One line: why the selected implementation serves."""
        if self.selected is None:
            return "no implementation can serve"
        if self.origin is Origin.TUNING_TABLE and self.choice is not None:
            ratio = self.choice.ratio
            faster = f", {ratio:.2f}x faster" if isinstance(ratio, (int, float)) and math.isfinite(ratio) else ""
            return f"tuning table {self.choice.source}: entry {self.choice.bucket!r} names {self.choice.backend}{faster}"
        if self.origin.explicit:
            text = f"{self.source}={','.join(self.requested)}"
        else:
            text = self.origin.value
        passed = [c.impl.backend for c in self.candidates[: self._index()] if c.reason]
        if passed:  # each candidate's reason is in self.candidates
            text += "; passed over (cannot serve here): " + ", ".join(dict.fromkeys(passed))
        return text

    def _index(self) -> int:
        for i, c in enumerate(self.candidates):
            if c.impl is self.selected:
                return i
        return len(self.candidates)

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "selected": None if self.selected is None else _impl_dict(self.selected),
            "source": self.source,
            "origin": self.origin.name,
            "why": self.why,
            "bucket": self.bucket,
            "table_entry": None if self.choice is None else {
                "backend": self.choice.backend, "provider": self.choice.provider, "ratio": self.choice.ratio,
                "table": self.choice.source, "bucket": self.choice.bucket},
            "requested": list(self.requested),
            "fell_back": self.fell_back,
            "candidates": [dict(_impl_dict(c.impl), usable=c.reason is None, reason=c.reason) for c in self.candidates],
        }


def _impl_dict(impl: Implementation) -> dict:
    return {"backend": impl.backend, "provider": impl.provider, "description": impl.description,
            "checks_each_call": impl.check is not None}


def device_key(device) -> tuple:
    """(device type, arch) that selection decides for, from a torch.device (None: cpu)."""
    if device is None:
        return "cpu", "cpu"
    if device.type == "cuda":
        return "cuda", device_info(device).arch
    return device.type, device.type


def _ordered_backends(priority: tuple, default: tuple, registry_backends: set) -> list:
    order = [b for b in priority]
    for b in tuple(default) + tuple(sorted(registry_backends)):
        if b not in order and b != config.REFERENCE_BACKEND:
            order.append(b)
    if config.REFERENCE_BACKEND not in order:
        order.append(config.REFERENCE_BACKEND)
    return order


def _plugin_default(registry: Registry, device_type: str, arch):
    return registry.default_priority(device_type, arch) if registry.default_priority else None


def settings_for(registry: Registry, device_type: str = "cpu", arch=None) -> config.Settings:
    """The parsed selection settings for a device, cached per configuration generation
    (GraftConfigError when a variable is invalid)."""
    generation = config.current().generation
    key = (id(registry), device_type, arch, generation)
    settings = _settings_cache.get(key)
    if settings is None:
        settings = config.load_settings(registry.backends(), registry.families(),
                                        default_priority=_plugin_default(registry, device_type, arch))
        _settings_cache[key] = settings
    return settings


def _origin_of(op: str, var: str | None, plugin_default) -> Origin:
    if var is None:
        return Origin.PLUGIN_DEFAULT if plugin_default else Origin.SHIPPED_DEFAULT
    if var == "GRAFT_BACKENDS":
        return Origin.GLOBAL_VARIABLE
    return Origin.OP_VARIABLE if var == config.op_env_var(op) else Origin.FAMILY_VARIABLE


def static(registry: Registry, op: str, device_type: str, dtype, arch) -> Static:
    """Candidates in priority order with their static reasons; cached per config generation."""
    key = (id(registry), len(registry.impls.get(op, ())), op, device_type, dtype, arch, config.current().generation)
    hit = _static_cache.get(key)
    if hit is not None:
        return hit
    spec = registry.op(op)
    settings = settings_for(registry, device_type, arch)
    priority, var = settings.priority_for(op, spec.family)
    origin = _origin_of(op, var, _plugin_default(registry, device_type, arch))
    requested = tuple(priority) if origin.explicit else ()
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
    source = var or "default"
    if not origin.explicit:
        # No variable chose the order: the framework's own code serves first where it can
        # (graft.framework_backend); a tuning table moves graft's in front per shape bucket.
        first = [c for c in candidates if c.impl.framework and c.reason is None]
        if first:
            candidates = first + [c for c in candidates if not any(c is f for f in first)]
            origin, source = Origin.FRAMEWORK_FIRST, FRAMEWORK_FIRST
    # Requested backends with no implementation of this op at all: GRAFT_STRICT=1 refuses
    # to run anything ranked below them.
    missing = tuple(b for b in requested if b not in by_backend)
    usable = any(c.reason is None for c in candidates)
    # A GRAFT_* variable's order is never tuned away.
    table = tuning.choices(op, device_type, dtype) if usable and not origin.explicit else None
    result = Static(op, tuple(candidates), origin, source, requested, settings.strict, missing, table)
    if len(_static_cache) > 4096:
        _static_cache.clear()
    _static_cache[key] = result
    return result


def table_choice(st: Static, args: tuple, kwargs: dict) -> tuning.Choice | None:
    """The tuning table entry for this call's shape bucket (None: no table, or no entry)."""
    if st.table is None:
        return None
    return tuning.lookup(st.table, st.op, args, kwargs)


def tuned_order(st: Static, choice: tuning.Choice) -> tuple | None:
    """The statically usable implementations with the table entry's first (its provider's,
    else another of its backend); None when the entry's backend cannot serve here."""
    usable = st.usable()
    chosen = [i for i in usable if i.backend == choice.backend and i.provider == choice.provider]
    chosen = chosen or [i for i in usable if i.backend == choice.backend]
    if not chosen:
        _log_once_eager(logging.INFO, repr(("table", st.op, choice.bucket, choice.backend)),
                        f"tuning table {choice.source} names {choice.backend} for {st.op} {choice.bucket}, which "
                        f"cannot serve here; the default order serves")
        return None
    return tuple(chosen + [i for i in usable if not any(i is c for c in chosen)])


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
    """Choose the implementation for one request. ``args`` enables per-call checks and the
    tuning table entry of the call's shape bucket."""
    st = static(registry, op, device_type, dtype, arch)
    ordered = list(st.candidates)
    origin, source, choice = st.origin, st.source, None
    if args is not None:
        found = table_choice(st, args, kwargs or {})
        order = tuned_order(st, found) if found is not None else None
        if found is not None and order is not None:
            choice = found
            front = [c for impl in order for c in st.candidates if c.impl is impl]
            ordered = front + [c for c in st.candidates if not any(c is f for f in front)]
            origin, source = Origin.TUNING_TABLE, f"tuning table {choice.source}"
    candidates = []
    selected = None
    for cand in ordered:
        reason = cand.reason
        if reason is None and args is not None and cand.impl.check is not None:
            reason = cand.impl.call_reason(args, kwargs or {})
        candidates.append(Candidate(cand.impl, reason))
        if reason is None and selected is None:
            selected = cand.impl
    decision = Decision(op, selected, candidates, source, st.requested, origin, choice)
    if selected is None:
        raise GraftUnsupportedError(f"no implementation of {op} can serve this request:\n" + _reasons(candidates))
    if st.strict:
        check_missing(op, source, st.requested, st.missing, selected.backend)
    # Only candidates ranked above the selected one were really passed over.
    for cand in candidates[: decision._index()]:
        explicit = cand.impl.backend in st.requested
        if explicit and st.strict:
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
    ``arch`` ("sm_90", "gfx942") asks about a GPU this machine need not have. Without a
    call's arguments no tuning table entry applies: :func:`explain_call` says per shape."""
    info = device_info(device, arch=arch)
    try:
        return decide(registry, op, info.type, dtype, info.arch)
    except GraftUnsupportedError:
        st = static(registry, op, info.type, dtype, info.arch)
        return Decision(op, None, list(st.candidates), st.source, st.requested, st.origin)


def explain_call(registry: Registry, op: str, args: tuple, kwargs: dict | None = None) -> Decision:
    """What serves ``op(*args, **kwargs)`` and why: the same decision dispatch takes for
    this call (the arguments are validated first: GraftInputError names a bad one),
    including the tuning table entry of its shape bucket."""
    kwargs = kwargs or {}
    spec = registry.op(op)
    if spec.validate is not None:
        spec.validate(*args, **kwargs)
    tensor = key_tensor(spec, args, kwargs)
    device_type, arch = device_key(None if tensor is None else tensor.device)
    dtype = None if tensor is None else tensor.dtype
    bucket = tuning.bucket(op, args, kwargs)
    try:
        decision = decide(registry, op, device_type, dtype, arch, args, kwargs)
    except GraftUnsupportedError:
        st = static(registry, op, device_type, dtype, arch)
        decision = Decision(op, None, list(st.candidates), st.source, st.requested, st.origin)
    decision.bucket = bucket
    return decision


# --------------------------------------------------------------------------- framework layers


def config_error(registry: Registry | None = None) -> str | None:
    """Why the GRAFT_* selection variables are invalid (every graft op would raise), or None."""
    from graft.plugins import get_registry

    try:
        settings_for(registry or get_registry())
    except GraftError as exc:
        return str(exc)
    return None


def explicitly_requested(op: str, backend: str) -> bool:
    """Did the user name ``backend`` in the priority variable that applies to ``op``?

    Implementations that are correct but not faster on some device (the CPU) step aside
    unless asked for by name; asked when a call signature is first planned, not per call."""
    from graft.plugins import get_registry

    registry = get_registry()
    priority, var = settings_for(registry).priority_for(op, registry.op(op).family)
    return var is not None and backend in priority


def graft_wanted(op: str, device_type: str | None = None, dtype=None) -> str | None:
    """Why graft (not the framework's own code) should serve ``op`` somewhere on this device:
    a ``GRAFT_*`` variable that orders the op's backends, or a table entry naming a backend
    that is not a framework's; None when the framework's own code serves every shape. An
    integration leaves its layer as the framework built it (no graft call at all) when this
    is None for every op the layer needs. ``dtype`` None: any dtype."""
    from graft.plugins import get_registry

    registry = get_registry()
    spec = registry.op(op)
    order, var = settings_for(registry).priority_for(op, spec.family)
    frameworks = {i.backend for i in registry.implementations(op) if i.framework}
    if var is not None:
        if order and order[0] not in frameworks:
            return f"{var} puts {order[0]} first"
        return None
    here = device_type or default_device().type

    def wanted(backend: str, e_dtype: str) -> bool:
        return backend not in frameworks and entry_reason(op, backend, e_dtype, here) is None

    entry = tuning.first_entry(op, here, dtype, wanted)
    if entry is None:
        return None
    source, e_dtype, e_bucket, backend, ratio = entry
    faster = f" ({ratio:.2f}x faster)" if isinstance(ratio, (int, float)) and math.isfinite(ratio) else ""
    return f"{source}: {backend} for {e_dtype} {e_bucket}{faster}"


def entry_reason(op: str, backend: str, dtype: str, device_type: str | None = None) -> str | None:
    """Why a tuning table entry naming ``backend`` for ``op`` and ``dtype`` (its name) cannot
    be served on ``device_type`` (default: this machine's device), or None when it can: a
    table measured elsewhere may name a backend this machine cannot run."""
    from graft.plugins import get_registry

    registry = get_registry()
    device_type = device_type or default_device().type
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        return f"{dtype!r} is not a torch dtype"
    arch = device_info(torch.device(device_type)).arch if device_type == "cuda" else device_type
    try:
        st = static(registry, op, device_type, torch_dtype, arch)
    except GraftError as exc:
        return str(exc)
    reasons = [c.reason for c in st.candidates if c.impl.backend == backend]
    if not reasons:
        return f"no {backend} implementation of {op} is installed"
    if any(r is None for r in reasons):
        return None
    return reasons[0]


def op_unavailable(op: str) -> str | None:
    """Why an integration must not hand ``op`` to graft here (None: graft serves it).

    Disabled ops and families (GRAFT_DISABLE) count even though graft's torch reference
    would still run: the user switched graft's kernels off, so the framework keeps its own.
    """
    from graft.plugins import get_registry

    registry = get_registry()
    spec = registry.ops.get(op)
    if spec is None:
        return f"{op} is not registered (its adapter plugin is not loaded)"
    try:
        settings = settings_for(registry)
    except GraftError as exc:
        return str(exc)
    off = settings.is_disabled(op, spec.family)
    if off:
        return f"{op} is disabled by GRAFT_DISABLE={off}"
    try:
        decision = explain(registry, op)
    except GraftError as exc:
        return f"{op}: {exc}"
    if decision.selected is None:
        reasons = "; ".join(f"{c.impl.backend}: {c.reason}" for c in decision.candidates if c.reason)
        return f"{op} has no implementation that can serve here ({reasons or 'none registered'})"
    return None


# --------------------------------------------------------------------------- caches


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
