"""Collectives: all-reduce, all-gather, reduce-scatter, a quantized all-gather, and
tensor-parallel GEMM + collective overlap, over ``torch.distributed`` process groups
(NCCL/RCCL on GPUs, gloo on the CPU).

Every op is functional (returns a new tensor, never writes its input) and takes a
``group`` argument (``None`` = the default world group, a ``ProcessGroup``, or a group
name). The references are the plain library collectives, so with no optimized
implementation (or ``GRAFT_DISABLE=collectives``) graft is exactly torch.distributed.
``all_reduce_``, ``all_gather_into`` and ``reduce_scatter_into`` are the in-place,
``async_op``-capable forms that framework integrations route to (DeepSpeed's comm).

This module holds the op catalogue: specs, references, validation and cases. Validation
is local checks plus the cross-rank agreement (``graft.kernels.collectives.agreement``:
once per signature, or every call with ``GRAFT_COLLECTIVES_VALIDATE=always``); the hot
path that caches both per signature is ``graft.kernels.collectives.fastpath``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from graft.dispatch import call
from graft.errors import GraftInputError
from graft.kernels.collectives import fastpath
from graft.kernels.collectives._common import REDUCE_OPS, resolve_group
from graft.kernels.collectives.agreement import agree, ANY, Call, dtype_name
from graft.kernels.collectives.signature import HOOKS
from graft.ops.collectives.reference import (_all_gather_gemm_ref, _all_gather_quantized_ref, _all_gather_ref,
                                             _all_reduce_ref, _gemm_reduce_scatter_ref, _reduce_scatter_ref)
from graft.registry import OpSpec


# Validation: local checks, then the cross-rank agreement (agreement.py).
def _group_or_fail(call: Call, group):
    if not dist.is_available() or not dist.is_initialized():
        raise GraftInputError(
            f"{call.op}: torch.distributed is not initialized; call torch.distributed.init_process_group first"
        )
    if group is not None and not isinstance(group, (str, dist.ProcessGroup)):
        call.fail(f"group must be None, a ProcessGroup or a group name, got {type(group).__name__}")
        return None, 1, 0
    try:
        pg = resolve_group(group)
        return pg, dist.get_world_size(pg), dist.get_rank(pg)
    except Exception as exc:  # unknown group name, or this rank is not a member
        raise GraftInputError(f"{call.op}: cannot use process group {group!r}: {exc}") from None


def _check_reduce_op(call: Call, op):
    if op not in REDUCE_OPS:
        call.fail(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
        return None
    return op


def _check_sizes(call: Call, sizes, ws: int):
    """Validate per-rank dim-0 sizes; returns what every rank must share."""
    if sizes is None:
        return None
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        call.fail(f"sizes must be a list of non-negative ints (one per rank), got {sizes!r}")
        return None
    if len(sizes) != ws:
        call.fail(f"sizes has {len(sizes)} entries but the group has {ws} ranks")
        return None
    return list(sizes)


_dtype_name = dtype_name


def _validate_all_reduce(x, group=None, op="sum"):
    call = Call("collectives.all_reduce")
    pg, ws, rank = _group_or_fail(call, group)
    call.extras.append(("op", _check_reduce_op(call, op)))
    call.tensor("x", x)
    agree(call, pg, ws, rank, (x, group, op))


def _validate_all_gather(x, group=None, sizes=None, _op="collectives.all_gather"):
    call = Call(_op)
    pg, ws, rank = _group_or_fail(call, group)
    call.extras.append(("sizes", _check_sizes(call, sizes, ws)))
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        call.fail("x must have at least one dimension (gathered along dim 0)")
    elif isinstance(x, torch.Tensor) and sizes is not None and call.error is None and x.shape[0] != sizes[rank]:
        call.fail(f"x has {x.shape[0]} rows on rank {rank} but sizes[{rank}] = {sizes[rank]}")
    shape = None
    if isinstance(x, torch.Tensor) and x.dim() > 0 and sizes is not None:
        shape = (ANY,) + tuple(x.shape[1:])
    call.tensor("x", x, shape=shape)
    agree(call, pg, ws, rank, (x, group, sizes) if _op == "collectives.all_gather" else (x, group))


def _validate_reduce_scatter(x, group=None, op="sum", sizes=None):
    call = Call("collectives.reduce_scatter")
    pg, ws, rank = _group_or_fail(call, group)
    call.extras.append(("op", _check_reduce_op(call, op)))
    call.extras.append(("sizes", _check_sizes(call, sizes, ws)))
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            call.fail("x must have at least one dimension (scattered along dim 0)")
        elif sizes is None and x.shape[0] % ws:
            call.fail(f"x has {x.shape[0]} rows, not divisible by the world size {ws}; pass sizes=[...] "
                       "for an uneven split")
        elif sizes is not None and call.error is None and sum(sizes) != x.shape[0]:
            call.fail(f"sizes sum to {sum(sizes)} but x has {x.shape[0]} rows")
    call.tensor("x", x)
    agree(call, pg, ws, rank, (x, group, op, sizes))


def _validate_all_gather_quantized(x, group=None, block_size=128):
    call = Call("collectives.all_gather_quantized")
    pg, ws, rank = _group_or_fail(call, group)
    if not isinstance(block_size, int) or block_size < 1:
        call.fail(f"block_size must be a positive int, got {block_size!r}")
        block_size = -1
    call.extras.append(("block_size", block_size))
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        call.fail("x must have at least one dimension (gathered along dim 0)")
    call.tensor("x", x)
    agree(call, pg, ws, rank, (x, group, block_size))


def _validate_gemm_pair(op_name, a, b, group, gather: bool):
    call = Call(op_name)
    pg, ws, rank = _group_or_fail(call, group)
    ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2
    if ok and a.shape[1] != b.shape[0]:
        call.fail(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
    if ok and a.dtype != b.dtype:
        call.fail(f"a is {_dtype_name(a.dtype)} but b is {_dtype_name(b.dtype)}; they must share a dtype")
    if ok and a.device != b.device:
        call.fail(f"a is on {a.device} but b on {b.device}")
    if ok and not gather and a.shape[0] % ws:
        call.fail(f"a has {a.shape[0]} rows, not divisible by the world size {ws}")
    if gather:  # [M_local, K] gathered; b [K, N_local]: N_local may differ per rank
        a_shape = b_shape = None
        if ok:
            b_shape = (b.shape[0], ANY)
        call.tensor("a", a, ndim=2, shape=a_shape) and call.tensor("b", b, ndim=2, shape=b_shape)
    else:  # a [M, K_local] @ b [K_local, N], reduce-scattered over M: K_local may differ
        a_shape = (a.shape[0], ANY) if ok else None
        b_shape = (ANY, b.shape[1]) if ok else None
        call.tensor("a", a, ndim=2, shape=a_shape) and call.tensor("b", b, ndim=2, shape=b_shape)
    agree(call, pg, ws, rank, (a, b, group))


def _validate_gemm_reduce_scatter(a, b, group=None):
    _validate_gemm_pair("collectives.gemm_reduce_scatter", a, b, group, gather=False)


def _validate_all_gather_gemm(a, b, group=None):
    _validate_gemm_pair("collectives.all_gather_gemm", a, b, group, gather=True)


OPS = [
    OpSpec(
        name="collectives.all_reduce",
        family="collectives",
        signature_hooks=HOOKS,
        signature="all_reduce(x: Tensor[...], group=None, op: str = 'sum') -> Tensor[...]",
        reference=_all_reduce_ref,
        validate=_validate_all_reduce,
        description="out-of-place all-reduce (sum/max/min) over a process group",
    ),
    OpSpec(
        name="collectives.all_gather",
        family="collectives",
        signature_hooks=HOOKS,
        signature="all_gather(x: Tensor[m, ...], group=None, sizes: list[int] | None = None) -> Tensor[sum(m), ...]",
        reference=_all_gather_ref,
        validate=_validate_all_gather,
        description="gather every rank's x along dim 0 (sizes: uneven per-rank row counts)",
    ),
    OpSpec(
        name="collectives.reduce_scatter",
        family="collectives",
        signature_hooks=HOOKS,
        signature="reduce_scatter(x: Tensor[m, ...], group=None, op='sum', sizes=None) -> Tensor[m/world, ...]",
        reference=_reduce_scatter_ref,
        validate=_validate_reduce_scatter,
        description="reduce across ranks, rank r keeps row block r (sizes: uneven blocks)",
    ),
    OpSpec(
        name="collectives.all_gather_quantized",
        family="collectives",
        signature_hooks=HOOKS,
        signature="all_gather_quantized(x: Tensor[m, ...], group=None, block_size: int = 128) -> Tensor[world*m, ...]",
        reference=_all_gather_quantized_ref,
        validate=_validate_all_gather_quantized,
        description="all-gather that may send int8 + per-block fp32 scales (lossy, bounded; ZeRO-style param gather)",
    ),
    OpSpec(
        name="collectives.gemm_reduce_scatter",
        family="collectives",
        signature_hooks=HOOKS,
        signature="gemm_reduce_scatter(a: Tensor[m, k_local], b: Tensor[k_local, n], group=None) -> Tensor[m/world, n]",
        reference=_gemm_reduce_scatter_ref,
        validate=_validate_gemm_reduce_scatter,
        description="row-parallel linear: local GEMM then reduce-scatter of the partial sums",
    ),
    OpSpec(
        name="collectives.all_gather_gemm",
        family="collectives",
        signature_hooks=HOOKS,
        signature="all_gather_gemm(a: Tensor[m_local, k], b: Tensor[k, n_local], group=None) -> Tensor[world*m_local, n_local]",
        reference=_all_gather_gemm_ref,
        validate=_validate_all_gather_gemm,
        description="column-parallel linear on sequence-parallel input: all-gather rows of a, then GEMM",
    ),
]


def all_reduce(x, group=None, op: str = "sum"):
    """Sum (or max/min) ``x`` over the ranks of ``group``; returns a new tensor."""
    return fastpath.all_reduce(x, group, op)


def all_gather(x, group=None, sizes=None):
    """Concatenate every rank's ``x`` along dim 0; ``sizes`` allows uneven row counts."""
    return fastpath.all_gather(x, group, sizes)


def reduce_scatter(x, group=None, op: str = "sum", sizes=None):
    """Reduce ``x`` over the ranks; rank r returns row block r (``sizes`` for uneven blocks)."""
    return fastpath.reduce_scatter(x, group, op, sizes)


def all_gather_quantized(x, group=None, block_size: int = 128):
    """All-gather that may travel as int8 with one fp32 scale per ``block_size`` values (lossy)."""
    try:
        return call("collectives.all_gather_quantized", x, group, block_size)
    except RuntimeError as exc:  # (a try costs nothing until it catches)
        fastpath.fused_failed("collectives.all_gather_quantized", group, exc)


def gemm_reduce_scatter(a, b, group=None):
    """``reduce_scatter(a @ b)`` over dim 0 (row-parallel linear), possibly overlapped."""
    try:
        return call("collectives.gemm_reduce_scatter", a, b, group)
    except RuntimeError as exc:  # (a try costs nothing until it catches)
        fastpath.fused_failed("collectives.gemm_reduce_scatter", group, exc)


def all_gather_gemm(a, b, group=None):
    """``all_gather(a) @ b`` (column-parallel linear on sequence-parallel input), possibly overlapped."""
    try:
        return call("collectives.all_gather_gemm", a, b, group)
    except RuntimeError as exc:  # (a try costs nothing until it catches)
        fastpath.fused_failed("collectives.all_gather_gemm", group, exc)


# In place, for integrations that route a library's collectives (DeepSpeed's comm): the
# library's semantics (write into the argument; ``async_op=True`` returns a work handle
# whose ``wait()`` completes it). ``served(backend)`` is called with the implementation
# that ran, for the integration's counters.
all_reduce_ = fastpath.all_reduce_
all_gather_into = fastpath.all_gather_into
reduce_scatter_into = fastpath.reduce_scatter_into


# The conformance cases, re-exported here (imported last: a cases module may use this module's names).
from graft.ops.collectives.cases import CASES
