"""What every collectives implementation needs: process groups by name, reduce ops,
the size/topology thresholds (environment variables) and flat padding helpers.

Custom ops cannot carry a ``ProcessGroup`` object through a ``torch.library`` schema,
so every graft collective custom op takes the group's *name* (``group.group_name``)
and resolves it here with torch's own registry of process groups.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from graft.config import declare_env_var
from graft.errors import GraftConfigError

ONESHOT_MAX_BYTES_VAR = declare_env_var(
    "GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES",
    "largest message (bytes) the one-shot custom all-reduce serves (default 524288 = 512 KiB)",
)
TWOSHOT_MAX_BYTES_VAR = declare_env_var(
    "GRAFT_TWOSHOT_ALLREDUCE_MAX_BYTES",
    "largest message (bytes) the two-shot custom all-reduce serves (default 8388608 = 8 MiB)",
)
MAX_WORLD_VAR = declare_env_var(
    "GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD",
    "largest group size the one-shot/two-shot all-reduce serves (default 8)",
)
OVERLAP_CHUNKS_VAR = declare_env_var(
    "GRAFT_OVERLAP_CHUNKS",
    "pipeline depth (chunks) of the GEMM + collective overlap ops (default 4)",
)

OVERLAP_MIN_BYTES_VAR = declare_env_var(
    "GRAFT_OVERLAP_MIN_BYTES",
    "smallest collective (bytes) the GEMM + collective overlap ops pipeline (default 1048576 = 1 MiB)",
)
QUANT_MIN_BYTES_VAR = declare_env_var(
    "GRAFT_QUANTIZED_GATHER_MIN_BYTES",
    "smallest per-rank input (bytes) the int8 all-gather quantizes; smaller ones gather exactly (default 65536)",
)

DEFAULT_ONESHOT_MAX_BYTES = 512 * 1024
DEFAULT_TWOSHOT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_WORLD = 8
DEFAULT_OVERLAP_CHUNKS = 4
DEFAULT_OVERLAP_MIN_BYTES = 1024 * 1024
DEFAULT_QUANT_MIN_BYTES = 64 * 1024

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer variable; a clear GraftConfigError for anything else."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip().lower().replace("_", "")
    scale = 1
    for suffix, factor in (("kib", 1024), ("mib", 1024**2), ("gib", 1024**3), ("k", 1024), ("m", 1024**2)):
        if text.endswith(suffix):
            text, scale = text[: -len(suffix)], factor
            break
    try:
        value = int(text) * scale
    except ValueError:
        raise GraftConfigError(
            f"{name}={raw!r} is not an integer; give a whole number (suffixes KiB/MiB/GiB allowed), e.g. {default}"
        ) from None
    if value < minimum:
        raise GraftConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def oneshot_max_bytes() -> int:
    return env_int(ONESHOT_MAX_BYTES_VAR, DEFAULT_ONESHOT_MAX_BYTES)


def twoshot_max_bytes() -> int:
    return env_int(TWOSHOT_MAX_BYTES_VAR, DEFAULT_TWOSHOT_MAX_BYTES)


def max_world() -> int:
    return env_int(MAX_WORLD_VAR, DEFAULT_MAX_WORLD, minimum=1)


def overlap_chunks() -> int:
    return env_int(OVERLAP_CHUNKS_VAR, DEFAULT_OVERLAP_CHUNKS, minimum=1)


def overlap_min_bytes() -> int:
    return env_int(OVERLAP_MIN_BYTES_VAR, DEFAULT_OVERLAP_MIN_BYTES)


def quantized_min_bytes() -> int:
    return env_int(QUANT_MIN_BYTES_VAR, DEFAULT_QUANT_MIN_BYTES)


def explicitly_requested(op: str, backend: str) -> bool:
    """Does the priority variable in force for ``op`` (op, family, then global) name ``backend``?

    Implementations that are correct but not faster on some device (the CPU) step aside
    unless the user asked for them by name.
    """
    from graft.config import op_env_var, split_list

    for var in (op_env_var(op), op_env_var(op.split(".")[0]), "GRAFT_BACKENDS"):
        if var in os.environ:
            return backend in split_list(os.environ[var])
    return False


def resolve_group(group=None):
    """A ProcessGroup from None (world), a ProcessGroup, or a group name."""
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group if group is not None else dist.group.WORLD


def group_name(group=None) -> str:
    return resolve_group(group).group_name


def world_size(group=None) -> int:
    return dist.get_world_size(resolve_group(group))


def group_rank(group=None) -> int:
    return dist.get_rank(resolve_group(group))


def backend_name(group=None) -> str:
    return str(dist.get_backend(resolve_group(group))).lower()


def message_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def padded_flat(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, int]:
    """``x`` flattened and zero-padded to a multiple of ``parts``; returns (flat, chunk length)."""
    flat = x.reshape(-1)
    chunk = -(-flat.numel() // parts) if flat.numel() else 0
    pad = chunk * parts - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.contiguous(), chunk


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision inputs accumulate in fp32 (rounded once at the end)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def reduce_rows(rows: torch.Tensor, reduce_op: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Reduce ``rows[0], rows[1], ...`` in that fixed rank order.

    An explicit left-to-right loop (not ``rows.sum(0)``, whose order is the kernel's
    business) makes the result independent of the algorithm that delivered the rows,
    so one-shot and two-shot agree bit for bit, and every rank gets the same bits.
    """
    if reduce_op == "sum":
        acc = rows[0].to(accumulate_dtype(rows.dtype), copy=True)
        for r in range(1, rows.shape[0]):
            acc.add_(rows[r])
        return acc.to(out_dtype)
    fn = torch.maximum if reduce_op == "max" else torch.minimum
    acc = rows[0]
    for r in range(1, rows.shape[0]):
        acc = fn(acc, rows[r])
    return acc.to(out_dtype)


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older
# torch only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output, input, group=None, async_op=False):
    """Gather every rank's ``input`` (same shape on all) into ``output`` (world_size x larger)."""
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op="sum", group=None, async_op=False):
    """Reduce ``input`` over the ranks; rank r receives block r into ``output``."""
    return _reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=group, async_op=async_op)
