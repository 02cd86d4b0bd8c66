"""GEMM + collective overlap for tensor-parallel linear layers.

Row-parallel linear (``gemm_reduce_scatter``): ``a [M, K_local] @ b [K_local, N]`` gives
partial sums that are reduce-scattered over M. The GEMM is split into ``chunks`` pieces
of every rank's row block; as soon as piece j is computed its reduce-scatter is started
asynchronously (a work handle) and piece j+1 is computed while it travels. Only the last
piece's communication is exposed.

Column-parallel linear on sequence-parallel input (``all_gather_gemm``): ``a [M_local, K]``
is gathered over ranks, then multiplied by ``b [K, N_local]``. All pieces' all-gathers are
started up front; piece j's GEMM runs as soon as its rows arrived, while later pieces are
still in flight. Only the first piece's communication is exposed.

Correctness versus the non-overlapped reference: every output row is the same dot
products over the same K (the GEMM is split over rows only, never over K), so the local
products match the unsplit GEMM bit for bit whenever the GEMM library's per-row results do
not depend on M. BLAS libraries often do depend on it (MKL/oneDNN on this CPU pick other
micro-kernels for other M, so a row of ``a[rows] @ b`` can differ in the last bit from the
same row of ``a @ b``). The tests therefore check: bit equality on fp32 with 2 ranks
(where the cross-rank sum a+b is order-free) whenever the chunk GEMMs reproduce the full
GEMM's rows, and a tight tolerance always. With more than two ranks the library may also
sum in another order for a smaller message, hence tolerance only.

Where it pays: whenever the GEMM time of a piece is comparable to its communication
(large M, N); the per-chunk overhead (an extra copy of a's rows, more, smaller GEMMs)
makes it a loss for small problems, which the check refuses (fewer rows than 2 chunks, or a
collective under ``GRAFT_OVERLAP_MIN_BYTES``, default 1 MiB). On the CPU (gloo) the
communication thread competes with the GEMM for the same cores and the benchmark shows no
gain, so there it runs only when named (``GRAFT_COLLECTIVES_GEMM_REDUCE_SCATTER=overlap``).
On GPUs torch also offers symmetric-memory fused versions
(``torch.distributed._symmetric_memory._fused_matmul_reduce_scatter``); this module uses
only portable library collectives so the same code runs on NCCL, RCCL and gloo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from graft.custom_ops import define_op
from graft.registry import Implementation
from graft.selection import explicitly_requested

from ._common import (
    all_gather_single,
    overlap_chunks,
    overlap_min_bytes,
    reduce_scatter_single,
    resolve_group,
    wait,
)


def _pieces(rows: int, chunks: int) -> list:
    """Split ``range(rows)`` into at most ``chunks`` contiguous, non-empty (start, end) pieces."""
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for j in range(chunks):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _gemm_rs(a: torch.Tensor, b: torch.Tensor, chunks: int, group_name: str) -> torch.Tensor:
    pg = resolve_group(group_name)
    ws = dist.get_world_size(pg)
    block = a.shape[0] // ws
    out = a.new_empty((block, b.shape[1]))
    a_blocks = a.view(ws, block, a.shape[1])
    pending = []
    for start, end in _pieces(block, chunks):
        # Rows [start, end) of every rank's block: after the reduce-scatter this rank keeps its own.
        partial = (a_blocks[:, start:end].reshape(-1, a.shape[1]) @ b).contiguous()
        work = reduce_scatter_single(out[start:end], partial, group=pg, async_op=True)
        pending.append((work, partial))  # keep `partial` alive until its collective finished
    for work, _ in pending:
        wait(work)
    return out


def _ag_gemm(a: torch.Tensor, b: torch.Tensor, chunks: int, group_name: str) -> torch.Tensor:
    pg = resolve_group(group_name)
    ws = dist.get_world_size(pg)
    rows = a.shape[0]
    out = a.new_empty((ws, rows, b.shape[1]))
    in_flight = []
    for start, end in _pieces(rows, chunks):
        piece = a[start:end].contiguous()
        gathered = a.new_empty((ws * (end - start), a.shape[1]))
        work = all_gather_single(gathered, piece, group=pg, async_op=True)
        in_flight.append((start, end, work, gathered, piece))
    for start, end, work, gathered, _ in in_flight:
        wait(work)
        out[:, start:end] = (gathered @ b).view(ws, end - start, b.shape[1])
    return out.view(ws * rows, b.shape[1])


def _gemm_rs_fake(a: torch.Tensor, b: torch.Tensor, chunks: int, group_name: str) -> torch.Tensor:
    ws = dist.get_world_size(resolve_group(group_name))
    return a.new_empty((a.shape[0] // ws, b.shape[1]))


def _ag_gemm_fake(a: torch.Tensor, b: torch.Tensor, chunks: int, group_name: str) -> torch.Tensor:
    ws = dist.get_world_size(resolve_group(group_name))
    return a.new_empty((ws * a.shape[0], b.shape[1]))


gemm_reduce_scatter_op = define_op("collectives_gemm_reduce_scatter_overlap", _gemm_rs, fake=_gemm_rs_fake)
all_gather_gemm_op = define_op("collectives_all_gather_gemm_overlap", _ag_gemm, fake=_ag_gemm_fake)


def gemm_reduce_scatter(a, b, group=None, chunks: int | None = None):
    return gemm_reduce_scatter_op(a.contiguous(), b.contiguous(), chunks or overlap_chunks(),
                                  resolve_group(group).group_name)


def all_gather_gemm(a, b, group=None, chunks: int | None = None):
    return all_gather_gemm_op(a.contiguous(), b.contiguous(), chunks or overlap_chunks(),
                              resolve_group(group).group_name)


def _overlap_check(op: str, rows: int, comm_bytes: int, device_type: str) -> str | None:
    chunks = overlap_chunks()
    if chunks < 2:
        return "GRAFT_OVERLAP_CHUNKS=1: nothing to overlap"
    if rows < 2:
        return f"{rows} row(s) per rank: too few to split into pipeline chunks"
    if comm_bytes < overlap_min_bytes():
        return f"collective of {comm_bytes} bytes < {overlap_min_bytes()} (GRAFT_OVERLAP_MIN_BYTES): chunking costs more"
    if device_type == "cpu" and not explicitly_requested(op, "overlap"):
        # gloo's communication thread competes with the GEMM for the same cores (bench.py).
        return "on the CPU the overlap does not pay (gloo and the GEMM share cores); name 'overlap' to force it"
    return None


def _check_gemm_rs(a, b, group=None):
    ws = dist.get_world_size(resolve_group(group))
    return _overlap_check("collectives.gemm_reduce_scatter", a.shape[0] // ws,
                          a.shape[0] * b.shape[1] * a.element_size(), a.device.type)


def _check_ag_gemm(a, b, group=None):
    ws = dist.get_world_size(resolve_group(group))
    return _overlap_check("collectives.all_gather_gemm", a.shape[0], ws * a.numel() * a.element_size(), a.device.type)


def register(registry) -> None:
    floats = frozenset({torch.float16, torch.bfloat16, torch.float32})
    registry.add_impl(Implementation(
        op="collectives.gemm_reduce_scatter", backend="overlap", fn=gemm_reduce_scatter,
        description="chunked GEMM pipelined with async reduce-scatter",
        devices=frozenset({"cpu", "cuda"}), dtypes=floats, check=_check_gemm_rs,
        custom_op=gemm_reduce_scatter_op,
    ))
    registry.add_impl(Implementation(
        op="collectives.all_gather_gemm", backend="overlap", fn=all_gather_gemm,
        description="chunked async all-gather pipelined with the GEMM",
        devices=frozenset({"cpu", "cuda"}), dtypes=floats, check=_check_ag_gemm,
        custom_op=all_gather_gemm_op,
    ))
