"""One-shot and two-shot all-reduce: the small-message technique of custom all-reduces.

One-shot: every rank reads *all* peers' inputs and reduces them locally. One step of
latency and ``(n-1) * size`` bytes in per rank: the winner for small messages, where a
ring all-reduce's ``2(n-1)`` latency-bound steps dominate.
Two-shot: rank r reads chunk r of every peer and reduces it (a reduce-scatter), then
every rank reads all reduced chunks (an all-gather). Two steps, ``2(n-1)/n * size``
bytes per rank: better than one-shot once bandwidth matters, still fewer steps than a
ring, so it covers the middle sizes until the library collective's pipelining wins.

Where it runs:

* GPU (NCCL group): on torch's symmetric memory (``torch.distributed._symmetric_memory``:
  buffers every rank of the group can load/store directly, plus signal pads for the
  barriers), through ``torch.ops.symm_mem.one_shot_all_reduce_copy`` /
  ``two_shot_all_reduce_out``. That is where these algorithms are faster than NCCL: one
  kernel, no proxy thread, no protocol handshakes. Sum only; needs peer access between all
  GPUs of the group (NVLink/xGMI, one node). If the rendezvous fails (no P2P, other
  nodes, old driver) the check returns the reason and the library all-reduce serves.
* CPU (gloo): the same data flow over library primitives (one-shot = all-gather of the
  inputs + local reduction; two-shot = all-to-all of chunks + local reduction +
  all-gather). Not faster than gloo's own all-reduce in general (see the benchmark); the
  point is a *deterministic* result: the reduction is a fixed rank-order loop in fp32
  (half types rounded once), so one-shot and two-shot give the same bits on every rank.
  On the CPU they are therefore off unless asked for (``GRAFT_COLLECTIVES_ALL_REDUCE=oneshot``
  or ``twoshot``), with the reason in the selection log.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from graft.custom_ops import define_op
from graft.platform import dtype_name
from graft.registry import Implementation
from graft.selection import explicitly_requested

from ._common import (
    all_gather_single,
    all_to_all_single,
    backend_name,
    max_world,
    message_bytes,
    oneshot_max_bytes,
    padded_flat,
    reduce_rows,
    resolve_group,
    twoshot_max_bytes,
)

ALGORITHMS = ("oneshot", "twoshot")


# ---------------------------------------------------------------------------- CPU / generic
def oneshot_generic(x: torch.Tensor, reduce_op: str, pg) -> torch.Tensor:
    ws = dist.get_world_size(pg)
    flat = x.reshape(-1).contiguous()
    gathered = flat.new_empty(ws * flat.numel())
    all_gather_single(gathered, flat, group=pg)
    return reduce_rows(gathered.view(ws, -1), reduce_op, x.dtype).view(x.shape)


def twoshot_generic(x: torch.Tensor, reduce_op: str, pg) -> torch.Tensor:
    ws = dist.get_world_size(pg)
    flat, chunk = padded_flat(x, ws)
    # Step 1: rank r receives chunk r of every peer (row p of `mine` = peer p's chunk r).
    mine = torch.empty_like(flat)
    all_to_all_single(mine, flat, group=pg)
    reduced = reduce_rows(mine.view(ws, chunk), reduce_op, x.dtype).contiguous()
    # Step 2: every rank collects all reduced chunks.
    out = torch.empty_like(flat)
    all_gather_single(out, reduced, group=pg)
    return out[: x.numel()].view(x.shape)


# ---------------------------------------------------------------------------- GPU symmetric memory
# What torch's symmetric-memory kernels accept (torch/csrc/distributed/c10d/symm_mem/
# CUDASymmetricMemoryOps.cu): anything else raises inside torch, so the check turns it
# into a fallback reason instead (logged once; the library all-reduce serves).
SYMM_MEM_DTYPES = (torch.float32, torch.bfloat16)  # AT_DISPATCH_FLOAT_AND_BFLOAT16
SYMM_MEM_REDUCE_OPS = ("sum",)
TWOSHOT_WORLD_SIZES = (2, 4, 8)  # two_shot_all_reduce_out: DISPATCH_WORLD_SIZES_NO_DEFAULT
SYMM_MEM_DEVICES = ("cuda",)  # CUDA and ROCm builds (torch calls both "cuda")


def symm_mem_reason(algorithm: str, device_type: str, dtype, numel: int, element_size: int,
                    storage_offset: int, world_size: int, reduce_op: str) -> str | None:
    """Why the symmetric-memory kernel cannot take this call (None: it can)."""
    if device_type not in SYMM_MEM_DEVICES:
        return f"symmetric memory needs a CUDA/ROCm device, got {device_type}"
    if dtype not in SYMM_MEM_DTYPES:
        return (f"dtype {dtype_name(dtype)}: the symmetric-memory kernels take float32 and "
                "bfloat16 only")
    if reduce_op not in SYMM_MEM_REDUCE_OPS:
        return f"reduce op {reduce_op!r}: the symmetric-memory kernels only sum"
    if algorithm == "twoshot" and world_size not in TWOSHOT_WORLD_SIZES:
        return f"world size {world_size}: the two-shot kernel is built for {', '.join(map(str, TWOSHOT_WORLD_SIZES))} ranks"
    # get_and_verify_alignment: byte size and byte offset multiples of max(4, element size);
    # one_shot_all_reduce_copy also needs the input's offset alignment (capped at 16) to match
    # the staging buffer's (offset 0): the offset must be a multiple of the size's alignment.
    align = max(4, element_size)
    nbytes = numel * element_size
    if nbytes % align:
        return f"{nbytes} bytes is not a multiple of {align}: the symmetric-memory kernels need {align}-byte sizes"
    offset_bytes = storage_offset * element_size
    if algorithm == "oneshot" and offset_bytes % _pow2_alignment(nbytes):
        return (f"input starts {offset_bytes} bytes into its storage: the one-shot kernel needs the input "
                "aligned like its staging buffer")
    return None


def _pow2_alignment(n: int) -> int:
    return min(16, n & -n) if n else 16


_symm_buffers: dict = {}  # (group name, device index) -> (buffer or None, reason or None)


def _symm_buffer(pg, device: torch.device):
    """The group's peer-mapped scratch buffer (allocated + rendezvous'd once, collectively)."""
    key = (pg.group_name, device.index)
    if key not in _symm_buffers:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(max(oneshot_max_bytes(), twoshot_max_bytes()), dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buf, pg.group_name)
            _symm_buffers[key] = (buf, None)
        except Exception as exc:  # no P2P, multi-node group, unsupported build...
            _symm_buffers[key] = (None, f"symmetric memory unavailable ({type(exc).__name__}: {exc})")
    return _symm_buffers[key]


def _symm_all_reduce(x: torch.Tensor, reduce_op: str, pg, algorithm: str) -> torch.Tensor:
    buf, reason = _symm_buffer(pg, x.device)
    if buf is None:  # the check prevents this; direct callers get the reason
        raise RuntimeError(reason)
    flat = x.reshape(-1).contiguous()
    staging = buf[: message_bytes(flat)].view(x.dtype)
    if algorithm == "oneshot":
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(staging, flat, reduce_op, pg.group_name)
    else:
        staging.copy_(flat)
        out = torch.empty_like(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(staging, reduce_op, pg.group_name, out)
    return out.view(x.shape)


# ---------------------------------------------------------------------------- custom ops
def _run(x: torch.Tensor, reduce_op: str, group_name: str, algorithm: str) -> torch.Tensor:
    pg = resolve_group(group_name)
    if x.device.type == "cuda":
        return _symm_all_reduce(x, reduce_op, pg, algorithm)
    fn = oneshot_generic if algorithm == "oneshot" else twoshot_generic
    return fn(x, reduce_op, pg)


def _oneshot(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return _run(x, reduce_op, group_name, "oneshot")


def _twoshot(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return _run(x, reduce_op, group_name, "twoshot")


def _fake(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


oneshot_op = define_op("collectives_all_reduce_oneshot", _oneshot, fake=_fake)
twoshot_op = define_op("collectives_all_reduce_twoshot", _twoshot, fake=_fake)
CUSTOM_OPS = {"oneshot": oneshot_op, "twoshot": twoshot_op}


def all_reduce(x, group=None, op: str = "sum", algorithm: str = "oneshot"):
    """Run one algorithm directly (tests, benchmark); normal code calls graft.ops.collectives.all_reduce."""
    return CUSTOM_OPS[algorithm](x, op, resolve_group(group).group_name)


# ---------------------------------------------------------------------------- selection
def make_check(algorithm: str):
    def check(x, group=None, op="sum"):
        pg = resolve_group(group)
        ws = dist.get_world_size(pg)
        nbytes = message_bytes(x)
        if ws > max_world():
            return f"world size {ws} > {max_world()} (GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD)"
        # No lower bound for two-shot: one-shot ranks first by default (backends sort
        # alphabetically after the listed ones), so it takes the small messages it accepts.
        high = oneshot_max_bytes() if algorithm == "oneshot" else twoshot_max_bytes()
        var = "GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES" if algorithm == "oneshot" else "GRAFT_TWOSHOT_ALLREDUCE_MAX_BYTES"
        if nbytes > high:
            return f"message of {nbytes} bytes > {high} ({var}); the library collective serves large messages"
        if x.device.type == "cuda":
            if "nccl" not in backend_name(pg):
                return f"GPU tensor on a {backend_name(pg)} group (needs NCCL + symmetric memory)"
            reason = symm_mem_reason(algorithm, x.device.type, x.dtype, x.numel(), x.element_size(),
                                     x.storage_offset(), ws, op)
            if reason is not None:
                return reason
            _, reason = _symm_buffer(pg, x.device)
            return reason
        # CPU: correct and deterministic, but not faster than gloo's all-reduce (bench.py).
        if not explicitly_requested("collectives.all_reduce", algorithm):
            return (f"on the CPU (gloo) {algorithm} is not faster than the library all-reduce; "
                    f"GRAFT_COLLECTIVES_ALL_REDUCE={algorithm} selects it (deterministic results)")
        return None

    return check




def register(registry) -> None:
    for algorithm in ALGORITHMS:
        registry.add_impl(
            Implementation(
                op="collectives.all_reduce",
                backend=algorithm,
                fn=lambda x, group=None, op="sum", _a=algorithm: all_reduce(x, group, op, _a),
                description=f"{algorithm} all-reduce (GPU: symmetric memory; CPU: deterministic over gloo)",
                devices=frozenset({"cpu", "cuda"}),
                dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
                check=make_check(algorithm),
                custom_op=CUSTOM_OPS[algorithm],
            )
        )
