"""``ci/gpu_lease.sh``, the one call a GPU lease gets, run here on the CPU
(``LEASE_DEVICE=cpu``: tiny shapes, interpreted Triton): every phase runs in order within its
share of the time, writes its result where the call's files come back from, and says its exit
status at the end, so a lease cannot be lost to a broken phase or an unwritten report."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_every_phase_runs_and_leaves_its_files(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "BENCH_", "TRITON_", "LEASE_"))}
    env.update(LEASE_DEVICE="cpu", LEASE_TOTAL_S="300", LEASE_OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(ROOT / "ci/gpu_lease.sh")], capture_output=True, text=True, timeout=500,
                          env=env, cwd="/")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert files == {"env.json", "kernels-cpu-lease.json", "kernels-cpu-lease.html", "tuning-cpu-lease.json",
                     "tile-sweep-cpu-lease.json", "numerics.log", "lease.log"}, files
    assert len(files) <= 8  # what a device call brings back
    for phase in ("environment: exit 0", "kernel benchmark: exit 0", "tile sweep: exit 0", "graft tune benchmarks/tuning/tiny-llama: exit 0",
                  "numerics tests: exit 0"):
        assert phase in out, out[-4000:]
    log = (tmp_path / "out/lease.log").read_text()
    assert "== 1. environment" in log and "== 4. kernel numerics tests" in log and "lease done" in log
    bench = json.loads((tmp_path / "out/kernels-cpu-lease.json").read_text())
    assert bench["results"] and all(r["status"] == "ok" for r in bench["results"])
    table = json.loads((tmp_path / "out/tuning-cpu-lease.json").read_text())
    assert table["entries"] and {e["op"] for e in table["entries"]} == {"fused.rms_norm", "fused.silu_and_mul", "gemm.linear"}
    assert " passed" in (tmp_path / "out/numerics.log").read_text()
