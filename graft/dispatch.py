"""Run an op through backend selection: validate input, pick an implementation, call it.

The hot path does no work that can be done once. Per (op, device, dtype) a *plan* is
built on the first call and kept until the configuration is reloaded or the caches are
reset: the implementations that can serve statically, in priority order, up to the first
one without a per-call check. Arguments whose signature (see :mod:`graft.signature`:
tensor types, shapes, strides, dtypes, devices; scalar types and values) already passed
the op's validation are recognised by a generated ``hit`` function and map straight to
their plan, so a repeated call costs a C++ tensor comparison, a few scalar comparisons
and the per-call checks of the impls ranked above the chosen one. Validation still runs
on every call for ops whose checks read tensor values while value checks are on, for ops
marked ``validate_cache="never"``, under torch.compile, and for arguments that cannot be
remembered (lists, tensor subclasses, NaN scalars).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import torch

from graft import config, selection, settings
from graft.after_import import after_import
from graft.errors import GraftConfigError, GraftInputError, GraftUnsupportedError
from graft.platform import dtype_name
from graft.plugins import get_registry
from graft.ops._validate import value_checks_on
from graft.registry import Implementation, key_tensor
from graft.signature import Recogniser

_is_compiling = torch.compiler.is_compiling

log = logging.getLogger("graft.dispatch")


_MAX_HITS = 8  # argument signatures remembered per op (the oldest is replaced past this)

# Reloads and the hot path. A plan and the signatures remembered for it belong to one
# _Op state, and a state to one configuration: a reload (config.reload, through
# selection's listener) replaces every state under this lock, and a state inserts into
# the shared tables (_ops, _fast_hits) only under this lock and only while it is still the
# current one. A call in flight in another thread during a reload may finish with the
# implementation it had chosen, but nothing it builds can be served after the reload
# returns. Taken on first calls of a signature and on reloads only, never on a hit.
_state_lock = threading.Lock()


def _layout_checked(name: str, validate):
    """The op's validation preceded by the layout check every op shares: dense, strided
    tensors only. Sparse (COO, CSR, CSC, BSR, BSC), mkldnn and nested tensors are refused
    with a GraftInputError naming the argument and its layout, before the op's own checks
    (which read strides) and before the signature is remembered (torch's C++ tensor check
    cannot be built on them)."""
    import inspect

    try:
        names = list(inspect.signature(validate).parameters) if validate is not None else []
    except (TypeError, ValueError):
        names = []
    strided = torch.strided

    def check(args, kwargs):
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor) and (value.layout is not strided or value.is_nested):
                _bad_layout(name, names[i] if i < len(names) else f"argument {i}", value)
            elif value.__class__ in (list, tuple):
                for j, item in enumerate(value):
                    if isinstance(item, torch.Tensor) and (item.layout is not strided or item.is_nested):
                        _bad_layout(name, f"{names[i] if i < len(names) else f'argument {i}'}[{j}]", item)
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and (value.layout is not strided or value.is_nested):
                _bad_layout(name, key, value)

    if validate is None:
        def checked(*args, **kwargs):
            check(args, kwargs)
    else:
        def checked(*args, **kwargs):
            check(args, kwargs)
            validate(*args, **kwargs)
    checked.__wrapped__ = validate  # type: ignore[attr-defined]
    return checked


def _bad_layout(op: str, arg: str, t: torch.Tensor):
    if t.is_nested:
        layout, fix = f"nested ({t.layout})", "unbind() it or call .to_padded_tensor(0)"
    else:
        layout, fix = str(t.layout), "call .to_dense() first"
    raise GraftInputError(f"{op}: {arg} has layout {layout}; graft ops take dense strided tensors "
                          f"(torch.strided): {fix}")


class _Plan:
    """What serves one (op, device, dtype): statically usable impls in order, and the
    argument signatures that already passed the op's validation."""

    __slots__ = ("impls", "error", "first", "source", "requested", "strict", "missing", "keep", "values", "tune",
                 "decided")

    def __init__(self, impls, error, source, requested, strict, missing, keep, values=False):
        self.impls = impls  # tuple of Implementation, ending at the first one without a check
        self.error = error  # GraftUnsupportedError to raise on every call, or None
        # The common case, one impl and no per-call check: no loop and, unless GRAFT_STRICT=1
        # (which verifies each output), nothing after the call.
        self.first = impls[0] if len(impls) == 1 and impls[0].check is None and not strict else None
        self.source = source
        self.requested = requested
        self.strict = strict
        self.missing = missing
        # Whether argument signatures that pass validation may be remembered (_Op.hits).
        self.keep = keep
        # Whether a remembered signature still runs the op's value checks on each call
        # (OpSpec.check_values, while value checks are on for this device).
        self.values = values
        # _Tuned: the plan of each tuned shape bucket (None: no table entry).
        self.tune = None
        # impl key -> this plan narrowed to that impl, for signatures whose per-call checks
        # were decided once (_decided).
        self.decided: dict = {}

    def narrowed(self, impl) -> "_Plan":
        """This plan served by ``impl`` alone, unconditionally (its check already passed for
        the signature it is remembered with): the C entry can then take the signature."""
        plan = self.decided.get(impl.key)
        if plan is None:
            plan = _Plan((impl,), None, self.source, self.requested, self.strict, self.missing, self.keep,
                         self.values)
            plan.first = impl
            self.decided[impl.key] = plan
        return plan


class _Op:
    """Per-op state of the hot path: the spec's parts, the plans per (device, dtype), and
    the remembered argument signatures."""

    __slots__ = ("name", "spec", "validate", "key_arg", "plans", "recogniser", "values_recogniser", "hits",
                 "next_hit", "next_fast", "hooks")

    def __init__(self, name: str, spec, remember: bool = True):
        self.name = name
        self.spec = spec
        self.validate = _layout_checked(name, spec.validate)
        self.key_arg = spec.key_arg
        self.plans: dict = {}  # (device, dtype) -> _Plan
        # hit functions (graft.signature) of arguments that passed validation, each
        # returning its plan: tried in order instead of validating and looking the plan up.
        self.hits: list = []
        self.next_hit = 0  # the slot the next signature takes once all are used
        self.next_fast = 0  # the same for _fast_hits[name]
        self.hooks = spec.signature_hooks  # validation that depends on more than the arguments
        self.recogniser = None
        self.values_recogniser = None  # the same, with spec.check_values run on every hit
        if remember and spec.validate is not None and spec.validate_cache != "never":
            # An op whose validation depends on more than its arguments (a collective's agreement
            # is made for one process group) puts that context into the signature (its hooks).
            try:
                self.recogniser = Recogniser(spec.validate,
                                             context=self.hooks.context() if self.hooks else None,
                                             varying=spec.validate_varying)
                if spec.check_values is not None:
                    self.values_recogniser = Recogniser(spec.validate, varying=spec.check_values)
            except (TypeError, ValueError) as exc:
                log.info("%s: argument signatures are not remembered (%s)", name, exc)

    def _recogniser(self, plan):
        return self.values_recogniser if plan.values else self.recogniser

    def remember(self, args, kwargs, plan) -> None:
        recogniser = self._recogniser(plan)
        if recogniser is None or self.hooks is not None and self.hooks.identity() is None:
            return  # (e.g. a collective without a group identity to tie the agreement to agrees on every call)
        hit = recogniser.hit(args, kwargs, plan)
        if hit is None:
            return
        if len(self.hits) < _MAX_HITS:
            self.hits.append(hit)
        else:
            self.hits[self.next_hit] = hit
            self.next_hit = (self.next_hit + 1) % _MAX_HITS
        if plan.first is not None and _fastcall is not None:
            self.remember_fast(args, kwargs, plan)

    def remember_fast(self, args, kwargs, plan) -> None:
        """The signature for the C entries (graft/_fastcall.c), which call a plan's one
        unconditional implementation without a Python frame; they match the spelling of
        the call (positional count, keyword names), so each spelling is added when the
        C entry first passes it on."""
        recogniser = self._recogniser(plan)
        fast = recogniser.fast_hit(args, kwargs, plan.first) if recogniser is not None else None
        if fast is None:
            return
        with _state_lock:
            # A state a reload replaced (this call was in flight) must not put its
            # signature into the table the C entry serves from: see _state_lock.
            if _ops.get(self.name) is not self:
                return
            fast_hits = _fast_hits.setdefault(self.name, [])
            if len(fast_hits) < _MAX_HITS:
                fast_hits.append(fast)
            else:
                fast_hits[self.next_fast] = fast
                self.next_fast = (self.next_fast + 1) % _MAX_HITS


# Set by graft.profiling while it records (None otherwise): maps an Implementation to one whose
# fn runs inside a torch.profiler range naming op, backend and shape bucket. Plans are built
# with it, and rebuilt (a configuration reload) when recording starts and stops, so the hot
# path carries no profiling check at all.
instrument: Callable[[Implementation], Implementation] | None = None
_ops: dict = {}  # op -> _Op
_fast_hits: dict = {}  # op -> remembered signatures as graft/_fastcall.c reads them (Recogniser.fast_hit)
_fastcall: Any
try:
    from graft import _fastcall
except ImportError:  # built without a C compiler: the Python entries serve alone
    _fastcall = None


def _clear() -> None:
    # In place: graft/_fastcall.c holds _fast_hits itself.
    with _state_lock:
        _ops.clear()
        _fast_hits.clear()


selection.on_reset(_clear)


def _op(op: str) -> _Op:
    state = _ops.get(op)
    if state is None:
        if _is_compiling():  # tracing (no signature is remembered): a throwaway state
            return _Op(op, get_registry().op(op), remember=False)
        fresh = _Op(op, get_registry().op(op))
        with _state_lock:  # another thread may have made one meanwhile: one state per op
            state = _ops.setdefault(op, fresh)
    return state


def _replan(op: str) -> None:
    """Forget ``op``'s plans and remembered signatures (and selection's decisions for it):
    its next call plans again with the configuration already loaded. Other ops keep
    theirs, and nothing is re-read from the environment."""
    with _state_lock:
        _ops.pop(op, None)
        _fast_hits.pop(op, None)
    selection.forget(op)


def _up_to_unconditional(impls) -> tuple:
    """A plan's implementations: up to the first one without a per-call check."""
    out = []
    for impl in impls:
        out.append(impl)
        if impl.check is None:
            break
    return tuple(out)


class _Tuned:
    """Selection's tuned answers for one plan, cached: per shape bucket with a tuning table
    entry, the plan whose implementations start with the entry's (built on first use; cold
    path only). Selection decides (graft.selection.table_choice, tuned_order); this only keeps."""

    __slots__ = ("static", "default", "make_plan", "variants")

    def __init__(self, static, default: "_Plan", make_plan):
        self.static = static
        self.default = default  # the plan of buckets without an entry
        self.make_plan = make_plan  # impls -> a plan like the default one
        self.variants: dict = {}  # bucket -> plan (None: the entry's backend cannot serve here)

    def plan(self, op: str, args: tuple, kwargs: dict) -> "_Plan":
        choice = selection.table_choice(self.static, args, kwargs)
        if choice is None:
            return self.default
        if choice.bucket in self.variants:
            variant = self.variants[choice.bucket]
        else:
            order = selection.tuned_order(self.static, choice)
            variant = None if order is None else self.make_plan(_up_to_unconditional(order))
            self.variants[choice.bucket] = variant
        return variant if variant is not None else self.default


def _build_plan(state: _Op, device, dtype) -> _Plan:
    registry = get_registry()
    op = state.name
    device_type, arch = selection.device_key(device)
    st = selection.static(registry, op, device_type, dtype, arch)
    source, requested, strict, missing = st.source, st.requested, st.strict, st.missing
    usable = list(_up_to_unconditional(st.usable()))
    if instrument is not None:  # graft.profiling is recording: each impl wrapped in a named range
        usable = [instrument(impl) for impl in usable]
    error = None
    if not usable:
        error = GraftUnsupportedError(
            f"no implementation of {op} can serve this request:\n" + selection._reasons(st.candidates))
    else:
        # Statically skipped candidates ranked above the first usable one are logged (or,
        # when explicitly requested under GRAFT_STRICT=1, refused) once, here.
        try:
            selection.decide(registry, op, device_type, dtype, arch)
        except GraftUnsupportedError as exc:
            if strict:
                error = exc
    # Plans are rebuilt when the configuration changes, and so is this decision.
    mode = state.spec.validate_cache
    if state.hooks is not None:  # e.g. GRAFT_COLLECTIVES_VALIDATE=always agrees on every call
        keep = device is not None and state.hooks.may_remember()
    else:
        keep = device is not None and (mode == "always" or (mode == "values" and not value_checks_on(device_type)))
    # With value checks on, an op whose value checks stand apart still remembers signatures:
    # a hit then runs only those checks (OpSpec.check_values), not the whole validator.
    values = (device is not None and mode == "values" and state.values_recogniser is not None
              and value_checks_on(device_type))
    keep = keep or values
    plan = _Plan(tuple(usable), error, source, requested, strict, missing, keep, values)
    if error is None and st.table is not None:
        wrap = instrument if instrument is not None else (lambda impl: impl)
        plan.tune = _Tuned(st, plan, lambda impls: _Plan(tuple(wrap(i) for i in impls), None, source, requested,
                                                         strict, missing, keep, values))
    state.plans[(device, dtype)] = plan
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


def _decided(state: "_Op", plan: _Plan, args, kwargs) -> _Plan:
    """``plan`` with its per-call checks answered once for this argument signature, when every
    check it consults reads only what the remembered signature fixes (Implementation.
    check_scalars, none of them a scalar checked on every call); else ``plan`` itself, whose
    checks then run on every call. Strict plans verify every output and stay as they are."""
    if plan.error is not None or plan.strict:
        return plan
    recogniser = state._recogniser(plan)
    varying = recogniser.varying_names if recogniser is not None else ()
    for impl in plan.impls:
        if impl.check is None:
            return plan.narrowed(impl)
        if impl.check_scalars is None or any(name in varying for name in impl.check_scalars):
            return plan
        reason = impl.call_reason(args, kwargs)
        if reason is None:
            return plan.narrowed(impl)
        _passed_over(state.name, plan, impl, reason)
    return plan  # every candidate declined: _choose explains


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


def _plan_for(state: _Op, args, kwargs) -> _Plan:
    key_arg = state.key_arg
    tensor = args[key_arg] if len(args) > key_arg else None
    if not isinstance(tensor, torch.Tensor):
        tensor = key_tensor(state.spec, args, kwargs)
    if tensor is None:
        device = dtype = None
    else:
        device, dtype = tensor.device, tensor.dtype
    plan = state.plans.get((device, dtype))
    if plan is None:
        plan = _build_plan(state, device, dtype)
    return plan


def select(op: str, *args, **kwargs) -> Implementation:
    """The implementation that would serve ``op(*args, **kwargs)`` (runs per-call checks, not the op)."""
    plan = _plan_for(_op(op), args, kwargs)
    if plan.tune is not None and not _is_compiling():
        plan = plan.tune.plan(op, args, kwargs)
    return _choose(op, plan, args, kwargs)


def _cold_plan(state: _Op, op: str, args, kwargs) -> _Plan:
    """The plan of a call no remembered signature matched: validate, look the plan up (or
    build it), take the tuning table's choice for its shape, and remember the signature."""
    if state.validate is not None:
        if state.hooks is not None and not kwargs and not _is_compiling():
            state.hooks.validate(op, *args)  # e.g. a collective's agreement, once per signature
        else:
            state.validate(*args, **kwargs)
    key_arg = state.key_arg
    tensor = args[key_arg] if len(args) > key_arg else None
    plan = state.plans.get((tensor.device, tensor.dtype)) if isinstance(tensor, torch.Tensor) else None
    if plan is None:
        plan = _plan_for(state, args, kwargs)
    if plan.tune is not None and not _is_compiling():  # a tuning table's choice for this shape
        plan = plan.tune.plan(op, args, kwargs)
    if plan.keep and not _is_compiling():
        if plan.first is None:
            plan = _decided(state, plan, args, kwargs)
        state.remember(args, kwargs, plan)
    return plan


def _remembered(state: _Op, args, kwargs) -> _Plan | None:
    """The plan of a remembered signature these arguments match, or None."""
    plan = None
    try:
        for hit in state.hits:
            plan = hit(*args, **kwargs)
            if plan is not None:
                break
    except (TypeError, AttributeError):  # arguments the validator cannot bind (or not a tensor
        return None  # where one was remembered): the cold path's validation names the problem
    if _fastcall is not None and plan is not None and plan.first is not None:
        state.remember_fast(args, kwargs, plan)  # a spelling the C entry missed
    return plan


def _run_plan(op: str, state: _Op, plan: _Plan, args, kwargs):
    """Run ``plan`` for these arguments: ``(result, implementation that produced it)``."""
    impl = plan.first
    if impl is None:
        impl = _choose(op, plan, args, kwargs)
    try:
        out = impl.fn(*args, **kwargs)
    except GraftUnsupportedError as exc:
        return _fall_back(op, impl, exc, args, kwargs)
    if plan.strict and impl.backend != config.REFERENCE_BACKEND:
        verify_output(state.spec, impl, out, args, kwargs)
    return out, impl


def run(op: str, *args, **kwargs):
    """Validate, select and run ``op``; returns ``(result, impl)``, ``impl`` being the
    implementation that produced the result (after any run-time fallback).

    Integrations use this to count what served a call without selecting twice.
    """
    state = _ops.get(op) or _op(op)
    plan = _remembered(state, args, kwargs) if state.hits and not _is_compiling() else None
    if plan is None:
        plan = _cold_plan(state, op, args, kwargs)
    return _run_plan(op, state, plan, args, kwargs)


def call(op: str, *args, **kwargs):
    """Validate the arguments (the same checks for every backend), then run the selected impl.

    Validation runs in full on the first call of each argument signature (tensor shapes,
    dtypes, devices; scalar values) and, for ops whose checks read tensor values, on every
    call while value checks are on; a signature that passed is remembered per plan.

    An implementation may find out only when it runs that it cannot serve (a lazy
    extension build that fails, say): it raises GraftUnsupportedError after recording
    why, and the call falls back to the next implementation, with the reason logged,
    unless GRAFT_STRICT=1.
    """
    state = _ops.get(op) or _op(op)
    plan = _remembered(state, args, kwargs) if state.hits and not _is_compiling() else None
    if plan is None:
        plan = _cold_plan(state, op, args, kwargs)
    impl = plan.first
    if impl is not None:  # the common case: one implementation, no per-call check, not strict
        try:
            return impl.fn(*args, **kwargs)
        except GraftUnsupportedError as exc:
            return _fall_back(op, impl, exc, args, kwargs)[0]
    return _run_plan(op, state, plan, args, kwargs)[0]


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
        return f"tensor{tuple(value.shape)} {dtype_name(value.dtype)} on {value.device}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


def _same_meta(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
                and got.device == want.device)
    if isinstance(want, (tuple, list)):
        return (isinstance(got, (tuple, list)) and len(got) == len(want)
                and all(_same_meta(g, w) for g, w in zip(got, want)))
    return (got is None) == (want is None)


def verify_output(spec, impl: Implementation, out, args, kwargs) -> None:
    """Raise GraftError when ``out`` does not have the shapes, dtypes and devices the op's
    reference gives for these arguments (GRAFT_STRICT=1 and conformance check every implementation)."""
    from graft.errors import GraftError

    want = _expected_output(spec, args, kwargs)
    if want is None or _same_meta(out, want):
        return
    raise GraftError(
        f"{spec.name}: {impl.backend} ({impl.provider}) returned {_describe(out)}, but the op's reference "
        f"gives {_describe(want)} for these arguments; the implementation is wrong"
    )


def _fall_back(op: str, impl: Implementation, exc: Exception, args, kwargs):
    if impl.backend == config.REFERENCE_BACKEND or settings.get("GRAFT_STRICT"):
        raise exc
    # Only this op plans again (the implementation recorded why it cannot serve, so its
    # static reason now says so), with the configuration in force: no environment read,
    # other ops' plans, signatures and logged messages stay.
    _replan(op)
    fallback = select(op, *args, **kwargs)
    if fallback is impl:  # it still claims it can serve: don't loop, report
        raise exc
    log.warning("%s: %s (%s) failed at run time: %s; using %s", op, impl.backend, impl.provider, exc,
                fallback.backend)
    return fallback.fn(*args, **kwargs), fallback


_python_call, _python_run = call, run


def _with_dynamo() -> None:
    """Once torch._dynamo is imported: torch.compile cannot look into C, so it traces the
    Python entries in their place; and remembering a signature is never traced (an entry
    that runs eagerly inside a compiled function, after a graph break, would otherwise have
    its cold path compiled as a frame of its own, down to torch's C++ tensor guards)."""
    import torch._dynamo
    from torch._dynamo import substitute_in_graph

    _Op.remember = torch._dynamo.disable(_Op.remember)  # type: ignore[method-assign]
    _Op.remember_fast = torch._dynamo.disable(_Op.remember_fast)  # type: ignore[method-assign]
    if _fastcall is not None:
        substitute_in_graph(_fastcall.call, skip_signature_check=True)(_python_call)
        substitute_in_graph(_fastcall.run, skip_signature_check=True)(_python_run)


def _c_entries_wanted() -> bool:
    """GRAFT_DISPATCH_C, read once when graft is imported (the entries are bound then)."""
    try:
        return settings.get(DISPATCH_C_VAR, os.environ)
    except GraftConfigError as exc:  # importing graft must not fail on it: say so, keep the default
        log.warning("%s; using the C entries", exc)
        return True


DISPATCH_C_VAR = "GRAFT_DISPATCH_C"  # declared in graft.settings; read when graft is imported
if _fastcall is not None and not _c_entries_wanted():
    _fastcall = None
if _fastcall is not None:
    # The C entries take remembered signatures served by one implementation and hand every
    # other call to the Python entries above, which stay the definition (and what
    # torch.compile traces in their place).
    _fastcall.configure(_fast_hits, _python_call, _python_run, _fall_back, GraftUnsupportedError,
                        vars(torch.compiler) if hasattr(torch.compiler, "_is_compiling_flag") else None)
    call, run = _fastcall.call, _fastcall.run  # type: ignore[assignment]
after_import("torch._dynamo", lambda module: _with_dynamo())
