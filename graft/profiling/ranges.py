"""What a graft op call records while profiling: a torch.profiler range named
``graft/<op>/<backend>/<bucket>`` around the implementation, and a count of the argument
shapes it saw (written for ``graft tune`` by :mod:`graft.profiling.shapes`).

Nothing here runs unless a profile is recording: :func:`install` sets
``graft.dispatch.instrument`` and reloads the configuration, so the per-(op, device, dtype)
plans are rebuilt with wrapped implementations; :func:`uninstall` drops them again. The
hot path of an unprofiled process never sees this module.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter

import torch

PREFIX = "graft/"
STEP_PREFIX = "graft.step/"  # zero-length ranges marking the window's step boundaries (graft.profiling.session)

_wrapped: dict = {}  # id(original Implementation) -> (original, wrapped): one wrapper per impl
_lock = threading.RLock()
# (op, backend, dtype, argument summary) -> calls, while recording
seen: Counter = Counter()


def range_name(op: str, backend: str, bucket: str) -> str:
    return f"{PREFIX}{op}/{backend}/{bucket}"


def parse_range(name: str):
    """``(op, backend, bucket)`` of a graft op range, or None for any other event name."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX):].split("/", 2)
    return tuple(parts) if len(parts) == 3 else None


def bucket(shape) -> str:
    """The shape with its leading (token/batch) dimension rounded up to a power of two:
    calls whose leading sizes differ a little share a row, as kernels' tuning tables do."""
    if len(shape) == 0:
        return "scalar"
    lead = int(shape[0])
    rounded = 1 << max(lead - 1, 0).bit_length() if lead > 0 else 0
    return "x".join([f"<={rounded}"] + [str(int(d)) for d in shape[1:]])


def _summary(value):
    if isinstance(value, torch.Tensor):
        return {"shape": [int(d) for d in value.shape], "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):  # e.g. a GEMM's out_dtype: replayable by name
        return {"torch_dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value] if len(value) <= 8 else {"type": type(value).__name__, "len": len(value)}
    return {"type": type(value).__name__}


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                                                   for v in value):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _tensor_shapes(args: list) -> list:
    """The tensor arguments' shapes in order, a list of tensors (a multi-tensor op's
    parameter list) item by item."""
    out: list = []
    for a in args:
        if isinstance(a, dict) and "shape" in a:
            out.append(a["shape"])
        elif isinstance(a, list):
            out.extend(_tensor_shapes(a))
    return out


def records() -> list:
    """The shapes counted so far, as :mod:`graft.profiling.shapes` writes them."""
    out = []
    for (op, backend, dtype, args, kwargs), calls in sorted(seen.items(), key=lambda kv: (kv[0][0], -kv[1])):
        args_, kwargs_ = _thaw(args), _thaw(kwargs)
        shapes = _tensor_shapes(args_)
        out.append({"op": op, "backend": backend, "dtype": dtype, "shapes": shapes, "args": args_,
                    "kwargs": kwargs_ if isinstance(kwargs_, dict) else {}, "calls": calls})
    return out


def instrument(impl):
    """``impl`` with its ``fn`` run inside a named range (the same wrapper every time, so that
    dispatch's "the fallback is the impl that failed" check still holds)."""
    with _lock:
        found = _wrapped.get(id(impl))
        if found is not None and found[0] is impl:
            return found[1]
        from graft.plugins import get_registry

        key_arg = get_registry().op(impl.op).key_arg
        fn, op, backend = impl.fn, impl.op, impl.backend
        record = torch.profiler.record_function

        def profiled(*args, **kwargs):
            try:  # the bookkeeping of a profile never fails the call it records
                key = args[key_arg] if len(args) > key_arg else None
                if isinstance(key, torch.Tensor):
                    name, dtype = range_name(op, backend, bucket(key.shape)), str(key.dtype).removeprefix("torch.")
                else:
                    name, dtype = range_name(op, backend, "-"), "-"
                seen[(op, backend, dtype, _freeze([_summary(a) for a in args]),
                      _freeze({k: _summary(v) for k, v in kwargs.items()}))] += 1
            except Exception:
                name = range_name(op, backend, "-")
            with record(name):
                return fn(*args, **kwargs)

        profiled.__name__ = getattr(fn, "__name__", "profiled")
        wrapped = dataclasses.replace(impl, fn=profiled)
        _wrapped[id(impl)] = (impl, wrapped)
        return wrapped


def _collective_backend(op: str, plan_args):
    def backend(args, kwargs) -> str:
        from graft.kernels.collectives import fastpath

        return fastpath.plan(op, *plan_args(*args, **kwargs)).backend
    return backend


def _adam_backend(params, grads, exp_avgs, exp_avg_sqs, *scalars, **kw) -> str:
    from graft.dispatch import select

    return select("fused.adam_step", params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], *scalars, **kw).backend


# Entry points that serve a graft op without always calling its implementation's fn (the
# library collective run directly on the caller's tensors; torch's fused Adam over the
# whole list): (module, attribute, op, backend(args, kwargs), key tensor(args, kwargs)).
# While recording they are wrapped in the same named ranges; callers look them up on the
# module at each call. The in-place collectives key on their input, not their output.
ENTRY_POINTS = (
    ("graft.ops.collectives", "all_reduce", "collectives.all_reduce",
     _collective_backend("collectives.all_reduce", lambda x, group=None, op="sum": (x, group, op)),
     lambda a, k: a[0]),
    ("graft.ops.collectives", "all_gather", "collectives.all_gather",
     _collective_backend("collectives.all_gather", lambda x, group=None, sizes=None: (x, group, sizes)),
     lambda a, k: a[0]),
    ("graft.ops.collectives", "reduce_scatter", "collectives.reduce_scatter",
     _collective_backend("collectives.reduce_scatter",
                         lambda x, group=None, op="sum", sizes=None: (x, group, op, sizes)),
     lambda a, k: a[0]),
    ("graft.ops.collectives", "all_reduce_", "collectives.all_reduce",
     _collective_backend("collectives.all_reduce",
                         lambda t, group=None, op="sum", async_op=False, served=None: (t, group, op)),
     lambda a, k: a[0]),
    ("graft.ops.collectives", "all_gather_into", "collectives.all_gather",
     _collective_backend("collectives.all_gather",
                         lambda out, x, group=None, async_op=False, served=None: (x, group, None)),
     lambda a, k: a[1] if len(a) > 1 else k.get("input")),
    ("graft.ops.collectives", "reduce_scatter_into", "collectives.reduce_scatter",
     _collective_backend("collectives.reduce_scatter",
                         lambda out, x, group=None, op="sum", async_op=False, served=None: (x, group, op, None)),
     lambda a, k: a[1] if len(a) > 1 else k.get("input")),
    ("graft.ops.fused", "adam_step_", "fused.adam_step", lambda a, k: _adam_backend(*a, **k),
     lambda a, k: a[0][0] if a and a[0] else None),
)
_originals: list = []  # (module, attribute, original) while wrapped


def _wrap_entry(fn, op: str, backend_of, key_of):
    record = torch.profiler.record_function

    def profiled(*args, **kwargs):
        try:
            backend = backend_of(args, kwargs)
        except Exception:  # bad arguments: the entry point itself names the problem
            return fn(*args, **kwargs)
        try:  # the bookkeeping of a profile never fails the call it records
            key = key_of(args, kwargs)
            shape = bucket(key.shape) if isinstance(key, torch.Tensor) else "-"
            dtype = str(key.dtype).removeprefix("torch.") if isinstance(key, torch.Tensor) else "-"
            seen[(op, backend, dtype, _freeze([_summary(a) for a in args]),
                  _freeze({k: _summary(v) for k, v in kwargs.items() if k != "served"}))] += 1
        except Exception:
            shape = "-"
        with record(range_name(op, backend, shape)):
            return fn(*args, **kwargs)

    profiled.__name__ = getattr(fn, "__name__", "profiled")
    profiled.__doc__ = getattr(fn, "__doc__", None)
    return profiled


def install() -> None:
    """Name every graft op call in the trace from now on."""
    import importlib

    from graft import config, dispatch

    with _lock:
        if not _originals:
            for module_name, attr, op, backend_of, key_of in ENTRY_POINTS:
                module = importlib.import_module(module_name)
                original = getattr(module, attr)
                _originals.append((module, attr, original))
                setattr(module, attr, _wrap_entry(original, op, backend_of, key_of))
    dispatch.instrument = instrument
    config.reload()  # a new configuration generation: every plan is rebuilt with the wrappers


def uninstall() -> None:
    from graft import config, dispatch

    with _lock:
        for module, attr, original in _originals:
            setattr(module, attr, original)
        _originals.clear()
        if dispatch.instrument is None:
            return
        dispatch.instrument = None
        _wrapped.clear()
    config.reload()
