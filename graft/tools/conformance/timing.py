"""Time one callable: warm-up, then N timed repeats; median and inter-quartile spread,
through the tools' one harness (:mod:`graft.tools.bench.timing`).

On a GPU each repeat is bracketed by CUDA events (and the device synchronized), so the
time is the kernel's, not the launch's; on the CPU ``time.perf_counter`` is used.
Absolute times depend on the device, its clocks and its load: reports label them
"device-specific" and only the ratio against a baseline measured in the same run,
on the same inputs, is meant to be compared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from graft.tools.bench import timing


@dataclass
class Timing:
    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    repeats: int
    warmup: int
    samples_s: list = field(default_factory=list)

    @property
    def spread(self) -> float:
        """Inter-quartile range relative to the median (0.05 = +-5% around the median)."""
        return (self.q3_s - self.q1_s) / self.median_s if self.median_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"median_s": self.median_s, "q1_s": self.q1_s, "q3_s": self.q3_s, "min_s": self.min_s,
                "iqr_rel": self.spread, "repeats": self.repeats, "warmup": self.warmup,
                "samples_s": list(self.samples_s)}


def summarize(samples: list, warmup: int) -> Timing:
    q1, q3 = timing.quartiles(samples)
    return Timing(timing.median(samples), q1, q3, min(samples), len(samples), warmup, list(samples))


def time_call(fn: Callable, make_args: Callable, device: torch.device, warmup: int = 1, repeats: int = 5) -> Timing:
    """Time ``fn(*args, **kwargs)``; ``make_args()`` -> (args, kwargs) is called once, before warm-up.

    The same inputs are reused for every repeat, as a framework would call a kernel;
    ops that update a buffer in place simply update it again.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    args, kwargs = make_args()
    samples = timing.time_call(lambda: fn(*args, **kwargs), device, warmup=warmup, repeats=repeats)
    return summarize(samples, warmup)


def speedup(baseline: Timing | None, impl: Timing | None) -> float | None:
    """baseline_median / impl_median: > 1 means the implementation is faster."""
    if baseline is None or impl is None or impl.median_s <= 0:
        return None
    return baseline.median_s / impl.median_s
