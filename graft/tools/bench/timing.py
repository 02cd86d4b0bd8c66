"""Interleaved timing: every variant runs in every round, in rotating order, so drifts of a
shared, noisy machine hit all variants alike; results are medians over rounds, and ratios
are medians of per-round ratios (each pair measured back to back, so a slow spell of the
machine cancels within the pair instead of skewing one side's median)."""
from __future__ import annotations

import math
import random
import statistics
import time
from typing import Callable


class Timings(dict):
    """``{name: median seconds per call}``, with each round's samples in ``samples``."""

    def __init__(self, medians: dict, samples: dict):
        super().__init__(medians)
        self.samples = samples

    def _ratios(self, name: str, baseline: str) -> list:
        return [a / b for a, b in zip(self.samples[name], self.samples[baseline]) if b > 0]

    def _differences(self, name: str, baseline: str) -> list:
        return [a - b for a, b in zip(self.samples[name], self.samples[baseline])]

    def ratio(self, name: str, baseline: str) -> float:
        """Median over rounds of ``name``'s time over ``baseline``'s in the same round."""
        pairs = self._ratios(name, baseline)
        return statistics.median(pairs) if pairs else float("inf")

    def ratio_se(self, name: str, baseline: str) -> float:
        """Standard error of :meth:`ratio`, as :meth:`difference_se` reads it (inf below 3 rounds)."""
        return _median_se(self._ratios(name, baseline))

    def difference(self, name: str, baseline: str) -> float:
        """Median over rounds of ``name``'s time minus ``baseline``'s in the same round (seconds)."""
        return statistics.median(self._differences(name, baseline))

    def difference_se(self, name: str, baseline: str) -> float:
        """Standard error of :meth:`difference` (seconds): the per-round differences' spread,
        robustly (1.4826 x their median absolute deviation: a few rounds the machine stalled in
        do not inflate it), times the median's 1.2533 / sqrt(rounds). inf below 3 rounds."""
        return _median_se(self._differences(name, baseline))


def _median_se(values: list) -> float:
    """The standard error of ``values``' median: their spread, robustly (1.4826 x their median
    absolute deviation), times the median's 1.2533 / sqrt(n). inf below 3 values."""
    if len(values) < 3:
        return math.inf
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values))


def interleaved(variants: dict, rounds: int, inner: int = 1, warmup: int = 1,
                before: Callable | None = None, sync: Callable | None = None, shuffle: bool = False,
                seed: int = 0) -> Timings:
    """Seconds per call of each ``variants[name]()``: the median over ``rounds`` rounds of
    the mean over ``inner`` back-to-back calls. ``before(name)`` runs untimed before each
    variant's batch (e.g. to switch graft on or off); ``sync()`` (e.g. a barrier across
    ranks) runs untimed after it, so that one rank's untimed work is not timed on another
    as a wait inside a collective.

    The rounds rotate the variants' order; ``shuffle`` draws each round's order at random
    instead (from ``seed``: every rank draws the same), for rounds of one call or few: a call right
    after one that ran the same code finds that code, and its data, warm in the caches (the
    direct call after the public op that called it: 2-6 us faster at 300 us on the
    development machine), so in a fixed cyclic order the variant that follows its twin
    gains that on every round, and a random order gives each variant each neighbour alike."""
    names = list(variants)
    rng = random.Random(seed) if shuffle else None
    for name in names:
        if before is not None:
            before(name)
        for _ in range(warmup):
            variants[name]()
    samples: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        order = rng.sample(names, len(names)) if rng else names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if before is not None:
                before(name)
            if sync is not None:
                sync()
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return Timings({name: statistics.median(values) for name, values in samples.items()}, samples)


def framework_steps(steps: dict, losses: dict, calls: dict, rounds: int, baseline: str,
                    before: Callable | None = None, sync: Callable | None = None) -> dict:
    """A framework's training step with graft (``steps["graft"]``) against without it
    (``steps[baseline]``), interleaved; each step appends its loss to ``losses[name]``.
    Returns ``{"<baseline>_ms", "graft_ms", "ratio"`` (graft / baseline, median of per-round
    ratios), ``"ratio_se"`` (its standard error), ``"served"`` (what changed in ``calls``, an
    integration counter's dict, over the timed steps) and ``"max_loss_diff"}`` (the same model
    and data: only rounding may differ)."""
    start = dict(calls)
    times = interleaved(steps, rounds=rounds, before=before, sync=sync)
    return {f"{baseline}_ms": times[baseline] * 1e3, "graft_ms": times["graft"] * 1e3,
            "ratio": times.ratio("graft", baseline), "ratio_se": times.ratio_se("graft", baseline),
            "served": {k: v - start.get(k, 0) for k, v in calls.items() if v != start.get(k, 0)},
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["graft"], losses[baseline]))}


def interleaved_until(variants: dict, name: str, baseline: str, target_se: float, budget_s: float, rounds: int,
                      inner: int = 1, sync: Callable | None = None, threshold: float | None = None,
                      shuffle: bool = False, before: Callable | None = None, start: Timings | None = None) -> Timings:
    """:func:`interleaved` in batches of ``rounds`` rounds until the difference ``name`` -
    ``baseline`` is known to ``target_se`` seconds (:meth:`Timings.difference_se`) or
    ``budget_s`` seconds are spent (at least one batch): a difference of a microsecond between
    calls of a few hundred microseconds needs hundreds of rounds on a noisy machine, a cheap
    call a few dozen. With a ``threshold`` (seconds), rounds also stop once the difference
    is more than three standard errors away from it on either side, from the second batch on:
    the question a target asks is then answered (a verdict reads two standard errors; the
    third, and the second batch, keep a lucky early batch from deciding it). ``start``, the
    result of an earlier call on the same variants, is carried on (its rounds count)."""
    began = time.perf_counter()
    samples: dict[str, list] = {n: list(start.samples[n]) if start else [] for n in variants}
    batches = len(samples[name]) // rounds
    while True:
        batch = interleaved(variants, rounds=rounds, inner=inner, warmup=0 if samples[name] else 1, sync=sync,
                            shuffle=shuffle, seed=batches, before=before)
        batches += 1
        for n, values in batch.samples.items():
            samples[n].extend(values)
        times = Timings({n: statistics.median(v) for n, v in samples.items()}, samples)
        se = times.difference_se(name, baseline)
        decided = (threshold is not None and batches >= 2
                   and abs(times.difference(name, baseline) - threshold) > 3 * se)
        if se <= target_se or decided or time.perf_counter() - began >= budget_s:
            return times
