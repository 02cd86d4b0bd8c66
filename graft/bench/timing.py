"""Interleaved timing: every variant runs in every round, in rotating order, so drifts of a
shared, noisy machine hit all variants alike; results are medians over rounds."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(variants: dict, rounds: int, inner: int = 1, warmup: int = 1,
                before: Callable | None = None) -> dict:
    """Seconds per call of each ``variants[name]()``: the median over ``rounds`` rounds of
    the mean over ``inner`` back-to-back calls. ``before(name)`` runs untimed before each
    variant's batch (e.g. to switch graft on or off)."""
    names = list(variants)
    for name in names:
        if before is not None:
            before(name)
        for _ in range(warmup):
            variants[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if before is not None:
                before(name)
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(values) for name, values in samples.items()}


def ratio(with_graft: float, without: float) -> float:
    return with_graft / without if without > 0 else float("inf")
