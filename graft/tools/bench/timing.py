"""The one timing harness of graft's tools (bench, kernels, tile and collectives sweeps,
conformance, tune, framework steps).

Clocks: on a GPU a timed region is bracketed by CUDA events (the kernel's time, not the
launch's), optionally around one CUDA graph replay of many calls (:func:`prepare`; when
capture fails the calls run eagerly and the reason is recorded in the mode); on the CPU
``time.perf_counter``. Statistics: medians, their standard error (:func:`median_se`), and
per-round ratios against a named baseline (:func:`ratio_summary`).

Interleaved timing: every variant runs in every round, in rotating order, so drifts of a
shared, noisy machine hit all variants alike; results are medians over rounds, and ratios
are medians of per-round ratios (each pair measured back to back, so a slow spell of the
machine cancels within the pair instead of skewing one side's median)."""
from __future__ import annotations

import math
import random
import statistics
import time
from typing import Callable


TARGET_GRAPH_S = 2e-3  # calls per captured graph (or eager batch): about this long per replay
MAX_INNER = 50


def median(values) -> float:
    """The median of ``values``; a clear error for none (a harness that timed nothing)."""
    values = list(values)
    if not values:
        raise ValueError("no samples: at least one timed round is needed for a median")
    return statistics.median(values)


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def clock(device, timer: Callable = time.perf_counter) -> Callable:
    """Start timing one region on ``device``; returns ``stop() -> seconds``. CUDA events on a
    GPU (``stop`` waits for the end event), else ``timer`` (``time.perf_counter``; a fake
    clock in tests)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()

        def stop():
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return stop
    t0 = timer()
    return lambda: timer() - t0


def _capture(fn, inner: int):
    """One CUDA graph of ``inner`` calls of ``fn`` (after a side-stream warm-up), replayed once."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    return graph.replay


def prepare(fn, device, use_graphs: bool, warmup: int = 2, capture: Callable = _capture,
            timer: Callable = time.perf_counter):
    """Warm ``fn`` up and return ``(run, inner, mode, output)``: ``run()`` performs ``inner``
    calls (about :data:`TARGET_GRAPH_S` of them, at most :data:`MAX_INNER`), as one CUDA graph
    replay when ``use_graphs`` on a GPU and capture works (mode ``"cuda_graph"``), else eagerly
    (``"eager"``, or ``"eager (graph capture failed: <Error>)"``)."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(device)
    stop = clock(device, timer)
    fn()
    one = max(stop(), 1e-7)
    inner = max(1, min(MAX_INNER, int(TARGET_GRAPH_S / one)))
    if use_graphs and getattr(device, "type", device) == "cuda":
        try:
            replay = capture(fn, inner)
            sync(device)
            return replay, inner, "cuda_graph", out
        except Exception as exc:  # noqa: BLE001 - host syncs etc.: time it eagerly instead
            sync(device)
            mode = f"eager (graph capture failed: {type(exc).__name__})"
    else:
        mode = "eager"

    def run():
        for _ in range(inner):
            fn()
    return run, inner, mode, out


def time_call(fn: Callable, device, warmup: int = 1, repeats: int = 5,
              timer: Callable = time.perf_counter) -> list:
    """Seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones, each
    timed on its own with the device's clock (:func:`clock`)."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    for _ in range(max(warmup, 0)):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        stop = clock(device, timer)
        fn()
        samples.append(stop())
    return samples


def device_rounds(runners: dict, rounds: int, device, into: dict | None = None,
                  timer: Callable = time.perf_counter) -> dict:
    """Interleaved rounds on ``device``: each round times every ``runners[label] = (run,
    inner)`` (from :func:`prepare`) once, in the given order, with the device's clock, and
    appends seconds per call to ``into[label]`` (lists made when absent; filled in place, so a
    run stopped mid-way keeps what was measured). Returns ``into``."""
    if rounds < 1:
        raise ValueError(f"device rounds need rounds >= 1 (got {rounds})")
    into = {} if into is None else into
    for label in runners:
        into.setdefault(label, [])
    for _ in range(rounds):
        for label, (run, inner) in runners.items():
            stop = clock(device, timer)
            run()
            into[label].append(stop() / inner)
    return into


def fastest(fn: Callable, tries: int = 3, sync: Callable | None = None, timer: Callable = time.perf_counter) -> float:
    """The best of ``tries`` timed calls of ``fn()`` (each followed by ``sync()``, timed, when
    given): a shared machine's stalls are not the call's time, the best of a few is what the
    call costs. For sizing rounds, not for results."""
    if tries < 1:
        raise ValueError(f"fastest needs tries >= 1 (got {tries})")
    best = math.inf
    for _ in range(tries):
        start = timer()
        fn()
        if sync is not None:
            sync()
        best = min(best, timer() - start)
    return best


def wall_per_call(fn: Callable, iters: int, device, timer: Callable = time.perf_counter) -> float:
    """Wall seconds per call of ``iters`` back-to-back calls of ``fn()``, the device
    synchronised at the end (the caller synchronises, or meets a barrier, before): for work
    that is more than one stream's kernels (collectives across ranks, host-side steps)."""
    if iters < 1:
        raise ValueError(f"wall timing needs iters >= 1 (got {iters})")
    start = timer()
    for _ in range(iters):
        fn()
    sync(device)
    return (timer() - start) / iters


def per_round_ratios(samples: dict, name: str, baseline: str) -> list:
    """``name``'s time over ``baseline``'s, round by round (rounds whose baseline took no time
    are skipped)."""
    return [a / b for a, b in zip(samples[name], samples[baseline]) if b > 0]


def ratio_summary(ratios: list, se: bool = True) -> dict:
    """``{"ratio_median", "ratio_min", "ratio_max"}`` of per-round ratios, and ``"ratio_se"``
    (:func:`median_se`) unless ``se`` is False."""
    out = {"ratio_median": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    if se:
        out["ratio_se"] = median_se(ratios)
    return out


def summary(samples: list) -> dict:
    """``{"median_s", "se_s", "min_s", "q1_s", "q3_s", "n"}`` of one variant's samples."""
    samples = list(samples)
    q1, q3 = quartiles(samples)
    return {"median_s": median(samples), "se_s": median_se(samples), "min_s": min(samples),
            "q1_s": q1, "q3_s": q3, "n": len(samples)}


def quartiles(samples: list) -> tuple:
    """First and third quartile (inclusive method; one sample: itself twice)."""
    if not samples:
        raise ValueError("no samples: at least one timed round is needed for quartiles")
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


class Timings(dict):
    """``{name: median seconds per call}``, with each round's samples in ``samples``."""

    def __init__(self, medians: dict, samples: dict):
        super().__init__(medians)
        self.samples = samples

    def _ratios(self, name: str, baseline: str) -> list:
        return per_round_ratios(self.samples, name, baseline)

    def _differences(self, name: str, baseline: str) -> list:
        return [a - b for a, b in zip(self.samples[name], self.samples[baseline])]

    def ratio(self, name: str, baseline: str) -> float:
        """Median over rounds of ``name``'s time over ``baseline``'s in the same round."""
        pairs = per_round_ratios(self.samples, name, baseline)
        return median(pairs) if pairs else float("inf")

    def ratio_se(self, name: str, baseline: str) -> float:
        """Standard error of :meth:`ratio`, as :meth:`difference_se` reads it (inf below 3 rounds)."""
        return median_se(self._ratios(name, baseline))

    def difference(self, name: str, baseline: str) -> float:
        """Median over rounds of ``name``'s time minus ``baseline``'s in the same round (seconds)."""
        return median(self._differences(name, baseline))

    def difference_se(self, name: str, baseline: str) -> float:
        """Standard error of :meth:`difference` (seconds): the per-round differences' spread,
        robustly (1.4826 x their median absolute deviation: a few rounds the machine stalled in
        do not inflate it), times the median's 1.2533 / sqrt(rounds). inf below 3 rounds."""
        return median_se(self._differences(name, baseline))


def median_se(values: list) -> float:
    """The standard error of ``values``' median: their spread, robustly (1.4826 x their median
    absolute deviation), times the median's 1.2533 / sqrt(n). inf below 3 values."""
    if len(values) < 3:
        return math.inf
    mid = median(values)
    mad = median(abs(v - mid) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values))


def interleaved(variants: dict, rounds: int, inner: int = 1, warmup: int = 1,
                before: Callable | None = None, sync: Callable | None = None, shuffle: bool = False,
                seed: int = 0, timer: Callable = time.perf_counter) -> Timings:
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
    if rounds < 1 or inner < 1:
        raise ValueError(f"interleaved timing needs rounds >= 1 and inner >= 1 (got rounds={rounds}, inner={inner})")
    if not variants:
        raise ValueError("interleaved timing needs at least one variant")
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
            start = timer()
            for _ in range(inner):
                fn()
            samples[name].append((timer() - start) / inner)
    return Timings({name: median(values) for name, values in samples.items()}, samples)


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
        times = Timings({n: median(v) for n, v in samples.items()}, samples)
        se = times.difference_se(name, baseline)
        decided = (threshold is not None and batches >= 2
                   and abs(times.difference(name, baseline) - threshold) > 3 * se)
        if se <= target_se or decided or time.perf_counter() - began >= budget_s:
            return times
