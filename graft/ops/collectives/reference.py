"""The references of the collectives: the plain library collectives and the non-overlapped compute."""
from __future__ import annotations

import torch
import torch.distributed as dist

from graft.kernels.collectives._common import (all_gather_single, all_reduce_inplace, reduce_scatter_single,
                                               resolve_group)


def _all_reduce_ref(x, group=None, op="sum"):
    out = x.contiguous().clone()
    all_reduce_inplace(out, op, resolve_group(group))
    return out


def _all_gather_ref(x, group=None, sizes=None):
    pg = resolve_group(group)
    ws = dist.get_world_size(pg)
    x = x.contiguous()
    if sizes is None:
        out = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_single(out, x, group=pg)
        return out
    # Uneven shards: the library gathers equal sizes only, so pad each to the largest.
    biggest = max(sizes)
    padded = x.new_zeros((biggest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((ws * biggest,) + tuple(x.shape[1:]))
    all_gather_single(out, padded, group=pg)
    return torch.cat([out[r * biggest : r * biggest + n] for r, n in enumerate(sizes)])


def _reduce_scatter_ref(x, group=None, op="sum", sizes=None):
    pg = resolve_group(group)
    ws, rank = dist.get_world_size(pg), dist.get_rank(pg)
    x = x.contiguous()
    rest = tuple(x.shape[1:])
    if sizes is None:
        out = x.new_empty((x.shape[0] // ws,) + rest)
        reduce_scatter_single(out, x, op, group=pg)
        return out
    biggest = max(sizes)
    padded = x.new_zeros((ws * biggest,) + rest)
    start = 0
    for r, n in enumerate(sizes):
        padded[r * biggest : r * biggest + n] = x[start : start + n]
        start += n
    out = x.new_empty((biggest,) + rest)
    reduce_scatter_single(out, padded, op, group=pg)
    return out[: sizes[rank]].clone()


def _all_gather_quantized_ref(x, group=None, block_size=128):
    # The exact gather that the quantized implementations approximate (see
    # graft.kernels.collectives.all_gather_quantized for the error bound).
    return _all_gather_ref(x, group)


def _gemm_reduce_scatter_ref(a, b, group=None):
    return _reduce_scatter_ref(a @ b, group)


def _all_gather_gemm_ref(a, b, group=None):
    return _all_gather_ref(a, group) @ b
