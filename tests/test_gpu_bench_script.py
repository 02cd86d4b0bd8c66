"""``ci/gpu_bench.sh`` itself, run here on the CPU (``BENCH_DEVICE=cpu``, tiny shapes), so a
GPU run cannot be wasted by the script: graft is installed when its entry points are missing
(also where pip cannot build it), a run killed mid-case leaves a readable report of every
finished case, and the cases come in tier order with valid baselines and a roofline."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK = "--quick --backends torch --rounds 1 --tag t --target h200"


def _script_env(tmp_path, python, extra_args, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "BENCH_", "TRITON_"))}
    clean.pop("PYTHONPATH", None)
    return dict(clean, PYTHON=str(python), BENCH_DEVICE="cpu", BENCH_OUT=str(tmp_path / "out"),
                BENCH_ARGS=extra_args, **env)


def _copy_tree(dest: Path) -> Path:
    """This checkout's files (tracked and new, not ignored; without git: all but the
    environments and build outputs)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        skip = shutil.ignore_patterns(".venv*", ".git", "build", "__pycache__", "*.egg-info", "*.so", "benchmarks")
        shutil.copytree(ROOT, dest, symlinks=True, ignore=skip)
        return dest
    for name in filter(None, listed.stdout.split(b"\0")):
        src, dst = ROOT / os.fsdecode(name), dest / os.fsdecode(name)
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return dest


def _venv_without_graft(dest: Path, drop=()) -> Path:
    """A venv with every package of this one (linked) except graft, and except ``drop``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    (new_site,) = (dest / "lib").glob("python*/site-packages")
    for entry in site.iterdir():
        name = entry.name.lower()
        if "graft" in name or any(name.startswith(d) for d in drop):
            continue
        os.symlink(entry, new_site / entry.name)
    return dest / "bin" / "python"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["pip", "by_hand"])
def test_installs_graft_when_its_entry_points_are_missing(tmp_path, how):
    """From a fresh interpreter that cannot import graft: the script installs it (pip without
    network; where pip cannot build, e.g. no setuptools, a dist-info with the entry points)
    and the cases then find graft's implementations."""
    tree = _copy_tree(tmp_path / "tree")
    python = _venv_without_graft(tmp_path / "venv", drop=("setuptools",) if how == "by_hand" else ())
    probe = subprocess.run([str(python), "-c", "import graft"], cwd="/", capture_output=True, text=True)
    assert probe.returncode != 0, "the venv under test must not see graft"
    proc = subprocess.run(["bash", str(tree / "ci/gpu_bench.sh")], capture_output=True, text=True, timeout=540,
                          env=_script_env(tmp_path, python, QUICK + " --families fused"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "== installing graft (graft is not importable outside the source tree" in out, out[-4000:]
    if how == "by_hand":
        assert "registering its entry points from pyproject.toml" in out, out[-4000:]
        assert (tree / "build/gpu-bench-site/graft-0.1.0.dist-info/entry_points.txt").is_file()
    else:
        assert "registering" not in out
    report = json.loads((tmp_path / "out/kernels-t.json").read_text())
    assert report["results"] and all(r["status"] == "ok" for r in report["results"]), out[-4000:]
    assert all("graft:torch" in r["timings"] for r in report["results"])
    # a second run finds graft ready and installs nothing
    if how == "pip":
        again = subprocess.run(["bash", str(tree / "ci/gpu_bench.sh")], capture_output=True, text=True, timeout=300,
                               env=_script_env(tmp_path, python, QUICK + " --families fused --match rms_norm"))
        assert again.returncode == 0 and "installing graft" not in again.stdout, again.stdout + again.stderr


def test_a_graft_installed_from_another_tree_is_not_ready(tmp_path):
    """The guard compares where graft imports from with the script's tree (a venv pointing at
    another checkout would benchmark other code)."""
    tree = _copy_tree(tmp_path / "tree")
    text = (tree / "ci/gpu_bench.sh").read_text()
    guard = text[text.index("graft_ready() {"):text.index("\n}\n", text.index("graft_ready() {")) + 3]
    check = f'{guard}\nROOT={tree}\nPY={sys.executable}\ngraft_ready'
    proc = subprocess.run(["bash", "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not from this tree" in proc.stderr, proc.stderr


@pytest.mark.timeout(600)
def test_a_run_killed_mid_case_leaves_a_report_of_what_finished(tmp_path):
    """SIGTERM to the whole script while a case runs (what a CI job's timeout sends): the JSON
    already holds every finished case, the one in flight is marked killed and the rest pending."""
    # 300 interleaved rounds: each case takes seconds, so the kill lands inside the next one
    args = "--quick --backends torch --rounds 300 --tag t --families fused --target h200"
    report = tmp_path / "out/kernels-t.json"
    proc = subprocess.Popen(["bash", str(ROOT / "ci/gpu_bench.sh")], env=_script_env(tmp_path, sys.executable, args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if report.exists() and any(r["status"] == "ok" for r in json.loads(report.read_text())["results"]):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stdout.read()[-3000:]
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "installing graft" not in out
    data = json.loads(report.read_text())
    statuses = [r["status"] for r in data["results"]]
    assert len(statuses) == 6, statuses  # the whole plan is in the report from the start
    assert statuses.count("ok") >= 1 and statuses.count("pending") >= 1, statuses
    assert set(statuses) <= {"ok", "killed", "pending"}, statuses
    assert statuses.count("killed") <= 1
    assert "stopped by SIGTERM" in out or "killed" not in statuses, out[-3000:]
    assert statuses.index("pending") > max(i for i, s in enumerate(statuses) if s == "ok")  # run in plan order
    if "killed" in statuses:  # the handler ran (SIGTERM between two cases kills none)
        assert data["environment"]["stopped_by"] == "SIGTERM"
    for r in data["results"]:
        if r["status"] == "ok":
            assert r["ratios"] and r["timings"]["graft:torch"]["median_s"] > 0


def test_plan_order_baselines_and_roofline(tmp_path):
    """Tier 0 (per family its most informative cases) before the rest, in every family; W8A8
    below _int_mm's M limit against a baseline that runs there; the roofline is the larger of
    bytes at peak bandwidth and FLOPs at the peak MMA rate, beside each measured time."""
    from graft.tools.bench import kernels as bench

    plan = bench.all_cases(list(bench.FAMILIES), False, None)
    tiers = [c.tier for c in plan]
    assert tiers == sorted(tiers) and tiers[0] == 0
    tier0 = [c for c in plan if c.tier == 0]
    assert {c.family for c in tier0} == set(bench.FAMILIES) and len(tier0) <= 24
    assert {c.params["op"] for c in tier0 if c.family == "gemm"} == {
        "linear_bf16", "w8a8", "fp8_tensor", "fp8_block", "w4a16_gptq", "w4a16_gptq_interleaved"}

    assert bench.main(["--device", "cpu", "--quick", "--backends", "torch", "--rounds", "1", "--out", str(tmp_path),
                       "--tag", "t", "--target", "mi300x", "--families", "gemm", "--match", "w8a8"]) == 0
    results = {r["name"]: r for r in json.loads((tmp_path / "kernels-t.json").read_text())["results"]}
    assert "torch._int_mm(rows padded to 32)+scales" in results["w8a8_m16_n64_k96"]["timings"]
    assert "torch._int_mm+scales" in results["w8a8_m33_n64_k96"]["timings"]
    for r in results.values():
        assert r["status"] == "ok" and all("median_s" in t for t in r["timings"].values()), r
        peak = bench.ROOFLINES["mi300x"]
        ideal = max(r["bytes"] / peak["bandwidth"], r["flops"] / peak["flops"]["int8"])
        assert r["roofline"]["ideal_s"] == pytest.approx(ideal)
        for label, t in r["timings"].items():
            assert r["roofline"]["fraction"][label] == pytest.approx(ideal / t["median_s"])
    assert bench.roofline_target("NVIDIA H200") == "h200" and bench.roofline_target("AMD Instinct MI300X") == "mi300x"
    assert bench.roofline_target("NVIDIA A100-SXM4-80GB") is None


def test_a_lost_device_context_ends_the_process_and_resume_runs_the_rest(tmp_path, monkeypatch):
    """A sticky device error after a case (simulated: the check that follows every case says
    the context is gone) ends the process with EXIT_RESUME after recording that case as an
    error with the reason; --resume keeps every finished case and runs only the rest."""
    from graft.tools.bench import kernels as bench

    args = ["--device", "cpu", "--quick", "--backends", "torch", "--rounds", "1", "--out", str(tmp_path),
            "--tag", "t", "--families", "fused"]
    names = [c.name for c in bench.all_cases(["fused"], True, {"torch"})]
    lose_after = names[1]
    monkeypatch.setattr(bench, "context_lost", lambda device: "CUDA error: an illegal memory access" if lose_after in ran else None)
    ran: list = []
    real_run_case = bench.run_case
    monkeypatch.setattr(bench, "run_case", lambda case, *a, **k: ran.append(case.name) or real_run_case(case, *a, **k))
    assert bench.main(args) == bench.EXIT_RESUME
    results = {r["name"]: r for r in json.loads((tmp_path / "kernels-t.json").read_text())["results"]}
    assert ran == names[:2]
    assert results[names[0]]["status"] == "ok"
    assert results[lose_after]["status"] == "error" and "device context was lost" in results[lose_after]["note"]
    assert "illegal memory access" in results[lose_after]["note"]
    assert all(results[n]["status"] == "pending" for n in names[2:])

    ran.clear()
    monkeypatch.setattr(bench, "context_lost", lambda device: None)
    assert bench.main(args + ["--resume"]) == 0
    data = json.loads((tmp_path / "kernels-t.json").read_text())
    results = {r["name"]: r for r in data["results"]}
    assert ran == names[2:], "finished cases must not run again"
    assert results[lose_after]["status"] == "error" and all(results[n]["status"] == "ok" for n in names[2:])
    assert data["environment"]["resumed"] == 1


@pytest.mark.timeout(600)
def test_a_hung_case_is_killed_and_the_script_resumes_without_it(tmp_path):
    """A case still running after --case-timeout-s (here every case: 400 rounds of a few ms, a
    0.5 s watchdog) is recorded as killed and its process exits; the script starts a new one
    with --resume each time, so every case is tried once and the run ends with a full report."""
    args = "--quick --backends torch --rounds 400 --tag t --families fused --match rms_norm --case-timeout-s 0.5"
    proc = subprocess.run(["bash", str(ROOT / "ci/gpu_bench.sh")], capture_output=True, text=True, timeout=540,
                          env=_script_env(tmp_path, sys.executable, args))
    out = proc.stdout + proc.stderr
    data = json.loads((tmp_path / "out/kernels-t.json").read_text())
    statuses = [r["status"] for r in data["results"]]
    assert statuses and set(statuses) == {"killed"}, (statuses, out[-3000:])
    assert all("--case-timeout-s" in r["note"] for r in data["results"])
    assert out.count("resuming in a new process") == len(statuses), out[-3000:]
    assert data["environment"]["resumed"] == len(statuses)
    assert proc.returncode == 1, out[-3000:]  # nothing finished ok


def test_tile_sweep_times_candidate_rows_and_restores_the_table(tmp_path):
    """The tile sweep (a GPU lease's measured table changes) on the CPU: each candidate row
    is in place only while its launch is prepared, its output is compared with the current
    row's, every candidate and the library baseline get medians, and the table is as before."""
    import copy

    from graft.tools.bench import tile_sweep
    from graft.kernels.triton import _gemm_common as common

    from graft.kernels.triton import attention_prefill

    before = copy.deepcopy((common.TILES, common.KIND_TILES, common.TMA_TILES, common.TMA_MIN_M,
                            attention_prefill.TILES))
    assert tile_sweep.main(["--device", "cpu", "--quick", "--rounds", "2", "--out", str(tmp_path), "--tag", "t"]) == 0
    assert (common.TILES, common.KIND_TILES, common.TMA_TILES, common.TMA_MIN_M, attention_prefill.TILES) == before
    report = json.loads((tmp_path / "tile-sweep-t.json").read_text())
    assert set(report["sweeps"]) == {name for name, _ in tile_sweep.QUICK_SWEEPS}
    for name, rows in tile_sweep.QUICK_SWEEPS:
        entry = report["sweeps"][name]
        assert entry["status"] == "ok", entry
        labels = {"current", *(tile_sweep._label(r) for r in rows)}
        assert labels <= set(entry["candidates"]) and any(k.startswith("baseline") for k in entry["candidates"])
        # a GEMM row sums K in the same order; another attention tile sums keys in another
        # order (fp32 online softmax), so a bf16 output may round the other way (2^-8)
        tolerance = 1e-2 if name.startswith("ragged") else 1e-3
        for label in labels:
            c = entry["candidates"][label]
            assert c["median_s"] > 0 and c["max_rel_diff_vs_current"] < tolerance, c
        assert entry["best"] in labels


def test_tile_sweep_reports_a_tma_row_that_fell_back_as_an_error(tmp_path, monkeypatch):
    """A TMA row whose kernel does not compile or launch (Triton 3.9's warp specialisation on
    sm_90 does not) makes matmul fall back to the pointer kernel: the sweep reports the row as
    an error instead of timing the pointer kernel under its label, and the next TMA rows are
    tried again."""
    from graft.tools.bench import tile_sweep
    from graft.kernels.triton import gemm_linear

    real = gemm_linear._launch_tma

    def launch(cfg, *args):
        if cfg.get("WARP_SPECIALIZE"):
            raise RuntimeError("PassManager::run failed")
        return real(cfg, *args)

    monkeypatch.setattr(gemm_linear, "_launch_tma", launch)
    monkeypatch.setattr(gemm_linear, "_tma_failed", {})
    ((name, rows), *_) = tile_sweep.QUICK_SWEEPS
    monkeypatch.setattr(tile_sweep, "QUICK_SWEEPS", ((name, (*rows[1:], rows[1])),))  # a TMA row after the failing one
    assert tile_sweep.main(["--device", "cpu", "--quick", "--rounds", "1", "--out", str(tmp_path), "--tag", "t"]) == 0
    entry = json.loads((tmp_path / "tile-sweep-t.json").read_text())["sweeps"][name]
    ws, tma = tile_sweep._label(rows[2]), tile_sweep._label(rows[1])
    error = entry["candidates"][ws]["error"]
    assert "PassManager::run failed" in error and "pointer kernel" in error
    assert entry["candidates"][tma]["median_s"] > 0 and gemm_linear._tma_failed == {}


def test_tile_row_replaces_only_the_row_of_that_m():
    from graft.tools.bench import tile_sweep
    from graft.kernels.triton import _gemm_common as common

    row = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=1, num_stages=1)
    with tile_sweep.tile_row("hopper", 4096, row):
        assert common.base_config("hopper", 4096, 2)["BLOCK_N"] == 16
        assert common.base_config("hopper", 16, 2)["BLOCK_N"] == 64  # the M<=16 row is untouched
    assert common.base_config("hopper", 4096, 2)["BLOCK_N"] == 256


def test_tile_row_switches_between_the_tma_and_the_pointer_kernel():
    """A TMA candidate row is the TMA kernel's row at that M; any other row runs the pointer
    kernel (TMA off), so a sweep compares the two kernels; the tables are restored after."""
    import torch

    from graft.tools.bench import tile_sweep
    from graft.kernels.triton import gemm_linear

    hopper = dict(generation="hopper", sms=132)
    assert gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", **hopper)["TMA"]
    row = dict(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=4, TMA=True)
    with tile_sweep.tile_row("hopper", 4096, row):
        cfg = gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", **hopper)
        assert cfg["TMA"] and (cfg["BLOCK_N"], cfg["num_stages"]) == (128, 4)
    pointer = dict(BLOCK_M=256, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=3)
    with tile_sweep.tile_row("hopper", 4096, pointer):
        cfg = gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", **hopper)
        assert not cfg.get("TMA") and cfg["BLOCK_M"] == 256
    cfg = gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", **hopper)
    assert cfg["TMA"] and cfg["BLOCK_N"] == 256


def test_a_case_holds_nothing_once_it_is_measured(monkeypatch):
    """What a case built (inputs, outputs, captured graphs) is gone when the memory is given
    back: release() runs after the case's frame is gone, with the cyclic collector (an H200
    run released inside the case and kept 80 GiB reserved)."""
    import weakref

    import torch

    from graft.tools.bench import kernels as bench

    class Inputs:  # stands for the case's device tensors
        def __init__(self):
            self.x = torch.ones(4)
            self.cycle = self  # only the cyclic collector frees it

    refs, alive_at_release = [], []

    def build(device, dtype):
        inputs = Inputs()
        refs.append(weakref.ref(inputs))
        return {"graft:torch": lambda: inputs.x * 2}, {"torch": lambda: inputs.x + inputs.x}

    real_release = bench.release
    monkeypatch.setattr(bench, "release", lambda device, result=None: (
        real_release(device, result), alive_at_release.append(refs[-1]() is not None)))
    case = bench.Case("fused", "held", {}, build)
    r = bench.run_case(case, torch.device("cpu"), torch.float32, False, 2)
    assert r.status == "ok" and r.ratios, r
    assert alive_at_release == [False]


def test_measured_kind_rows_apply_to_their_kind_only():
    """The rows a tile sweep measured faster for one kernel kind (KIND_TILES) are what that
    kind's launcher plans with on Hopper; the other kinds keep the shared row, and a sweep's
    candidate replaces both while it is measured."""
    from graft.tools.bench import tile_sweep
    from graft.kernels.triton import gemm_fp8, gemm_linear, gemm_w4a16, gemm_w8a8
    from graft.kernels.triton import _gemm_common as common
    import torch

    hopper = dict(generation="hopper", sms=132)
    linear = gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", tma=False, **hopper)  # the pointer kernel's
    assert (linear["BLOCK_M"], linear["BLOCK_N"], linear["BLOCK_K"]) == (256, 128, 64)
    assert gemm_linear.plan(4096, 28672, 4096, torch.float32, "cuda", **hopper)["BLOCK_M"] == 128  # bf16-measured only
    block = gemm_fp8.plan(4096, 28672, 4096, "cuda", True, **hopper)
    assert (block["BLOCK_M"], block["BLOCK_N"], block["num_warps"], block["num_stages"]) == (64, 128, 4, 4)
    tensor = gemm_fp8.plan(4096, 28672, 4096, "cuda", False, **hopper)
    assert (tensor["BLOCK_M"], tensor["BLOCK_N"]) == (128, 256)
    assert gemm_w4a16.plan(4096, 28672, 4096, torch.bfloat16, "cuda", 128, **hopper)["BLOCK_N"] == 256
    assert gemm_w8a8.plan(4096, 28672, 4096, "cuda", **hopper)["BLOCK_N"] == 256
    assert gemm_linear.plan(16, 6144, 4096, torch.bfloat16, "cuda", **hopper)["BLOCK_M"] == 16  # M<=16: shared row
    row = dict(BLOCK_M=128, BLOCK_N=64, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=3)
    with tile_sweep.tile_row("hopper", 4096, row):
        assert gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", **hopper)["BLOCK_N"] == 64
        assert gemm_fp8.plan(4096, 28672, 4096, "cuda", True, **hopper)["BLOCK_N"] == 64
    assert gemm_linear.plan(4096, 28672, 4096, torch.bfloat16, "cuda", tma=False, **hopper)["BLOCK_M"] == 256
    assert "hopper" in common.KIND_TILES
