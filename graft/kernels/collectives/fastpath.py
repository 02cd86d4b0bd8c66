"""The hot path of every graft collective: one plan per call signature.

A *plan* is what graft decides for a signature (op, process group, shapes, dtypes, device
and the non-tensor arguments): the input checks and the cross-rank agreement have passed
(``agreement.py``) and an implementation is selected. It is made on the first call of a
signature and reused until graft's configuration is reloaded (``_common.generation``), so
a call costs a dict lookup plus the implementation: no environment reads, no selection,
no metadata exchange (unless ``GRAFT_COLLECTIVES_VALIDATE=always``).

The in-place forms (``all_reduce_``, ``all_gather_into``, ``reduce_scatter_into``) serve
integrations that route a library's collectives: when the selected implementation is the
library collective itself (the ``torch`` reference) they call it directly on the caller's
tensors, with the caller's ``async_op``, so an asynchronous caller gets the library's
work handle (wrapped, see ``_common.Work``) and keeps its overlap. Graft's own algorithms
are functional: their result is copied into place; on GPUs they are ordered on the current
stream, so the handle is complete once they are queued, as a NCCL handle's ``wait()`` is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

_PG = dist.ProcessGroup

from graft import config as _config
from graft.errors import GraftError

from ._common import _all_gather_single as _raw_all_gather
from ._common import _reduce_scatter_single as _raw_reduce_scatter
from ._common import (
    REDUCE_OPS,
    Work,
    all_gather_single,
    collective_error,
    generation,
    reduce_scatter_single,
    resolve_group,
    settings,
)

REFERENCE = "torch"
_MAX_PLANS = 8192
_COMM_WORDS = ("timed out", "timeout", "gloo", "nccl", "connection", "peer", "closed", "abort")


class Plan:
    __slots__ = ("gen", "op", "pg", "ws", "fn", "backend", "library", "always", "bounded")

    def __init__(self, gen, op, pg, fn, backend, always, bounded):
        self.gen, self.op, self.pg, self.fn, self.backend = gen, op, pg, fn, backend
        self.ws = dist.get_world_size(pg)
        # The library collective serves, unbounded by a graft timeout: callers may call it
        # directly (the process group's own timeout applies; errors are still graft's).
        self.library = backend == REFERENCE and not bounded
        self.always, self.bounded = always, bounded


_plans: dict = {}
_GROUP_ARG = {"collectives.gemm_reduce_scatter": 2, "collectives.all_gather_gemm": 2}  # else args[1]


try:
    _world = _c10d._world  # torch's registry of groups: its default_pg is what dist.group.WORLD reads

    def _G(group):  # the group part of a key: the object, or (None/name, the default group)
        return group if group.__class__ is _PG else (group, _world.default_pg)
except AttributeError:  # private API moved: the public (slower) way

    def _G(group):
        return group if group.__class__ is _PG else (group, _default_group())


def _default_group():
    try:
        return _c10d._world.default_pg  # what dist.group.WORLD reads, without its checks
    except AttributeError:
        return dist.group.WORLD if dist.is_initialized() else None


def _key(op: str, args: tuple):
    """A hashable signature of the call, or None when an argument is unusual (no caching)."""
    parts: list = [op]
    group = None
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.shape, a.dtype, a.device))
        elif a is None or isinstance(a, (str, int)):
            parts.append(a)
        elif isinstance(a, dist.ProcessGroup):
            group = a
            parts.append(a)
        elif isinstance(a, list):
            parts.append(tuple(a))
        else:
            return None
    if group is None:  # None or a name: the default group object tells re-initialisations apart
        parts.append(_default_group())
    return tuple(parts)


def _make_plan(op: str, key, args: tuple) -> Plan:
    from graft.dispatch import select
    from graft.plugins import get_registry

    gen = generation()
    spec = get_registry().op(op)
    if spec.validate is not None:  # local checks + the cross-rank agreement (once per signature)
        spec.validate(*args)
    impl = select(op, *args)
    group = args[_GROUP_ARG.get(op, 1)] if len(args) > _GROUP_ARG.get(op, 1) else None
    current = settings()
    plan = Plan(gen, op, resolve_group(group), impl.fn, impl.backend, current.validate == "always",
                current.timeout_s is not None)
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _drop_destroyed_groups()
        _plans[key] = plan
    return plan


def _drop_destroyed_groups() -> None:
    """Forget plans made for process groups since destroyed (dist.destroy_process_group):
    their keys and plans would keep the groups alive. Run when a plan is made (a first
    call), never on a cached call: a group destroyed and not followed by another first call
    stays referenced until then."""
    live = getattr(_world, "pg_map", None) if "_world" in globals() else None
    if live is None:
        return

    def dead(part) -> bool:
        if part.__class__ is tuple:
            return any(dead(p) for p in part)
        return isinstance(part, _PG) and part not in live

    for key in [k for k in list(_plans) if any(dead(p) for p in k)]:
        _plans.pop(key, None)


def plan(op: str, *args) -> Plan:
    """The cached plan of ``op(*args)`` (validating and agreeing on a first call)."""
    key = _key(op, args)
    found = _plans.get(key) if key is not None else None
    if found is None or found.gen is not generation():
        return _make_plan(op, key, args)
    if found.always:
        from graft.plugins import get_registry

        validate = get_registry().op(op).validate
        if validate is not None:
            validate(*args)
    return found


def _lookup(key, op: str, args: tuple) -> Plan:
    """``plan`` with a key the caller built (the hot entry points: no generic key loop)."""
    try:
        found = _plans[key]
    except TypeError:  # an unhashable argument: validated below, every call
        return plan(op, *args)
    except KeyError:
        found = None
    if found is None or found.gen is not (_config._snapshot or generation()) or found.always:
        found = plan(op, *args)
        _plans[key] = found
    return found


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, GraftError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in _COMM_WORDS)


def run(op: str, *args):
    """``op(*args)`` through its plan: the functional entry of every graft collective."""
    p = plan(op, *args)
    try:
        return p.fn(*args)
    except RuntimeError as exc:
        _comm_failed(p, exc)


def _library(p: Plan, start, async_op: bool):
    """Run a library collective (``start(async_op)`` returns its work or None) with graft's
    timeout and error, returning what the caller's ``async_op`` asks for."""
    try:
        work = start(async_op or p.bounded)
        if async_op:
            return Work(work, p.op, p.pg)
        if work is not None:
            Work(work, p.op, p.pg).wait()
        return None
    except RuntimeError as exc:
        if _is_comm_error(exc):
            raise collective_error(p.op, p.pg, exc) from exc
        raise


def _done(p: Plan, async_op: bool):
    return Work(None, p.op, p.pg) if async_op else None


def _flat(t):
    return t if t.dim() == 1 else t.view(-1)


def _comm_failed(p: Plan, exc: RuntimeError):
    _raise_failed(p.op, p.pg, exc)


def _raise_failed(op: str, pg, exc: RuntimeError):
    """graft's collective error for a failed communication, ``exc`` itself otherwise."""
    if _is_comm_error(exc):
        raise collective_error(op, pg, exc) from exc
    raise exc


def all_reduce(x, group=None, op: str = "sum"):
    """Functional all-reduce (``graft.ops.collectives.all_reduce``)."""
    key = ("collectives.all_reduce", x.shape, x.dtype, x.device, _G(group), op)
    p = _plans.get(key)
    if p is None or p.gen is not _config._snapshot or p.always:
        p = _lookup(key, "collectives.all_reduce", (x, group, op))
    if p.library:
        out = x.clone(memory_format=torch.contiguous_format)
        try:
            _c10d.all_reduce(out, op=REDUCE_OPS[op], group=p.pg)
        except RuntimeError as exc:
            _comm_failed(p, exc)
        return out
    return _call(p, (x, group, op))


def all_gather(x, group=None, sizes=None):
    """Functional all-gather (``graft.ops.collectives.all_gather``)."""
    key = ("collectives.all_gather", x.shape, x.dtype, x.device, _G(group), None if sizes is None else tuple(sizes))
    p = _plans.get(key)
    if p is None or p.gen is not _config._snapshot or p.always:
        p = _lookup(key, "collectives.all_gather", (x, group, sizes))
    if p.library and sizes is None:
        out = x.new_empty(p.ws * x.shape[0]) if x.dim() == 1 else x.new_empty((p.ws * x.shape[0],) + x.shape[1:])
        try:
            _raw_all_gather(out, x.contiguous(), group=p.pg)
        except RuntimeError as exc:
            _comm_failed(p, exc)
        return out
    return _call(p, (x, group, sizes))


def reduce_scatter(x, group=None, op: str = "sum", sizes=None):
    """Functional reduce-scatter (``graft.ops.collectives.reduce_scatter``)."""
    key = ("collectives.reduce_scatter", x.shape, x.dtype, x.device, _G(group), op, None if sizes is None else tuple(sizes))
    p = _plans.get(key)
    if p is None or p.gen is not _config._snapshot or p.always:
        p = _lookup(key, "collectives.reduce_scatter", (x, group, op, sizes))
    if p.library and sizes is None:
        out = (x.new_empty(x.shape[0] // p.ws) if x.dim() == 1
               else x.new_empty((x.shape[0] // p.ws,) + x.shape[1:]))
        try:
            _raw_reduce_scatter(out, x.contiguous(), op=REDUCE_OPS[op], group=p.pg)
        except RuntimeError as exc:
            _comm_failed(p, exc)
        return out
    return _call(p, (x, group, op, sizes))


def fused_failed(op: str, group, exc: RuntimeError) -> None:
    """Raise what a fused collective (``graft.ops.collectives.all_gather_gemm`` ...) raises
    for ``exc``: graft's collective error for a failed communication, as :func:`run` does;
    ``exc`` itself otherwise. Those ops call dispatch's C entry, which serves a remembered
    signature (the default group compared on every call) without a Python frame; its first
    call validates and agrees through :func:`plan`, and a group passed as an object takes
    the Python entry, which does the same on every call. Through :func:`run`, whose key is a
    loop over the arguments, the public op cost about 6 us more than its implementation on
    this CPU; with a key built inline, 4 us."""
    _raise_failed(op, resolve_group(group), exc)


def _call(p: Plan, args: tuple):
    try:
        return p.fn(*args)
    except RuntimeError as exc:
        _comm_failed(p, exc)


def all_reduce_(tensor, group=None, op: str = "sum", async_op: bool = False, served=None):
    """In-place all-reduce of ``tensor`` (torch.distributed.all_reduce semantics)."""
    key = ("collectives.all_reduce", tensor.shape, tensor.dtype, tensor.device, _G(group), op)
    p = _plans.get(key)
    if p is None or p.gen is not _config._snapshot or p.always:
        p = _lookup(key, "collectives.all_reduce", (tensor, group, op))
    if served is not None:
        served(p.backend)
    if p.backend == REFERENCE and tensor.is_contiguous():
        if p.library and not async_op:
            try:
                _c10d.all_reduce(tensor, op=REDUCE_OPS[op], group=p.pg)
            except RuntimeError as exc:
                _comm_failed(p, exc)
            return None
        reduce_op = REDUCE_OPS[op]
        return _library(p, lambda a: dist.all_reduce(tensor, op=reduce_op, group=p.pg, async_op=a), async_op)
    out = _call(p, (tensor, group, op))
    with torch.no_grad():
        tensor.copy_(out)
    return _done(p, async_op)


def all_gather_into(output, input, group=None, async_op: bool = False, served=None):
    """Gather every rank's ``input`` into ``output`` (``world_size * input.numel()`` elements,
    contiguous; torch.distributed.all_gather_into_tensor semantics)."""
    key = ("collectives.all_gather", input.shape, input.dtype, input.device, _G(group), None)
    p = _plans.get(key)
    if p is None or p.gen is not _config._snapshot or p.always:
        p = _lookup(key, "collectives.all_gather", (input, group, None))
    if served is not None:
        served(p.backend)
    if p.backend == REFERENCE and input.is_contiguous() and output.is_contiguous() and output.dtype == input.dtype:
        out_flat, in_flat = _flat(output), _flat(input)
        if p.library and not async_op:
            try:
                _raw_all_gather(out_flat, in_flat, group=p.pg)
            except RuntimeError as exc:
                _comm_failed(p, exc)
            return None
        return _library(p, lambda a: all_gather_single(out_flat, in_flat, group=p.pg, async_op=a), async_op)
    out = _call(p, (input, group, None))
    with torch.no_grad():
        output.copy_(out.view(output.shape))
    return _done(p, async_op)


def reduce_scatter_into(output, input, group=None, op: str = "sum", async_op: bool = False, served=None):
    """Reduce ``input`` over the ranks; rank r receives block r (along dim 0) in ``output``
    (torch.distributed.reduce_scatter_tensor semantics)."""
    key = ("collectives.reduce_scatter", input.shape, input.dtype, input.device, _G(group), op, None)
    p = _plans.get(key)
    if p is None or p.gen is not _config._snapshot or p.always:
        p = _lookup(key, "collectives.reduce_scatter", (input, group, op, None))
    if served is not None:
        served(p.backend)
    if p.backend == REFERENCE and input.is_contiguous() and output.is_contiguous() and output.dtype == input.dtype:
        out_flat, in_flat = _flat(output), _flat(input)  # dim-0 blocks of contiguous memory
        if p.library and not async_op:
            try:
                _raw_reduce_scatter(out_flat, in_flat, op=REDUCE_OPS[op], group=p.pg)
            except RuntimeError as exc:
                _comm_failed(p, exc)
            return None
        return _library(p, lambda a: reduce_scatter_single(out_flat, in_flat, op, group=p.pg, async_op=a), async_op)
    out = _call(p, (input, group, op, None))
    with torch.no_grad():
        output.copy_(out.view(output.shape))
    return _done(p, async_op)


def reset() -> None:
    """Forget every plan (tests; a configuration reload makes them stale anyway)."""
    _plans.clear()

