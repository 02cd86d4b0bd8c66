"""Op test/benchmark cases: the shape/dtype matrix each op is checked and timed on.

Op family modules (``graft.ops.<family>``) export ``CASES``: a list of :class:`OpCase`.
The conformance suite runs every registered implementation on every case against the
op's torch reference; adapters add cases through the ``graft_conformance_cases`` hook.

Tags: ``"quick"`` cases are small enough for the CPU (Triton interpreter) default run;
``"gpu"`` cases are the sizes worth timing on an accelerator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class OpCase:
    op: str  # op name, e.g. "gemm.linear"
    name: str  # short shape description, e.g. "m127_n65_k96_bias_gelu"
    # (device, dtype, generator) -> (args, kwargs); must be deterministic given the generator.
    make_inputs: Callable
    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)
    tags: frozenset = field(default_factory=lambda: frozenset({"quick"}))
    # Optional: reduce an op's output to comparable tensors (e.g. drop padding), output -> tensor or tuple.
    normalize: Callable | None = None
    # FLOPs or bytes moved for one call, for throughput columns: (args, kwargs) -> float.
    flops: Callable | None = None
    # Optional numerics overrides for this case (see graft.tools.conformance.tolerances): a float for
    # every dtype or a {dtype: float} dict. atol is relative to the output's RMS, rtol to each element.
    atol: float | dict | None = None
    rtol: float | dict | None = None
    # Accumulation length of the op's longest reduction, (args, kwargs) -> int (e.g. K of a GEMM),
    # so that tolerances can grow with it; None means a short reduction.
    reduction: Callable | None = None

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}]"

    def inputs(self, device, dtype, seed: int = 0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return self.make_inputs(torch.device(device), dtype, gen)
