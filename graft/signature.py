"""Argument signatures that passed an op's validation, recognised again in a few hundred
nanoseconds so that dispatch need not validate them twice.

A *signature* is everything a validator reads without reading tensor values: for each
tensor argument its type, shape, strides, dtype, device and autograd state; for each
scalar argument (int, float, bool, str, None, dtype, complex) its type and value. A
``hit`` function, built once per signature, takes the op's arguments as the validator
does (keywords and defaults bind the same way) and returns the remembered plan when they
have that signature, None when not.

Tensors are compared by torch's own C++ tensor check (the one torch.compile's guards are
made of: tens of nanoseconds a tensor, where reading ``shape``, ``dtype`` and ``device``
in Python costs a quarter of a microsecond); where that is missing or misbehaves (a torch
that moved it), by an equivalent Python comparison. Not remembered: tensor subclasses
(fake or functional tensors have symbolic shapes), NaN scalars (a NaN must reach the
validator every time, to be rejected there), lists and other objects.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import weakref
from typing import Callable

import torch

log = logging.getLogger("graft.signature")

_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_SCALARS = frozenset({int, float, bool, str, torch.dtype, complex})


def _python_guard(tensors: tuple) -> Callable[..., bool]:
    def meta(t):
        return (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.requires_grad)

    want = tuple(meta(t) for t in tensors)

    def check(*ts) -> bool:
        try:
            return tuple(meta(t) for t in ts) == want
        except AttributeError:  # not a tensor
            return False

    return check


def _torch_guard(tensors: tuple) -> Callable[..., bool]:
    from torch._C._dynamo.guards import TensorGuards

    # None for both: every size and stride is static (compared exactly).
    return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check


def _graft_guard(tensors: tuple) -> Callable[..., bool]:
    from graft import tensor_guard

    return tensor_guard.module().make(*tensors)


def _guard_works(make: Callable, what: str) -> bool:
    """A compiled tensor check is used only if it behaves as graft relies on (torch's is
    private API; graft's is built against a torch that may since have changed)."""
    try:
        x, y = torch.zeros(2, 3), torch.zeros(4)
        check = make((x,))
        pair = make((x, y))
        return (check(torch.ones(2, 3)) is True and check(torch.ones(3, 2)) is False
                and check(torch.ones(2, 3, dtype=torch.float64)) is False
                and check(torch.ones(3, 2).t()) is False  # same shape, other strides
                and check(torch.ones(2, 3, device="meta")) is False
                and check(None) is False and check(torch.ones(2, 3).requires_grad_()) is False
                and check(torch.nn.Parameter(torch.ones(2, 3))) is False  # another tensor type
                and pair(torch.ones(2, 3), torch.ones(4)) is True and pair(x, x) is False)
    except Exception as exc:  # absent, or another signature in this torch
        log.info("%s is unusable here (%s: %s)", what, type(exc).__name__, exc)
        return False


def _pick_guard() -> Callable:
    """graft's C++ tensor check where it is built and behaves, else torch's, else Python's."""
    from graft import tensor_guard

    if tensor_guard.module() is not None and _guard_works(_graft_guard, "graft's C++ tensor guard"):
        return _graft_guard
    if _guard_works(_torch_guard, "torch's C++ tensor check"):
        return _torch_guard
    log.info("signatures are compared in Python")
    return _python_guard


_guard: Callable | None = None
FAST_MAX_ARGS = 32  # graft/_fastcall.c's MAX_ARGS


def _chosen_guard() -> Callable:
    """The guard maker of this process, picked on first use (:func:`_pick_guard`)."""
    global _guard
    if _guard is None:
        _guard = _pick_guard()
    return _guard


def guard_kind() -> str:
    """Which check remembered signatures use: "graft", "torch" or "python" (``graft info``)."""
    return {_graft_guard: "graft", _torch_guard: "torch"}.get(_chosen_guard(), "python")


def tensor_guard(tensors: tuple) -> Callable[..., bool]:
    """A function of as many tensors that is True when they match ``tensors``' metadata."""
    make = _chosen_guard()
    if len({id(t) for t in tensors}) < len(tensors):
        return _python_guard(tensors)  # torch's check never matches one tensor passed twice
    return make(tensors)


class Recogniser:
    """Builds ``hit`` functions for one validator's arguments.

    ``context`` (optional) is called on every hit; its result, compared by identity, is
    part of the signature (a collective's default process group). ``varying`` (optional)
    names, by its own parameter names, scalar arguments that change from call to call (a
    step count, a learning rate): they are matched by type only, and ``varying`` runs on
    every hit to check their values (it raises as the validator would).
    """

    def __init__(self, validate: Callable, context: Callable | None = None, varying: Callable | None = None):
        params = list(inspect.signature(validate).parameters.values())
        if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
            raise TypeError("a validator with *args, **kwargs or positional-only parameters cannot be recognised")
        self.signature = inspect.Signature(params)
        self.names = [p.name for p in params]
        self.varying = varying
        self.varying_names = tuple(inspect.signature(varying).parameters) if varying is not None else ()
        unknown = set(self.varying_names) - set(self.names)
        if unknown:
            raise TypeError(f"varying names {sorted(unknown)}, which the validator does not take")
        self.context = context
        self.factories: dict = {}  # kinds of the arguments -> factory of hit functions

    def _classify(self, pairs):
        """Kinds ("T", "N", ("S", type), ("V", type)), tensors and scalar values of
        (name, value) pairs, or None when a value cannot be part of a signature."""
        kinds: list = []
        tensors, scalars = [], []
        for name, value in pairs:
            cls = value.__class__
            if cls in _TENSORS:
                if value.layout is not torch.strided or value.is_nested:
                    return None  # torch's tensor check cannot be built on it (a C++ abort)
                kinds.append("T")
                tensors.append(value)
            elif value is None:
                kinds.append("N")
            elif cls in _SCALARS:
                if name in self.varying_names:
                    kinds.append(("V", cls))
                    continue
                if cls is float and math.isnan(value) or cls is complex and value != value:
                    return None
                kinds.append(("S", cls))
                scalars.append(value)
            else:
                return None
        return kinds, tensors, scalars

    def hit(self, args: tuple, kwargs: dict, plan) -> Callable | None:
        """A function recognising these arguments' signature (returning ``plan``), or None
        when they cannot be remembered."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        classified = self._classify((name, bound.arguments[name]) for name in self.names)
        if classified is None:
            return None
        kinds, tensors, scalars = classified
        pattern = tuple(kinds)
        factory = self.factories.get(pattern)
        if factory is None:
            factory = self.factories[pattern] = self._factory(pattern)
        context = self._context_ref()
        if context is False:
            return None
        guard = tensor_guard(tuple(tensors)) if tensors else None
        return factory(guard, plan, context, *scalars)

    def _context_ref(self):
        """A weak reference to the context's current value (None without a context; False
        when it cannot be referenced weakly): a remembered signature must not keep a
        destroyed process group alive. Once the value is gone the reference returns None,
        which no live context is."""
        if self.context is None:
            return None
        try:
            return weakref.ref(self.context())
        except TypeError:
            return False

    def fast_hit(self, args: tuple, kwargs: dict, impl) -> tuple | None:
        """The same signature as data for graft._fastcall (its header describes the tuple),
        for arguments passed exactly like these (positional count and keyword names), or
        None when they cannot be remembered there."""
        names = self.names[:len(args)] + list(kwargs)
        passed = list(args) + list(kwargs.values())
        if len(args) > len(self.names) or len(passed) > FAST_MAX_ARGS:
            return None
        classified = self._classify(zip(names, passed))
        if classified is None:
            return None
        kinds, tensors, scalars = classified
        varying, at = self.varying, tuple(names.index(n) for n in self.varying_names if n in names)
        if len(at) < len(self.varying_names):
            # Varying arguments the call leaves to their default: handed over as the validator
            # would see them, bound once as keywords (only trailing ones: the others go by position).
            missing = self.varying_names[len(at):]
            assert varying is not None  # (varying_names come with it)
            if any(n not in names for n in self.varying_names[:len(at)]) or any(n in names for n in missing):
                return None
            params = self.signature.parameters
            varying = functools.partial(varying, **{n: params[n].default for n in missing})
        values = iter(scalars)
        pairs = tuple((k[1], next(values) if k[0] == "S" else None) for k in kinds if isinstance(k, tuple))
        codes = bytes(ord(k if isinstance(k, str) else k[0]) for k in kinds)
        guard = tensor_guard(tuple(tensors)) if tensors else None
        if guard is not None and _guard is _graft_guard and len({id(t) for t in tensors}) == len(tensors):
            codes = codes.replace(b"T", b"G")  # graft's guard checks type and key set itself: no is_nested read
        context = self._context_ref()
        if context is False:
            return None
        return (len(args), tuple(kwargs), codes, guard, pairs, varying, at, self.context, context, impl, impl.fn)

    def _factory(self, kinds: tuple) -> Callable:
        """Source for one arrangement of argument kinds, compiled once: the hit function's
        test is a chain of comparisons, no loop."""
        env: dict = {"_graft_context": self.context, "_graft_varying": self.varying, "_graft_tensor_classes": _TENSORS}
        sig, tests, tensor_names, tensor_tests, values = [], [], [], [], []
        seen_keyword_only = False
        for param, kind in zip(self.signature.parameters.values(), kinds):
            n = param.name
            if param.kind is param.KEYWORD_ONLY and not seen_keyword_only:
                sig.append("*")
                seen_keyword_only = True
            if param.default is param.empty:
                sig.append(n)
            else:
                env[f"_graft_default_{n}"] = param.default
                sig.append(f"{n}=_graft_default_{n}")
            if kind == "T":
                tensor_names.append(n)
                tensor_tests.append(f"{n}.__class__ in _graft_tensor_classes and not {n}.is_nested")
            elif kind == "N":
                tests.append(f"{n} is None")
            else:
                tag, cls = kind
                env[f"_graft_class_{n}"] = cls
                tests.append(f"{n}.__class__ is _graft_class_{n}")
                if tag == "S":
                    values.append(f"_graft_value_{n}")
                    tests.append(f"{n} == _graft_value_{n}")
        if tensor_names:
            # Each tensor's own test first: torch's check aborts the process on a nested
            # tensor (it reads its strides), so those never reach it.
            tests[:0] = tensor_tests + [f"_graft_guard({', '.join(tensor_names)})"]
        if self.context is not None:
            tests.append("_graft_context() is _graft_context_value()")
        body = f"        if {' and '.join(tests) or 'True'}:\n"
        if self.varying is not None:
            body += f"            _graft_varying({', '.join(self.varying_names)})\n"
        body += "            return _graft_plan\n"
        src = (f"def factory(_graft_guard, _graft_plan, _graft_context_value, {', '.join(values)}):\n"
               f"    def hit({', '.join(sig)}):\n{body}"
               f"    return hit\n")
        exec(compile(src, f"<graft signature of {self.names}>", "exec"), env)
        return env["factory"]
