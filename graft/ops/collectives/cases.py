"""The collectives' conformance cases. They run inside a process group (graft's conformance runs them
per rank); inputs depend on the rank, so a reduction is not trivially ``world_size * x``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from graft.cases import OpCase


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rand(shape, device, dtype, gen, rank_salt=True):
    if rank_salt:
        for _ in range(_rank()):
            torch.rand(1, generator=gen)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _ar_case(name, shape, op="sum", tags=("quick",)):
    return OpCase("collectives.all_reduce", name,
                  lambda device, dtype, gen: ((_rand(shape, device, dtype, gen), None, op), {}),
                  tags=frozenset(tags))


CASES = [
    _ar_case("n1", (1,)),
    _ar_case("n1023", (1023,)),
    _ar_case("m7_n33_max", (7, 33), op="max"),
    _ar_case("n4m", (4 * 1024 * 1024,), tags=("gpu",)),
    OpCase("collectives.all_gather", "m5_n17",
           lambda device, dtype, gen: ((_rand((5, 17), device, dtype, gen), None, None), {})),
    OpCase("collectives.reduce_scatter", "m_world_x6_n9",
           lambda device, dtype, gen: ((_rand((6 * _world(), 9), device, dtype, gen), None, "sum", None), {})),
    OpCase("collectives.all_gather_quantized", "m3_n200",
           lambda device, dtype, gen: ((_rand((3, 200), device, dtype, gen), None, 64), {})),
    OpCase("collectives.gemm_reduce_scatter", "m_world_x8_k24_n20",
           lambda device, dtype, gen: ((_rand((8 * _world(), 24), device, dtype, gen),
                                        _rand((24, 20), device, dtype, gen, False), None), {})),
    OpCase("collectives.all_gather_gemm", "m9_k24_n20",
           lambda device, dtype, gen: ((_rand((9, 24), device, dtype, gen),
                                        _rand((24, 20), device, dtype, gen, False), None), {})),
]
