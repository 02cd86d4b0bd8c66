"""Route ``deepspeed.comm`` collectives through graft's ``collectives`` ops.

Every ``deepspeed.comm.all_reduce(...)`` (and friends) calls the module-global backend
object ``deepspeed.comm.comm.cdb``, a ``TorchBackend`` that wraps ``torch.distributed``.
``GraftTorchBackend`` is that class with the data-moving collectives ZeRO uses
(all-reduce, all-gather into a flat tensor, reduce-scatter of a flat tensor, list
all-gather) and the inference all-reduce of tensor-parallel inference (AutoTP) sent to
``graft.ops.collectives`` instead; everything else (groups, barriers,
point-to-point, broadcast) is DeepSpeed's own code.

Each routed call asks graft's selection which implementation serves it. When that is
graft's torch backend (the library collective, which is what graft's reference runs),
DeepSpeed's own in-place call runs, ``async_op=True`` handles and all, so graft costs
only the selection. Another implementation (one-shot, two-shot, a vendor kernel) is
functional: it returns a new tensor, which is copied into DeepSpeed's, and it runs
synchronously (an ``async_op=True`` caller gets a completed handle). Calls graft does not serve (other reduce ops such as AVG/PRODUCT, integer tensors) go to
``torch.distributed`` exactly as without graft, and are counted as fallbacks (each reason
logged once at INFO on ``graft.integration.deepspeed``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.comm.torch import TorchBackend

from graft.adapters.deepspeed.stats import count, fallback, served
from graft.config import REFERENCE_BACKEND

# The dtypes graft's collectives ops are specified for.
ROUTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_NAMES = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"))


class CompletedWork:
    """The handle an ``async_op=True`` caller gets: graft finished the collective already."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None


def _done(async_op):
    return CompletedWork() if async_op else None


def _reduce_name(op):
    for torch_op, name in _REDUCE_NAMES:
        if op == torch_op:
            return name
    return None


def _unroutable_reason(*tensors) -> str | None:
    """Why graft's collectives cannot take these tensors (None: they can)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return f"argument of type {type(t).__name__}"
        if t.dtype not in ROUTED_DTYPES:
            return f"dtype {t.dtype}"
    if any(t.dtype != tensors[0].dtype for t in tensors):
        return "input and output dtypes differ"
    return None


def _reduce_reason(name, op) -> str | None:
    return f"reduce op {op}" if name is None else None


def _library_serves(kind: str, args: tuple) -> bool:
    """True (and counted as served by graft's torch backend) when graft's choice for
    ``collectives.<kind>(*args)`` is the library collective: the caller then runs DeepSpeed's
    own in-place call."""
    from graft.dispatch import select

    impl = select(f"collectives.{kind}", *args)
    if impl.backend != REFERENCE_BACKEND:
        return False
    served(f"collectives.{kind}", impl.backend)
    return True


def graft_collective(kind: str, x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """The single routing target: one graft collective on a flat tensor, result returned.

    ``kind`` is ``all_reduce``, ``all_gather`` or ``reduce_scatter`` (graft op names).
    """
    from graft.dispatch import run

    flat = x.reshape(-1)
    if kind in ("all_reduce", "reduce_scatter"):
        args = (flat, group, op)
    elif kind == "all_gather":
        args = (flat, group)
    else:
        raise ValueError(f"unknown collective {kind!r}")
    out, impl = run(f"collectives.{kind}", *args)
    served(f"collectives.{kind}", impl.backend)
    return out


class GraftTorchBackend(TorchBackend):
    """DeepSpeed's torch.distributed backend with ZeRO's collectives served by graft."""

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _reduce_name(self._reduce_op(op))
        reason = _reduce_reason(name, op) or _unroutable_reason(tensor)
        if reason is not None:
            fallback("all_reduce", reason)
            return super().all_reduce(tensor, op, group, async_op)
        if _library_serves("all_reduce", (tensor.reshape(-1), group, name)):
            return super().all_reduce(tensor, op, group, async_op)
        with torch.no_grad():
            tensor.copy_(graft_collective("all_reduce", tensor, group, name).view(tensor.shape))
        return _done(async_op)

    def inference_all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None):
        """The all-reduce of DeepSpeed's tensor-parallel inference (AutoTP's LinearAllreduce)."""
        if dist.get_world_size(group=group) <= 1:
            return tensor
        name = _reduce_name(self._reduce_op(op))
        reason = _reduce_reason(name, op) or _unroutable_reason(tensor)
        if reason is not None:
            fallback("inference_all_reduce", reason)
            return super().inference_all_reduce(tensor, op, group)
        if _library_serves("all_reduce", (tensor.reshape(-1), group, name)):
            count("inference_all_reduce")
            return super().inference_all_reduce(tensor, op, group)
        with torch.no_grad():
            tensor.copy_(graft_collective("all_reduce", tensor, group, name).view(tensor.shape))
        count("inference_all_reduce")
        return tensor

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        reason = _unroutable_reason(output_tensor, input_tensor)
        if reason is not None:
            fallback("all_gather_into_tensor", reason)
            return super().all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
        if _library_serves("all_gather", (input_tensor.reshape(-1), group)):
            return super().all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
        with torch.no_grad():
            output_tensor.copy_(graft_collective("all_gather", input_tensor, group).view(output_tensor.shape))
        return _done(async_op)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _reduce_name(self._reduce_op(op))
        reason = _reduce_reason(name, op) or _unroutable_reason(output_tensor, input_tensor)
        if reason is not None:
            fallback("reduce_scatter_tensor", reason)
            return super().reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)
        if _library_serves("reduce_scatter", (input_tensor.reshape(-1), group, name)):
            return super().reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)
        with torch.no_grad():
            output_tensor.copy_(graft_collective("reduce_scatter", input_tensor, group, name).view(output_tensor.shape))
        return _done(async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        same = all(t.shape == tensor.shape and t.dtype == tensor.dtype for t in tensor_list)
        reason = None if same else "output list differs from the input in shape or dtype"
        reason = reason or _unroutable_reason(tensor)
        if reason is not None:
            fallback("all_gather", reason)
            return super().all_gather(tensor_list, tensor, group, async_op)
        if _library_serves("all_gather", (tensor.reshape(-1), group)):
            return super().all_gather(tensor_list, tensor, group, async_op)
        with torch.no_grad():
            gathered = graft_collective("all_gather", tensor, group).view(len(tensor_list), *tensor.shape)
            for dst, src in zip(tensor_list, gathered):
                dst.copy_(src)
        return _done(async_op)


def install():
    """Make new and existing DeepSpeed comm backends graft's; returns an undo function."""
    import deepspeed.comm.comm as ds_comm

    previous_class = ds_comm.TorchBackend
    ds_comm.TorchBackend = GraftTorchBackend  # init_distributed() builds cdb from this name
    swapped = None
    if type(ds_comm.cdb) is TorchBackend:  # already initialized: same state, graft's methods
        swapped = ds_comm.cdb
        swapped.__class__ = GraftTorchBackend

    def undo():
        ds_comm.TorchBackend = previous_class
        if swapped is not None and type(swapped) is GraftTorchBackend:
            swapped.__class__ = TorchBackend

    return undo


def is_installed() -> bool:
    import deepspeed.comm.comm as ds_comm

    return ds_comm.TorchBackend is GraftTorchBackend or type(ds_comm.cdb) is GraftTorchBackend
