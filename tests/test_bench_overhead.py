"""``graft bench overhead``: the smallest slice (one op and Adam, in process) runs in seconds
and writes the JSON the full run writes; bad section names are usage errors."""
import json

from graft.tools.cli import main


def test_smallest_slice_writes_its_json(fresh_graft, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")  # restored after the test (the bench sets it)
    code = main(["bench", "overhead", "--quick", "--only", "ops,adam", "--ops", "fused.rms_norm", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "fused.rms_norm" in printed and "summary (with graft / without)" in printed
    data = json.loads(out.read_text())
    assert data["bench"] == "overhead" and data["quick"] is True and data["backends"] == "torch"
    assert data["sections"] == ["ops", "adam"]
    (row,) = data["ops"]
    assert row["op"] == "fused.rms_norm" and row["backend"] == "torch"
    for key in ("direct_us", "graft_us", "overhead_us"):
        assert isinstance(row[key], float) and row[key] == row[key], (key, row)
    assert row["direct_us"] > 0 and row["graft_us"] > 0
    assert -row["direct_us"] < row["overhead_us"] < row["graft_us"] + row["direct_us"]
    assert data["custom_op"]["dispatcher_us"] > data["custom_op"]["graft_us"]  # graft skips the dispatcher eagerly
    adam = data["adam"]
    assert adam["numel"] == 65536 and adam["torch_us"] > 0 and adam["graft_us"] > 0
    assert 0 < adam["ratio"] < 100 and 0 < adam["functional_ratio"] < 100
    summary = data["summary"]
    assert set(summary) == {"op_overhead_us", "op_overhead_cold_us", "real_call_delta_us", "adam_ratio"}
    # The real-call delta (public op vs the implementation it selected, both real) and the
    # comparison with the function a framework calls itself (torch's F.rms_norm here).
    assert isinstance(row["real_call_delta_us"], float) and row["public_us"] > 0
    assert isinstance(row["real_noise_us"], float)  # the A/A control beside it
    # rounds are added until the delta is known to 0.2 us (or the op's budget is spent)
    # (in batches of the same number of calls: 15 rounds of 20, or more rounds of fewer calls)
    assert 1 <= row["real_inner"] <= 20 and row["real_rounds"] % (15 * 20 // row["real_inner"]) == 0
    assert row["real_call_delta_se_us"] >= 0
    # graft's own cost after the real kernel: the stub timed right after the real implementation ran
    assert row["overhead_cold_rounds"] >= 100 and 0 <= row["overhead_cold_se_us"] < 1.0
    assert -1.0 < row["overhead_cold_us"] < 20.0
    assert row["framework"] == "torch.nn.functional.rms_norm" and row["framework_us"] > 0
    for key, entry in summary.items():
        assert set(entry) >= {"worst", "target", "met"}
        if key == "real_call_delta_us":  # per row, with its standard error
            assert entry["met"] == (not entry["over"] and not entry["unresolved"])
        else:
            assert entry["met"] == (entry["worst"] <= entry["target"])


def test_unknown_section_is_a_usage_error(fresh_graft, capsys):
    assert main(["bench", "overhead", "--only", "opz"]) == 2
    err = capsys.readouterr().err
    assert "'opz'" in err and "ops, adam, collectives, deepspeed, megatron" in err


def test_summary_flags_what_misses_its_target():
    from graft.tools.bench.overhead import summarize

    summary = summarize({"ops": [{"op": "a", "overhead_us": 1.0}, {"op": "b", "overhead_us": 3.5}],
                         "deepspeed": [{"run": "zero2", "ratio": 1.01}],
                         "megatron": [{"tp": 2, "ratio": 1.2}],
                         "collectives": [{"op": "collectives.all_reduce", "ratio": 1.05}]})
    assert summary["op_overhead_us"] == {"worst": 3.5, "op": "b", "target": 2.0, "met": False}
    assert summary["framework_step_ratio"]["step"] == "megatron TP2" and not summary["framework_step_ratio"]["met"]
    assert summary["collectives_ratio"]["met"]


def test_summary_says_which_real_call_deltas_the_noise_leaves_open():
    from graft.tools.bench.overhead import summarize, verdict

    rows = [{"op": "quiet", "real_call_delta_us": 0.4, "real_call_delta_se_us": 0.1},
            {"op": "noisy", "real_call_delta_us": 1.5, "real_call_delta_se_us": 0.5},
            {"op": "over", "real_call_delta_us": 3.5, "real_call_delta_se_us": 0.2}]
    entry = summarize({"ops": rows})["real_call_delta_us"]
    assert entry["worst"] == 3.5 and entry["op"] == "over" and not entry["met"]
    assert entry["over"] == {"over": [3.5, 0.2]} and entry["unresolved"] == {"noisy": [1.5, 0.5]}  # 1.5 + 2 x 0.5 > 2
    assert verdict(entry) == "NOT met (over +3.50 +- 0.20)"
    entry = summarize({"ops": rows[:2]})["real_call_delta_us"]
    assert not entry["met"] and verdict(entry).startswith("not resolved") and "noisy +1.50 +- 0.50" in verdict(entry)
    entry = summarize({"ops": rows[:1]})["real_call_delta_us"]
    assert entry["met"] and verdict(entry) == "met"


def test_collective_figures_get_their_own_lines():
    from graft.tools.bench.overhead import summarize

    rows = [{"op": "fused.rms_norm", "real_call_delta_us": 0.3, "real_call_delta_se_us": 0.05, "overhead_cold_us": 0.2},
            {"op": "collectives.all_reduce", "real_call_delta_us": -20.0, "real_call_delta_se_us": 60.0,
             "overhead_cold_us": 3.5}]
    summary = summarize({"ops": rows})
    assert summary["op_overhead_cold_us"]["met"] and not summary["collective_overhead_cold_us"]["met"]
    assert summary["real_call_delta_us"]["met"] and summary["real_call_delta_us"]["op"] == "fused.rms_norm"
    collective = summary["collective_call_delta_us"]
    assert not collective["met"] and collective["unresolved"] == {"collectives.all_reduce": [-20.0, 60.0]}
    # measured on one rank as well: those rows decide (two ranks' gloo noise hides a microsecond)
    one_rank = dict(rows[1], ranks=1, real_call_delta_us=1.2, real_call_delta_se_us=0.2, overhead_cold_us=1.5)
    summary = summarize({"ops": [rows[0], dict(rows[1], ranks=2), one_rank]})
    assert summary["collective_call_delta_us"]["met"] and summary["collective_overhead_cold_us"]["worst"] == 1.5


def test_summary_counts_torchtitan_steps():
    from graft.tools.bench.overhead import summarize

    summary = summarize({"megatron": [{"tp": 1, "ratio": 1.01}], "torchtitan": [{"tp": 2, "ratio": 1.07}]})
    assert summary["framework_step_ratio"]["step"] == "torchtitan TP2" and not summary["framework_step_ratio"]["met"]


def test_rounds_are_added_until_the_difference_is_known():
    """interleaved_until: a stable difference stops after the first batch; a noisy one gets
    batches until its standard error is below the target, or the budget is spent."""
    import itertools
    import time

    from graft.tools.bench.timing import Timings, interleaved_until

    def spin(us):
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    jitter = itertools.cycle([0, 400, 0, 0, 800, 0, 50, 0, 1200, 0, 0, 300])
    steady = {"a": lambda: spin(30), "b": lambda: spin(20)}
    t = interleaved_until(steady, "a", "b", target_se=5e-6, budget_s=10.0, rounds=10)
    assert len(t.samples["a"]) == 10 and 5e-6 < t.difference("a", "b") < 20e-6
    noisy = {"a": lambda: spin(next(jitter)), "b": lambda: spin(0)}
    t = interleaved_until(noisy, "a", "b", target_se=1e-9, budget_s=0.3, rounds=10)
    assert len(t.samples["a"]) > 10 and len(t.samples["a"]) % 10 == 0  # more batches, then the budget ended it
    # a threshold far from the difference decides it at the second batch, however small target_se
    t = interleaved_until(steady, "a", "b", target_se=1e-15, budget_s=10.0, rounds=10, threshold=100e-6)
    assert len(t.samples["a"]) == 20
    # carried on from an earlier result: its rounds count (here: decided after one more batch)
    more = interleaved_until(steady, "a", "b", target_se=1e-15, budget_s=10.0, rounds=10, threshold=100e-6, start=t)
    assert len(more.samples["a"]) == 30 and more.samples["a"][:20] == t.samples["a"]
    # the standard error: 1.2533 x 1.4826 x MAD / sqrt(n); fewer than 3 rounds tell nothing
    two = Timings({}, {"a": [3.0, 1.0, 2.0, 7.0], "b": [0.0, 0.0, 0.0, 0.0]})
    assert abs(two.difference_se("a", "b") - 1.2533 * 1.4826 * 1.0 / 2) < 1e-12
    assert Timings({}, {"a": [1.0, 2.0], "b": [0.0, 0.0]}).difference_se("a", "b") == float("inf")


def test_a_round_times_one_long_call_or_several_short_ones():
    import time

    from graft.tools.bench.ops import calls_per_round

    def spin(us):
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    assert calls_per_round(lambda: spin(200), 20) == 1
    assert 4 <= calls_per_round(lambda: spin(8), 20) <= 7  # about 50 us a round
    assert calls_per_round(lambda: None, 20) == 20  # never more than asked
    assert calls_per_round(lambda: None, 20, sync=lambda: None) == 20  # ranks: the same on each, untimed


def test_framework_steps_are_read_with_their_standard_error():
    from graft.tools.bench.overhead import summarize, verdict

    steps = {"deepspeed": [{"run": "zero3", "ratio": 1.20, "ratio_se": 0.10}],
             "megatron": [{"tp": 1, "ratio": 0.98, "ratio_se": 0.01}]}
    entry = summarize(steps)["framework_step_ratio"]
    assert not entry["met"] and entry["unresolved"] == {"deepspeed zero3": [1.2, 0.1]}
    assert verdict(entry) == "not resolved: within 2 standard errors of the target (deepspeed zero3 1.20x +- 0.10)"
    steps["deepspeed"][0]["ratio_se"] = 0.02
    entry = summarize(steps)["framework_step_ratio"]
    assert verdict(entry) == "NOT met (deepspeed zero3 1.20x +- 0.02)"
    steps["deepspeed"][0].update(ratio=1.01)
    assert summarize(steps)["framework_step_ratio"]["met"]
