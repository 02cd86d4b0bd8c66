"""graft's collectives ops against the plain ``torch.distributed`` calls a user would write
instead (``out = x.clone(); dist.all_reduce(out)``, ``dist.all_gather_into_tensor``,
``dist.reduce_scatter_tensor`` into a new tensor), same buffers, on every rank of the group.

A gloo collective on a shared CPU is noisy (a rank descheduled for a millisecond stalls
both), so: every batch starts on a barrier (both ranks time the same collectives), the
two variants alternate which goes first, and the ratio is the median over many rounds of
the per-round ratio (each pair measured back to back)."""
from __future__ import annotations

import torch

from graft.tools.bench.timing import interleaved

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def library_calls(x, world: int) -> dict:
    """What each graft collective replaces, written as with torch.distributed alone."""
    import torch.distributed as dist

    all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce():
        out = x.clone()
        dist.all_reduce(out)
        return out

    def all_gather():
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_tensor(out, x)
        return out

    def reduce_scatter():
        out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
        reduce_scatter_tensor(out, x)
        return out

    return {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}


def measure(numel: int, rounds: int, inner: int, progress=print) -> list:
    import torch.distributed as dist

    from graft.ops import collectives

    world = dist.get_world_size()
    x = torch.randn(numel - numel % world, generator=torch.Generator().manual_seed(dist.get_rank()))
    library = library_calls(x, world)
    rows = []
    for name in OPS:
        op = f"collectives.{name}"
        graft_fn = getattr(collectives, name)
        torch.testing.assert_close(graft_fn(x), library[name](), rtol=0, atol=0)  # the same collective
        times = interleaved({"graft": lambda: graft_fn(x), "library": library[name]}, rounds=rounds,
                            inner=inner, sync=dist.barrier)
        row = {"op": op, "numel": x.numel(), "world": world, "rounds": rounds, "inner": inner,
               "library_us": times["library"] * 1e6, "graft_us": times["graft"] * 1e6,
               "ratio": times.ratio("graft", "library")}
        progress(f"  {op:32s} {x.numel()} fp32 x {world} ranks: torch.distributed {row['library_us']:8.1f} us, "
                 f"graft {row['graft_us']:8.1f} us -> {row['ratio']:.3f}x (median of {rounds} per-round ratios)")
        rows.append(row)
    return rows
