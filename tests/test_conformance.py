"""The conformance suite, exercised on a tiny op defined here through an in-process plugin
(one correct, one deliberately wrong, one picky and one GPU-only implementation), so these
tests do not depend on the real kernels; one test runs a real op end to end."""
import html.parser
import json
import math
import os

import pytest
import torch

from graft import plugins
from graft.cases import OpCase
from graft.tools.conformance import report as report_mod
from graft.tools.conformance.compare import compare
from graft.tools.conformance.runner import Options, Runner
from graft.tools.conformance.tolerances import accumulation_growth, tolerance_for
from graft.hookspecs import hookimpl
from graft.plugins import PluginHost
from graft.registry import Implementation, OpSpec, reference_impl

pytest_plugins = ["pytester"]

OP = "fused.tiny_scale"


def tiny_reference(x, alpha=2.0):
    return (x.float() * alpha + 1.0).to(x.dtype)


def tiny_good(x, alpha=2.0):
    return torch.addcmul(torch.ones_like(x, dtype=torch.float32), x.float(), torch.tensor(alpha)).to(x.dtype)


WRONG_INDEX = (1, 2)


def tiny_wrong(x, alpha=2.0):
    out = tiny_reference(x, alpha)
    if out.dim() == 2 and out.shape[0] > WRONG_INDEX[0] and out.shape[1] > WRONG_INDEX[1]:
        out[WRONG_INDEX] += 0.5  # one element wrong, far beyond any tolerance
    return out


def tiny_picky_check(x, alpha=2.0):
    return None if x.shape[-1] % 2 == 0 else f"odd last dim {x.shape[-1]} not supported"


def _make(shape):
    def make(device, dtype, gen):
        return (torch.randn(shape, generator=gen).to(device=device, dtype=dtype),), {"alpha": 3.0}

    return make


TINY_CASES = [
    OpCase(OP, "t4_h8", _make((4, 8)), dtypes=(torch.float16, torch.float32),
           flops=lambda args, kwargs: 2.0 * args[0].numel()),
    OpCase(OP, "t3_h5_odd", _make((3, 5)), dtypes=(torch.float32,)),
]


class TinyPlugin:
    """An adapter as a vendor would write it: its own op, implementations and cases."""

    @hookimpl
    def graft_register_ops(self, registry):
        registry.add_op(OpSpec(name=OP, family="fused", signature="tiny_scale(x, alpha) -> x*alpha+1",
                               reference=tiny_reference))
        registry.add_op(OpSpec(name="collectives.tiny_allreduce", family="collectives", signature="x -> x",
                               reference=lambda x: x.clone()))

    @hookimpl
    def graft_register_kernels(self, registry):
        for spec in list(registry.ops.values()):
            registry.add_impl(reference_impl(spec))
        registry.add_impl(Implementation(op=OP, backend="good", fn=tiny_good))
        registry.add_impl(Implementation(op=OP, backend="wrong", fn=tiny_wrong, priority=-1))
        registry.add_impl(Implementation(op=OP, backend="picky", fn=tiny_good, check=tiny_picky_check))
        registry.add_impl(Implementation(op=OP, backend="gpuonly", fn=tiny_good, devices=frozenset({"cuda"})))
        registry.add_impl(Implementation(op="collectives.tiny_allreduce", backend="good", fn=lambda x: x.clone()))

    @hookimpl
    def graft_conformance_cases(self, registry):
        return TINY_CASES + [OpCase("collectives.tiny_allreduce", "n8", _make((8,)), dtypes=(torch.float32,))]


@pytest.fixture
def tiny_host(fresh_graft, monkeypatch):
    """A plugin host holding only the tiny plugin, installed as graft's global host."""
    monkeypatch.setenv("GRAFT_BACKENDS", "good,picky,wrong,gpuonly,torch")
    host = PluginHost(load_entry_points=False)
    host.register(TinyPlugin(), name="tiny")
    monkeypatch.setattr(plugins, "_host", host)
    return host


def run_tiny(host, **kw):
    kw.setdefault("ops", (OP,))
    kw.setdefault("timing", False)
    return Runner(host=host, options=Options(**kw)).run()


# --------------------------------------------------------------------------- tolerances


def test_tolerances_order_by_precision_and_grow_with_reduction_length():
    f32, f16, bf16 = (tolerance_for(d) for d in (torch.float32, torch.float16, torch.bfloat16))
    assert f32.atol < f16.atol < bf16.atol and f32.rtol < f16.rtol < bf16.rtol
    assert accumulation_growth(None) == accumulation_growth(256) == 1.0
    assert accumulation_growth(4096) == pytest.approx(4.0)
    long = tolerance_for(torch.float16, reduction_len=4096)
    assert long.atol == pytest.approx(4 * f16.atol) and "4096-term" in long.rule


def test_tolerances_for_integers_cuda_fp32_and_overrides():
    int8 = tolerance_for(torch.int8)
    assert int8.atol == 1.0 and int8.rtol == 0.0 and int8.atol_is_absolute
    for dtype in (torch.int32, torch.int64, torch.bool, torch.uint8):
        t = tolerance_for(dtype)
        assert (t.atol, t.rtol) == (0.0, 0.0) and "exact" in t.rule
    assert tolerance_for(torch.float32, device_type="cuda").atol > tolerance_for(torch.float32).atol  # TF32
    # an fp32 output computed from fp16 inputs is only fp16-accurate
    assert tolerance_for(torch.float32, compute_dtype=torch.float16).atol == tolerance_for(torch.float16).atol
    over = tolerance_for(torch.bfloat16, atol={torch.bfloat16: 0.5}, rtol=0.25, compute_dtype=torch.bfloat16)
    assert (over.atol, over.rtol) == (0.5, 0.25) and "override" in over.rule
    assert tolerance_for(torch.float16, atol={torch.bfloat16: 0.5}).atol == tolerance_for(torch.float16).atol


def test_compare_finds_worst_element_and_structural_problems():
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
    got = expected.clone()
    got[2, 1] += 1e-3  # small, above fp32 tolerance
    got[1, 3] += 0.5  # the worst
    cmp = compare(got, expected, lambda d: tolerance_for(d))
    assert not cmp.ok
    worst = cmp.worst
    assert worst.worst_index == (1, 3) and worst.n_bad == 2
    assert worst.worst_got == pytest.approx(8.5) and worst.worst_expected == pytest.approx(8.0)
    assert cmp.max_abs == pytest.approx(0.5) and cmp.max_rel == pytest.approx(0.5 / 8)
    assert "out[1, 3]" in cmp.describe() and "got 8.5, expected 8.0" in cmp.describe()
    # within tolerance: passes, worst element is the largest error
    ok = compare(expected * (1 + 1e-7), expected, lambda d: tolerance_for(d))
    assert ok.ok
    # NaN where the reference has a number fails even though |diff| is not comparable
    nan = expected.clone()
    nan[0, 0] = math.nan
    bad = compare(nan, expected, lambda d: tolerance_for(d))
    assert not bad.ok and bad.worst.worst_index == (0, 0)
    assert compare(expected.clone().fill_(math.nan), expected.fill_(math.nan), lambda d: tolerance_for(d)).ok
    # shape, dtype and arity mismatches
    assert "shape" in compare(expected[:2], expected, tolerance_for).describe()
    assert "dtype" in compare(expected.double(), expected, tolerance_for).describe()
    assert not compare((expected,), (expected, expected), tolerance_for).ok
    # tuple outputs: each tensor with its own dtype's tolerance; ints exact
    ids = torch.tensor([3, 1, 2], dtype=torch.int32)
    mixed = compare((expected, ids + torch.tensor([0, 0, 1], dtype=torch.int32)), (expected, ids), tolerance_for)
    assert not mixed.ok and mixed.worst.output == "out[1]" and mixed.worst.worst_index == (2,)
    assert compare((expected, None), (expected, None), tolerance_for).ok


def test_rms_relative_atol_absorbs_cancellation_near_zero():
    expected = torch.tensor([1000.0, -1000.0, 1e-3], dtype=torch.float16)
    got = expected.clone()
    got[2] = 0.5  # abs error 0.5 ~ 1 ulp at magnitude 1000: fine for an output of this scale
    assert compare(got, expected, lambda d: tolerance_for(d)).ok


# --------------------------------------------------------------------------- runner


def test_runner_reports_the_wrong_implementation_with_its_worst_element(tiny_host):
    report = run_tiny(tiny_host)
    assert report.exit_code == 1
    rows = {(c.case, c.dtype, i.backend): i for c, i in report.impl_rows()}
    assert rows[("t4_h8", "float16", "good")].status == "pass"
    wrong = rows[("t4_h8", "float32", "wrong")]
    assert wrong.status == "fail"
    for fragment in (OP, "impl=wrong", "t4_h8", "dtype=float32", "max abs err 0.5", "max rel err",
                     f"worst element out[{WRONG_INDEX[0]}, {WRONG_INDEX[1]}]", "got ", "expected "):
        assert fragment in wrong.message, (fragment, wrong.message)
    # skipped, with the reason, never silently
    picky = rows[("t3_h5_odd", "float32", "picky")]
    assert picky.status == "skipped" and "odd last dim 5" in picky.reason
    assert rows[("t4_h8", "float32", "picky")].status == "pass"
    gpu = rows[("t4_h8", "float32", "gpuonly")]
    assert gpu.status == "skipped" and "device type 'cpu' not supported" in gpu.reason
    # what graft's selection picks for each call, per GRAFT_BACKENDS
    assert rows[("t4_h8", "float32", "good")].selected
    assert {c.selected for c in report.cases} == {"good (tiny)"}
    assert [f[1].backend for f in report.failures] == ["wrong"] * 3


def test_runner_filters_and_skips_multi_process_families_explicitly(tiny_host):
    report = run_tiny(tiny_host, impls=("good",), dtypes=(torch.float32,))
    assert report.exit_code == 0
    assert {(c.case, c.dtype) for c in report.cases} == {("t4_h8", "float32"), ("t3_h5_odd", "float32")}
    assert {i.backend for _, i in report.impl_rows()} == {"good"}
    coll = run_tiny(tiny_host, ops=(), families=("collectives",))
    (case,) = coll.cases
    assert case.status == "skipped" and "python -m graft.tools.bench.collectives_sweep" in case.reason
    assert any("needs multi-process" in n for n in coll.notes)
    assert coll.exit_code == 0 and coll.counts()["skipped"] == 1


def test_timing_gives_ratios_against_the_reference(tiny_host):
    report = run_tiny(tiny_host, impls=("good",), timing=True, warmup=0, repeats=3)
    case = report.cases[0]
    assert case.reference_timing["repeats"] == 3
    (impl,) = case.impls
    assert impl.timing["median_s"] > 0 and impl.timing["q1_s"] <= impl.timing["median_s"] <= impl.timing["q3_s"]
    ratio = impl.speedups["torch reference"]
    assert ratio == pytest.approx(case.reference_timing["median_s"] / impl.timing["median_s"])


def test_report_files_table_html_and_svg(tiny_host, tmp_path):
    report = run_tiny(tiny_host, timing=True, warmup=0, repeats=2)
    paths = report_mod.write_reports(report, str(tmp_path))
    data = json.loads(open(paths["json"]).read())
    assert data["summary"]["fail"] == 3 and data["meta"]["times_are_device_specific"]
    failing = [i for c in data["cases"] for i in c["impls"] if i["status"] == "fail"]
    assert failing[0]["comparison"]["outputs"][0]["worst_index"] == list(WRONG_INDEX)

    md = open(paths["markdown"]).read()
    assert "| op | case (shape) | dtype | implementation | numerics |" in md
    assert "device-specific" in md and "## Failures" in md
    assert f"| {OP} | t4_h8 | float16 | good (tiny) | pass |" in md
    assert "skipped: odd last dim 5" in md

    page = open(paths["html"]).read()
    tags = []

    class Parser(html.parser.HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append(tag)
            assert not (tag in ("script", "link", "img") or any(v and "http" in v and k == "src" for k, v in attrs))

    Parser().feed(page)
    assert {"table", "svg", "rect", "pre"} <= set(tags)
    assert "fused.tiny_scale: speedup vs torch reference" in page


def test_svg_chart_handles_slower_and_faster_points():
    svg = report_mod.svg_bar_chart("t", [("a", 0.25, "ref"), ("b", 3.0, "ref")])
    assert svg.count("<rect") == 2 and "0.25x" in svg and "3.00x" in svg


# --------------------------------------------------------------------------- CLI


def test_cli_exit_codes(tiny_host, tmp_path, capsys):
    from graft.tools.cli import main

    out = str(tmp_path / "r")
    assert main(["conformance", "--op", OP, "--out", out, "--no-timing", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "FAILED fused.tiny_scale [t4_h8]" in captured.err and "report (html)" in captured.out
    assert main(["conformance", "--op", OP, "--impl", "good", "--out", out, "--repeats", "2", "--quiet"]) == 0
    assert "fused.tiny_scale" in capsys.readouterr().out
    assert main(["conformance", "--op", OP, "--impl", "good", "--out", out, "--json-only", "--no-timing"]) == 0
    for bad in (["--op", "fused.nope"], ["--family", "nope"], ["--tags", "slowish"], ["--dtype", "float17"],
                ["--impl", "nope"], ["--device", "tpu"], ["--repeats", "0"], ["--op", OP, "--dtype", "int8"]):
        assert main(["conformance", "--out", out, "--no-timing", *bad]) == 2, bad
    if not torch.cuda.is_available():
        assert main(["conformance", "--device", "cuda", "--out", out]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_usage_errors_found_before_the_run(tiny_host, tmp_path, capsys):
    from graft.tools.cli import main

    a_file = tmp_path / "report.txt"
    a_file.write_text("not a directory")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    cases = [
        (["--out", str(a_file)], "exists and is not a directory"),
        (["--impl", "torch", "--out", str(tmp_path / "r")], "torch is the reference"),
        (["--tags", "gpu", "--out", str(tmp_path / "r")], "--allow-slow"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((["--out", str(readonly / "sub")], "cannot be written"))
    for args, message in cases:
        assert main(["conformance", "--op", OP, "--no-timing", "--quiet", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
    assert a_file.read_text() == "not a directory"


# --------------------------------------------------------------------------- pytest plugin


def test_pytest_plugin_runs_the_cases_as_tests(tiny_host, pytester, request):
    pytester.makepyfile(test_other="def test_unrelated():\n    pass\n")
    extra = [] if request.config.pluginmanager.has_plugin("graft-conformance") else ["-p", "graft.tools.conformance.pytest_plugin"]
    # without the flag nothing is collected from graft
    plain = pytester.runpytest_inprocess(*extra)
    plain.assert_outcomes(passed=1)
    result = pytester.runpytest_inprocess(*extra, "--graft-conformance", "--graft-conformance-op", OP,
                                          "-m", "graft_conformance", "-rs")
    # (t4_h8 x 2 dtypes + t3_h5_odd x 1) x 4 impls: good passes 3, wrong fails 3, picky passes 2 and
    # skips the odd case, gpuonly skips 3 on the CPU
    result.assert_outcomes(passed=5, failed=3, skipped=4, deselected=1)
    text = result.stdout.str()
    assert "worst element out[1, 2]" in text and "impl=wrong" in text
    assert "odd last dim 5" in text


def test_real_op_end_to_end(fresh_graft):
    """The registered kernels of one real op, through the real plugin host."""
    report = Runner(options=Options(ops=("fused.silu_and_mul",), timing=False, dtypes=(torch.float32,))).run()
    assert report.cases and all(c.status == "ran" for c in report.cases)
    assert report.exit_code == 0, report.failures


def test_main_job_from_a_cold_process_runs_the_triton_kernels(tmp_path):
    """The README's main job: a fresh `graft conformance` on the CPU must run the Triton
    kernels in the interpreter, not skip them (TRITON_INTERPRET has to be set before anything
    imports triton, so importing graft must not pull triton in)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "TRITON_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "graft", "conformance", "--op", "fused.silu_and_mul", "--no-timing",
         "--no-upstream", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    triton = [i for c in report["cases"] for i in c["impls"] if i["backend"] == "triton"]
    assert triton and all(i["status"] == "pass" for i in triton), triton


def test_importing_graft_ops_does_not_import_triton_or_dynamo():
    import subprocess
    import sys

    code = ("import sys, graft, graft.ops.attention, graft.ops.gemm, graft.ops.moe, graft.ops.fused, graft.tools.cli; "
            "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
