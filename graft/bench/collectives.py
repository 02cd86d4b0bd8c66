"""graft's collectives ops against the library collective they replace (their torch
reference: ``torch.distributed``), same buffers, interleaved, on every rank of the group."""
from __future__ import annotations

import torch

from graft.bench.timing import interleaved

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def measure(numel: int, rounds: int, inner: int, progress=print) -> list:
    import torch.distributed as dist

    import graft
    from graft.ops import collectives

    registry = graft.get_registry()
    world = dist.get_world_size()
    x = torch.randn(numel - numel % world, generator=torch.Generator().manual_seed(dist.get_rank()))
    rows = []
    for name in OPS:
        op = f"collectives.{name}"
        graft_fn = getattr(collectives, name)
        library = registry.op(op).reference
        times = interleaved({"graft": lambda: graft_fn(x), "library": lambda: library(x)}, rounds=rounds,
                            inner=inner, sync=dist.barrier)
        row = {"op": op, "numel": x.numel(), "world": world, "library_us": times["library"] * 1e6,
               "graft_us": times["graft"] * 1e6, "ratio": times.ratio("graft", "library")}
        progress(f"  {op:32s} {x.numel()} fp32 x {world} ranks: torch.distributed {row['library_us']:8.1f} us, "
                 f"graft {row['graft_us']:8.1f} us -> {row['ratio']:.2f}x")
        rows.append(row)
    return rows
