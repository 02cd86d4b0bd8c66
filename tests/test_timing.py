"""The tools' one timing harness (graft/tools/bench/timing.py): interleaving, statistics,
per-round ratios, the graph-capture fallback, and that no other tool keeps its own."""
import math
import pathlib
import re
import statistics

import pytest

from graft.tools.bench import timing


class FakeClock:
    """A clock that advances only when a variant runs, by that variant's cost, and logs who ran."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def __call__(self):
        return self.now

    def variant(self, name, costs):
        it = iter(costs)

        def fn():
            self.log.append(name)
            self.now += next(it)
        return fn


def test_interleaved_rotates_order_and_times_each_round_with_the_given_clock():
    clock = FakeClock()
    costs = {"a": [9.0, 1.0, 2.0, 3.0], "b": [9.0, 2.0, 4.0, 8.0], "c": [9.0, 1.0, 1.0, 1.0]}
    variants = {n: clock.variant(n, c) for n, c in costs.items()}
    times = timing.interleaved(variants, rounds=3, warmup=1, timer=clock)
    warm, timed = clock.log[:3], clock.log[3:]
    assert warm == ["a", "b", "c"]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # A/B/C, then rotated
    assert times.samples == {"a": [1.0, 2.0, 3.0], "b": [2.0, 4.0, 8.0], "c": [1.0, 1.0, 1.0]}
    assert times["b"] == 4.0
    assert times.ratio("b", "a") == 2.0 and timing.per_round_ratios(times.samples, "b", "a") == [2.0, 2.0, 8 / 3]


def test_interleaved_divides_a_batch_by_inner():
    clock = FakeClock()
    times = timing.interleaved({"a": clock.variant("a", [1.0] * 10)}, rounds=2, inner=4, warmup=0, timer=clock)
    assert times.samples["a"] == [1.0, 1.0] and clock.log == ["a"] * 8


@pytest.mark.parametrize("kwargs", [{"rounds": 0}, {"rounds": -1}, {"rounds": 2, "inner": 0}])
def test_zero_rounds_or_calls_are_rejected_clearly(kwargs):
    with pytest.raises(ValueError, match="rounds >= 1"):
        timing.interleaved({"a": lambda: None}, **kwargs)


def test_empty_inputs_are_rejected_clearly():
    with pytest.raises(ValueError, match="at least one variant"):
        timing.interleaved({}, rounds=1)
    with pytest.raises(ValueError, match="no samples"):
        timing.median([])
    with pytest.raises(ValueError, match="no samples"):
        timing.summary([])
    with pytest.raises(ValueError, match="rounds >= 1"):
        timing.device_rounds({"a": (lambda: None, 1)}, 0, "cpu")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        timing.time_call(lambda: None, "cpu", repeats=0)
    with pytest.raises(ValueError, match="iters >= 1"):
        timing.wall_per_call(lambda: None, 0, "cpu")


def test_median_and_its_standard_error_by_hand():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    # median 3; absolute deviations 2,1,0,1,7 -> MAD 1; se = 1.2533 * 1.4826 * 1 / sqrt(5)
    assert timing.median(values) == 3.0
    assert timing.median_se(values) == pytest.approx(1.2533 * 1.4826 / math.sqrt(5))
    assert timing.median_se([1.0, 2.0]) == math.inf  # below three values: unknown
    s = timing.summary(values)
    assert (s["median_s"], s["min_s"], s["n"]) == (3.0, 1.0, 5)
    assert (s["q1_s"], s["q3_s"]) == (2.0, 4.0)
    assert s["se_s"] == timing.median_se(values)
    assert timing.quartiles([7.0]) == (7.0, 7.0)


def test_ratio_summary_per_round():
    samples = {"base": [2.0, 4.0, 1.0, 0.0], "new": [1.0, 4.0, 3.0, 5.0]}
    ratios = timing.per_round_ratios(samples, "new", "base")
    assert ratios == [0.5, 1.0, 3.0]  # the round the baseline took no time is skipped
    out = timing.ratio_summary(ratios)
    assert out == {"ratio_median": 1.0, "ratio_min": 0.5, "ratio_max": 3.0, "ratio_se": timing.median_se(ratios)}
    assert "ratio_se" not in timing.ratio_summary(ratios, se=False)
    # the median of per-round ratios, not the ratio of medians
    assert timing.Timings({}, {"a": [1.0, 10.0, 10.0], "b": [2.0, 2.0, 30.0]}).ratio("a", "b") == 0.5


def test_device_rounds_fills_in_place_in_order():
    clock = FakeClock()
    runners = {"x": (clock.variant("x", [4.0, 8.0]), 2), "y": (clock.variant("y", [1.0, 3.0]), 1)}
    into = {"x": [99.0]}
    out = timing.device_rounds(runners, 2, "cpu", into=into, timer=clock)
    assert out is into and into == {"x": [99.0, 2.0, 4.0], "y": [1.0, 3.0]}
    assert clock.log == ["x", "y", "x", "y"]


def test_time_call_and_wall_per_call_on_the_cpu_clock():
    clock = FakeClock()
    samples = timing.time_call(clock.variant("f", [5.0, 1.0, 2.0]), "cpu", warmup=1, repeats=2, timer=clock)
    assert samples == [1.0, 2.0]
    clock = FakeClock()
    assert timing.wall_per_call(clock.variant("g", [1.0, 3.0]), 2, "cpu", timer=clock) == 2.0


class FakeCuda:
    type = "cuda"


def test_graph_capture_failure_falls_back_to_eager_with_the_reason(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "sync", lambda device: None)
    monkeypatch.setattr(timing, "clock", lambda device, timer=None: (lambda: 1e-4))

    def capture(fn, inner):
        raise RuntimeError("operation not permitted when stream is capturing")

    run, inner, mode, out = timing.prepare(lambda: calls.append(1) or "out", FakeCuda(), True, capture=capture)
    assert mode == "eager (graph capture failed: RuntimeError)" and out == "out"
    assert inner == int(timing.TARGET_GRAPH_S / 1e-4)
    before = len(calls)
    run()
    assert len(calls) - before == inner


def test_graph_capture_success_returns_the_replay(monkeypatch):
    monkeypatch.setattr(timing, "sync", lambda device: None)
    monkeypatch.setattr(timing, "clock", lambda device, timer=None: (lambda: 1.0))
    replay = object()
    run, inner, mode, _ = timing.prepare(lambda: None, FakeCuda(), True, capture=lambda fn, n: replay)
    assert (run, inner, mode) == (replay, 1, "cuda_graph")
    run, inner, mode, _ = timing.prepare(lambda: None, FakeCuda(), False, capture=lambda fn, n: replay)
    assert mode == "eager" and run is not replay


def test_prepare_on_the_cpu_is_eager_and_caps_inner():
    run, inner, mode, out = timing.prepare(lambda: 3, "cpu", True, timer=iter([0.0, 0.0]).__next__)
    assert (mode, inner, out) == ("eager", timing.MAX_INNER, 3)


TOOLS = pathlib.Path(__file__).resolve().parent.parent / "graft" / "tools"
OWN_TIMING = re.compile(r"statistics\.median|\bmedian\(|cuda\.Event\b|CUDAGraph\b|import statistics")


def _offenders(root: pathlib.Path) -> list:
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "bench/timing.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if OWN_TIMING.search(code.replace("timing.median(", "").replace("timing.median_se(", "")):
                out.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return out


def test_no_tool_keeps_its_own_medians_or_device_timing_loop():
    offenders = _offenders(TOOLS)
    assert offenders == [], "timing outside graft/tools/bench/timing.py:\n" + "\n".join(offenders)


def test_the_scan_finds_a_private_median(tmp_path):
    """Control: the scan above would see a tool that kept its own."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "timing.py").write_text("import statistics\nstatistics.median([1])\n")
    (tmp_path / "mine.py").write_text("import statistics\nx = statistics.median([1, 2])\n")
    (tmp_path / "graph.py").write_text("import torch\ng = torch.cuda.CUDAGraph()\n")
    (tmp_path / "fine.py").write_text("from graft.tools.bench import timing\nx = timing.median([1])\n")
    found = _offenders(tmp_path)
    assert [f.split(":")[0] for f in found] == ["graph.py", "mine.py", "mine.py"]
    assert statistics.median([1, 2]) == 1.5


def test_fastest_is_the_best_of_its_tries_with_the_sync_timed():
    clock = FakeClock()
    synced = []
    best = timing.fastest(clock.variant("f", [3.0, 1.0, 2.0]), 3, sync=lambda: synced.append(1) or None, timer=clock)
    assert best == 1.0 and len(synced) == 3
    with pytest.raises(ValueError, match="tries >= 1"):
        timing.fastest(lambda: None, 0)
