"""The GPU kernel benchmark's logic, on the CPU with tiny shapes (so it cannot rot between
GPU runs): every family builds, times, compares and reports; failures and the time budget
are recorded, not fatal."""
import json
import os

import pytest

import graft

pytestmark = pytest.mark.usefixtures("fresh_graft")


def _run(tmp_path, *extra):
    from graft.tools.bench import kernels as bench

    return bench.main(["--device", "cpu", "--quick", "--rounds", "1", "--out", str(tmp_path), "--tag", "t", *extra])


def _report(tmp_path):
    return json.loads((tmp_path / "kernels-t.json").read_text())


def test_quick_run_covers_every_family(tmp_path):
    from graft.tools.bench import kernels as bench

    before = os.environ.get("GRAFT_CHECK_VALUES")
    assert _run(tmp_path, "--backends", "torch") == 0
    # The run switches value checks off for itself only: an in-process caller keeps its setting.
    assert os.environ.get("GRAFT_CHECK_VALUES") == before
    assert graft.config.current().get("GRAFT_CHECK_VALUES") == before
    report = _report(tmp_path)
    results = report["results"]
    assert {r["family"] for r in results} == set(bench.FAMILIES)
    assert all(r["status"] == "ok" for r in results), [(r["name"], r["note"]) for r in results if r["status"] != "ok"]
    for r in results:
        assert "graft:torch" in r["timings"] and r["timings"]["graft:torch"]["median_s"] > 0
        assert r["ratios"], r["name"]  # at least one baseline timed in the same run
        for label, diff in r["value_check"].items():  # the baselines compute the same thing
            # fp8 experts vs the bf16 loop, fp8 KV-cache decode vs the bf16-cache decode: e4m3 rounding
            bound = 0.15 if "fp8" in r["name"] and r["family"] in ("moe", "decode") else 0.05
            assert diff is not None and diff < bound, (r["name"], label, diff)
    assert report["environment"]["check_values"] == "0"
    assert report["summary"]["gemm"]["ok"] == 15
    html = (tmp_path / "kernels-t.html").read_text()
    assert "linear_bf16_m1_n64_k96" in html and "torch.matmul" in html


def test_triton_kernels_are_what_gets_timed(tmp_path):
    assert _run(tmp_path, "--families", "gemm", "--match", "linear_bf16_m1_", "--backends", "triton") == 0
    (result,) = _report(tmp_path)["results"]
    assert set(result["timings"]) == {"graft:triton", "torch.matmul"}


def test_failures_and_budget_are_recorded(tmp_path, monkeypatch):
    from graft.tools.bench import kernels as bench

    def broken(quick, backends):
        cases = bench._fused_cases(quick, backends)[:2]
        cases[0].build = lambda device, dtype: (_ for _ in ()).throw(RuntimeError("planted failure"))
        return cases

    monkeypatch.setitem(bench.FAMILIES, "fused", broken)
    assert _run(tmp_path, "--families", "fused", "--backends", "torch") == 0
    first, second = _report(tmp_path)["results"]
    assert first["status"] == "error" and "planted failure" in first["note"]
    assert second["status"] == "ok"
    assert _run(tmp_path, "--families", "fused", "--backends", "torch", "--budget-s", "-1") == 1
    assert {r["status"] for r in _report(tmp_path)["results"]} == {"skipped"}


def test_bad_arguments():
    from graft.errors import GraftInputError
    from graft.tools.bench import kernels as bench

    with pytest.raises(GraftInputError, match="unknown families"):
        bench.main(["--device", "cpu", "--families", "gemm,attn"])
