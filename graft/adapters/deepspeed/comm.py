"""Route ``deepspeed.comm`` collectives through graft's ``collectives`` ops.

Every ``deepspeed.comm.all_reduce(...)`` (and friends) calls the module-global backend
object ``deepspeed.comm.comm.cdb``, a ``TorchBackend`` that wraps ``torch.distributed``.
``GraftTorchBackend`` is that class with the data-moving collectives ZeRO uses
(all-reduce, all-gather into a flat tensor, reduce-scatter of a flat tensor, list
all-gather) and the inference all-reduce of tensor-parallel inference (AutoTP) sent to
``graft.ops.collectives`` instead; everything else (groups, barriers,
point-to-point, broadcast) is DeepSpeed's own code.

Each routed call goes through graft's in-place collectives (``all_reduce_``,
``all_gather_into``, ``reduce_scatter_into``): where graft selects the library collective
(the default on the CPU) it runs on DeepSpeed's own tensors with DeepSpeed's ``async_op``,
so ZeRO keeps its communication overlap and gets a real work handle; graft's own
algorithms (one-shot, two-shot) write their result into place.
Calls graft does not serve (other reduce ops such as AVG/PRODUCT, integer tensors) go to
``torch.distributed`` exactly as without graft, and are counted as fallbacks (each reason
logged once at INFO on ``graft.integration.deepspeed``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.comm.torch import TorchBackend

from graft.adapters.deepspeed.integration import counter

# The dtypes graft's collectives ops are specified for.
ROUTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_NAMES = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"))


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


def _served(kind: str):
    """The counter callback of one routed collective: ``collectives.<kind>`` and, per
    implementation, ``collectives.<kind>:<backend>``."""
    key = f"collectives.{kind}"

    def served(backend: str) -> None:
        counter.count(key)
        counter.count(f"{key}:{backend}")

    return served


_SERVED = {kind: _served(kind) for kind in ("all_reduce", "all_gather", "reduce_scatter")}


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def graft_collective(kind: str, x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """One functional graft collective on a flat tensor, result returned (counted).

    ``kind`` is ``all_reduce``, ``all_gather`` or ``reduce_scatter`` (graft op names).
    """
    from graft.kernels.collectives import fastpath

    flat = x.reshape(-1)
    args = {"all_reduce": (flat, group, op), "all_gather": (flat, group, None),
            "reduce_scatter": (flat, group, op, None)}.get(kind)
    if args is None:
        raise ValueError(f"unknown collective {kind!r}")
    _SERVED[kind](fastpath.plan(f"collectives.{kind}", *args).backend)
    return fastpath.run(f"collectives.{kind}", *args)


class GraftTorchBackend(TorchBackend):
    """DeepSpeed's torch.distributed backend with ZeRO's collectives served by graft."""

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _reduce_name(self._reduce_op(op))
        reason = _reduce_reason(name, op) or _unroutable_reason(tensor)
        if reason is not None:
            counter.fallback("all_reduce", reason)
            return super().all_reduce(tensor, op, group, async_op)
        from graft.kernels.collectives._common import Work, resolve_group
        from graft.ops import collectives

        if tensor.is_contiguous():
            return collectives.all_reduce_(_flat(tensor), group, name, async_op, served=_SERVED["all_reduce"])
        with torch.no_grad():  # a strided view: reduce a copy, synchronously
            tensor.copy_(graft_collective("all_reduce", tensor, group, name).view(tensor.shape))
        return Work(None, "collectives.all_reduce", resolve_group(group)) if async_op else None

    def inference_all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None):
        """The all-reduce of DeepSpeed's tensor-parallel inference (AutoTP's LinearAllreduce)."""
        if dist.get_world_size(group=group) <= 1:
            return tensor
        name = _reduce_name(self._reduce_op(op))
        reason = _reduce_reason(name, op) or _unroutable_reason(tensor)
        if reason is not None:
            counter.fallback("inference_all_reduce", reason)
            return super().inference_all_reduce(tensor, op, group)
        from graft.ops import collectives

        if tensor.is_contiguous():
            collectives.all_reduce_(_flat(tensor), group, name, served=_SERVED["all_reduce"])
        else:
            with torch.no_grad():
                tensor.copy_(graft_collective("all_reduce", tensor, group, name).view(tensor.shape))
        counter.count("inference_all_reduce")
        return tensor

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        reason = _unroutable_reason(output_tensor, input_tensor)
        if reason is not None:
            counter.fallback("all_gather_into_tensor", reason)
            return super().all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
        from graft.ops import collectives

        return collectives.all_gather_into(output_tensor, _flat(input_tensor), group, async_op,
                                           served=_SERVED["all_gather"])

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = _reduce_name(self._reduce_op(op))
        reason = _reduce_reason(name, op) or _unroutable_reason(output_tensor, input_tensor)
        if reason is not None:
            counter.fallback("reduce_scatter_tensor", reason)
            return super().reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)
        from graft.ops import collectives

        return collectives.reduce_scatter_into(output_tensor, _flat(input_tensor), group, name, async_op,
                                               served=_SERVED["reduce_scatter"])

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        same = all(t.shape == tensor.shape and t.dtype == tensor.dtype for t in tensor_list)
        reason = None if same else "output list differs from the input in shape or dtype"
        reason = reason or _unroutable_reason(tensor)
        if reason is not None:
            counter.fallback("all_gather", reason)
            return super().all_gather(tensor_list, tensor, group, async_op)
        from graft.kernels.collectives._common import Work, resolve_group
        from graft.ops import collectives

        gathered = tensor.new_empty((len(tensor_list) * tensor.numel(),))
        work = collectives.all_gather_into(gathered, _flat(tensor), group, True, served=_SERVED["all_gather"])

        def scatter_into_list():
            work.wait()
            with torch.no_grad():
                for dst, src in zip(tensor_list, gathered.view(len(tensor_list), *tensor.shape)):
                    dst.copy_(src)

        handle = Work(None, "collectives.all_gather", resolve_group(group), finish=scatter_into_list)
        if async_op:
            return handle
        handle.wait()
        return None


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
        # The live backend too, whether it was swapped above or built by init_distributed()
        # while graft was active: after deactivate() DeepSpeed's collectives are its own.
        for backend in (swapped, ds_comm.cdb):
            if backend is not None and type(backend) is GraftTorchBackend:
                backend.__class__ = TorchBackend

    return undo


def is_installed() -> bool:
    import deepspeed.comm.comm as ds_comm

    return ds_comm.TorchBackend is GraftTorchBackend or type(ds_comm.cdb) is GraftTorchBackend
