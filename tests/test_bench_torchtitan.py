"""``graft bench overhead --only torchtitan``: a TorchTitan step with graft's converter against
the same job without it, on 2 gloo ranks (FSDP2, and TP2), both jobs in the same processes."""
import json

import pytest

pytest.importorskip("torchtitan")

from graft.tools.cli import main  # noqa: E402


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torchtitan_step_section(fresh_graft, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")  # restored after the test (the bench sets it)
    code = main(["bench", "overhead", "--quick", "--only", "torchtitan", "--json", str(out), "--timeout", "400"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = json.loads(out.read_text())["torchtitan"]
    assert [r["tp"] for r in rows] == [1, 2], rows
    for row in rows:
        # the graft job's norms and SwiGLU ran on graft (torch backend) every step, and both
        # jobs trained alike (same data, same weights, same kernels)
        assert set(row["served"]) == {"fused.rms_norm:torch", "fused.silu_and_mul:torch"}, row
        assert row["max_loss_diff"] < 1e-4, row
        assert row["torchtitan_ms"] > 0 and row["graft_ms"] > 0 and 0 < row["ratio"] < 10
    summary = json.loads(out.read_text())["summary"]["framework_step_ratio"]
    assert summary["step"].startswith("torchtitan")
