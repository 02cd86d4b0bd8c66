"""The nccl-tests style benchmark runs (2 gloo ranks, tiny sizes) and its columns add up."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(150)
def test_bench_tiny_run_columns_and_bus_factor(capsys):
    from graft.tools.bench import collectives_sweep as bench

    argv = ["--ranks", "2", "--backend", "gloo", "--min-bytes", "1KiB", "--max-bytes", "4KiB", "--factor", "4",
            "--iters", "2", "--warmup", "1", "--timeout", "60",
            "--ops", "all_reduce,all_gather,reduce_scatter,all_gather_quantized,gemm_reduce_scatter"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0].split() == list(bench.COLUMNS)
    assert "THIS machine only" in out
    rows = [dict(zip(bench.COLUMNS, line.split())) for line in lines[1:]]
    seen = {(r["op"], r["impl"]) for r in rows}
    for expected in [("all_reduce", "library"), ("all_reduce", "oneshot"), ("all_reduce", "twoshot"),
                     ("all_reduce", "graft"), ("all_gather", "library"), ("reduce_scatter", "library"),
                     ("all_gather_quantized", "int8"), ("gemm_reduce_scatter", "overlap")]:
        assert expected in seen, (expected, sorted(seen))
    assert {int(r["size"]) for r in rows if r["op"] == "all_reduce"} == {1024, 4096}
    n = 2
    for r in rows:
        algbw, busbw, t = float(r["algbw_GBps"]), float(r["busbw_GBps"]), float(r["time_us"])
        factor = 2 * (n - 1) / n if r["op"] == "all_reduce" else (n - 1) / n
        assert busbw == pytest.approx(algbw * factor, rel=1e-3, abs=2e-4), r
        assert algbw == pytest.approx(int(r["size"]) / (t * 1e-6) / 1e9, rel=1e-2, abs=2e-4), r
        assert int(r["count"]) * 4 == int(r["size"]) and r["type"] == "float32"
        if r["impl"] == "library":
            assert r["vs_library"] == "1.00"


def test_bench_sizes_and_arguments():
    from graft.tools.bench import collectives_sweep as bench

    assert bench.sizes(8, 100, 2) == [8, 16, 32, 64]
    assert bench.parse_bytes("512MiB") == 512 << 20 and bench.parse_bytes("3k") == 3072
    with pytest.raises(SystemExit):
        bench.parse_args(["--ops", "all_to_all"])


@pytest.mark.timeout(150)
def test_overhead_function_reports_ratios_for_each_collective():
    from graft.tools.bench import collectives_sweep as bench

    res = bench.overhead(world_size=2, quick=True, numel=2000, timeout=60)
    assert res["world_size"] == 2 and res["numel"] == 2000 and res["backend"] == "gloo"
    assert set(res["ops"]) == set(bench.OVERHEAD_OPS)
    for name, r in res["ops"].items():
        assert r["library_us"] > 0 and r["graft_us"] > 0, (name, r)
        assert r["ratio"] == pytest.approx(r["graft_us"] / r["library_us"]), (name, r)
    assert res["max_ratio"] == max(r["ratio"] for r in res["ops"].values())
    with pytest.raises(ValueError, match="world_size"):
        bench.overhead(world_size=0)
