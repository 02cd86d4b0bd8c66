"""``graft profile`` against hostile jobs and folders: it never breaks the job it profiles,
never loses a file it did not write, and ends and reports the way the command did.

Each case runs the real command on a small job (bounded by a timeout): range names torch's
export cannot write as JSON, a recorder that fails inside the job, a window of many small
calls (the job's memory against torch's own profiler alone), a rank's forked child, a
``--out`` holding a user's files, corrupt ``--compare`` files, a command killed by a signal,
and Ctrl-C twice on a command that ignores the first."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from graft.profiling import analysis, report, tracescan

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "VLLM_", "RANK", "WORLD_SIZE"))}
    path = env.get("PYTHONPATH")
    env.update(PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""), OMP_NUM_THREADS="1", **extra)
    return env


def _profile(out, script, *script_args, steps=2, warmup=1, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "graft", "profile", "--out", str(out), "--steps", str(steps),
                           "--warmup", str(warmup), "--", sys.executable, str(script), *map(str, script_args)],
                          capture_output=True, text=True, timeout=timeout, env=env or _env())


def _script(tmp_path, name, text) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _hwm_kib(status_text: str) -> int:
    return next(int(line.split()[1]) for line in status_text.splitlines() if line.startswith("VmHWM:"))


# -- the job survives what it records ---------------------------------------------------------
HOSTILE_NAMES = ['say "hi"', 'line\nbreak "and" quote', 'ünïcødé ✓ "q" {', 'back\\slash', 'tab\there"',
                 '{"x": 1}}', '"', '\\"']


def test_hostile_range_names_complete_with_a_report(tmp_path):
    """Names with quotes, newlines and non-ASCII (torch's export leaves a quote unescaped):
    the job finishes with exit 0 and the report reads every event."""
    script = _script(tmp_path, "job.py", f"""
import torch, graft.profiling
from graft.ops import fused
w = torch.nn.Parameter(torch.ones(8)); opt = torch.optim.SGD([w], lr=1e-3)
for i in range(4):
    for n in {HOSTILE_NAMES!r}:
        with torch.profiler.record_function(n):
            y = fused.rms_norm(torch.randn(4, 8), w, 1e-6)
    y.sum().backward(); opt.step(); opt.zero_grad()
print("job done")
""")
    out = tmp_path / "out"
    run = _profile(out, script)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "job done" in run.stdout
    assert "recorder failed" not in run.stderr
    profile = report.load(out)
    (proc,) = [p for p in profile["processes"] if p.get("window")]
    rows = {(r["kind"], r["name"]) for r in proc["ops"]}
    assert ("graft", "fused.rms_norm") in rows, rows
    assert next(r for r in proc["ops"] if r["name"] == "fused.rms_norm")["calls"] == 2 * len(HOSTILE_NAMES)
    assert not any("could not be read" in w for w in profile["warnings"]), profile["warnings"]
    assert any("unescaped" in w for w in profile["warnings"]) and "unescaped" in (out / "profile.html").read_text()
    merged = json.loads((out / "trace.json").read_text(encoding="utf-8"))  # valid JSON, whatever torch wrote
    names = {e.get("name") for e in merged["traceEvents"]}
    assert 'say "hi"' in names and '{"x": 1}}' in names


def test_scanner_survives_what_json_cannot(tmp_path):
    """Quotes, a raw newline inside a name, invalid UTF-8, a broken args block, a truncated
    last event: every readable event comes back, the rest are counted."""
    block = '  {{\n    "ph": "X",\n    "cat": "cpu_op",\n    "name": {name},\n    "pid": 1,\n    "tid": 1,\n' \
            '    "ts": {ts},\n    "dur": 1\n    ,\n    "args": {{\n      {args}\n    }}\n  }}'
    events = [block.format(name='"a "quoted" name"', ts=1, args='"Ev Idx": 0'),
              block.format(name='"two\nlines"', ts=2, args='"Ev Idx": 1'),
              block.format(name='"ok"', ts=3, args='"Concrete Inputs": ["a"b"], "Ev Idx": 2'),
              block.format(name='"fine"', ts=4, args='"Ev Idx": 3')]
    raw = ('{\n  "schemaVersion": 1,\n  "traceEvents": [\n' + ",\n".join(events) + ",\n  {\n    \"ph\": \"X\",\n"
           ).encode() + b'    "name": "bad \xff byte",\n'
    path = tmp_path / "t.json"
    path.write_bytes(raw)
    problems = tracescan.Problems()
    got = list(tracescan.events(path, problems))
    assert [e["name"] for e in got] == ['a "quoted" name', "two\nlines", "ok", "fine"]
    assert "args" not in got[2] and got[3]["args"] == {"Ev Idx": 3}
    assert problems.repaired == 2 and problems.args_dropped == 1 and problems.skipped == 1
    assert "truncated" in " ".join(problems.messages())


def test_a_failing_recorder_does_not_reach_the_job(tmp_path):
    """The recorder fails while closing the window, inside the job's optimizer.step(): the
    job goes on and exits 0, and the failure is said once."""
    script = _script(tmp_path, "job.py", """
import torch, graft.profiling.shapes as shapes
def broken(*a, **k):
    raise OSError("disk full (simulated)")
shapes.write = broken
w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.SGD([w], lr=0.1)
for _ in range(5):
    (w * 2).sum().backward(); opt.step(); opt.zero_grad()
print("job done")
""")
    run = _profile(tmp_path / "out", script)
    assert "job done" in run.stdout, run.stderr[-3000:]
    assert run.stderr.count("the recorder failed") == 1 and "disk full (simulated)" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    (proc,) = report.load(tmp_path / "out")["processes"]  # named in the report, with the reason
    assert not proc.get("window") and "disk full (simulated)" in proc["note"], proc


# -- a window of many small calls --------------------------------------------------------------
MANY = """
import os, sys, torch
n, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
x = torch.zeros(1)
if mode == "graft":
    import graft.profiling as p
    p.step()  # the warm-up step: the window opens
elif mode == "torch":  # torch's own profiler, as graft's recorder runs it, and nothing else
    import graft.profiling
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    prof.start()
for _ in range(n):
    x.add_(1)
if mode == "graft":
    p.step()  # the window closes: the recorder writes its files, in this process
elif mode == "torch":
    prof.stop()
    prof.export_chrome_trace(os.path.join(os.path.dirname(out), "torch-alone.trace.json"))
with open(out, "w") as f:
    f.write(open("/proc/self/status").read())
print("job done")
"""


def _many_calls(tmp_path, n: int, timeout: int, measure_analysis: bool):
    script = _script(tmp_path, "many.py", MANY)
    hwm = {}
    for mode in ("none", "torch"):
        status = tmp_path / f"{mode}.status"
        run = subprocess.run([sys.executable, str(script), str(n), mode, str(status)], capture_output=True,
                             text=True, timeout=timeout, env=_env())
        assert run.returncode == 0, run.stderr[-2000:]
        hwm[mode] = _hwm_kib(status.read_text())
    out = tmp_path / "out"
    status = tmp_path / "graft.status"
    run = _profile(out, script, n, "graft", status, steps=1, warmup=1, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    hwm["graft"] = _hwm_kib(status.read_text())
    # the job under graft profile costs what torch's profiler costs and no more: no trace is read in it
    # (reading its trace in the job, as graft did, cost ~6x the trace: 10k calls, ~22 MB, ~150 MB)
    assert hwm["graft"] - hwm["torch"] < 60 * 1024, hwm
    print(f"max RSS (MiB): without profiling {hwm['none'] >> 10}, torch's profiler alone {hwm['torch'] >> 10}, "
          f"under graft profile {hwm['graft'] >> 10}")
    profile = report.load(out)
    (proc,) = [p for p in profile["processes"] if p.get("window")]
    add = next(r for r in proc["ops"] if r["name"] == "aten::add_")
    assert add["calls"] == n
    if not measure_analysis:
        return hwm
    # and the analysis (graft profile's own process) holds less than the trace (json.load of it: ~6x)
    trace = out / proc["trace"]
    tracemalloc.start()
    try:
        again = analysis.analyse_file(trace, wall_s=proc["wall_us"] / 1e6, steps=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert next(r for r in again["ops"] if r["name"] == "aten::add_")["calls"] == n
    assert peak < trace.stat().st_size, (peak, trace.stat().st_size)
    return hwm


@pytest.mark.timeout(240)
def test_many_small_calls_job_memory_is_torchs_alone(tmp_path):
    _many_calls(tmp_path, 10_000, timeout=200, measure_analysis=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_100k_small_calls_job_memory_is_torchs_alone(tmp_path):
    _many_calls(tmp_path, 100_000, timeout=800, measure_analysis=True)


# -- labels -------------------------------------------------------------------------------------
def test_a_rank_and_its_forked_child_each_have_a_profile(tmp_path):
    """A process forked from rank 0 (RANK set, as under torchrun) steps too: two profiles,
    two labels, neither overwriting the other."""
    script = _script(tmp_path, "job.py", """
import multiprocessing as mp, torch
import graft.profiling as p
def work():
    for _ in range(4):
        torch.mm(torch.randn(32, 32), torch.randn(32, 32)); p.step()
if __name__ == "__main__":
    child = mp.get_context("fork").Process(target=work)
    child.start(); child.join()
    assert child.exitcode == 0
    work()
""")
    out = tmp_path / "out"
    run = _profile(out, script, env=_env(RANK="0"))
    assert run.returncode == 0, run.stderr[-3000:]
    recorded = [p for p in report.load(out)["processes"] if p.get("window")]
    labels = sorted(p["label"] for p in recorded)
    assert len(labels) == 2 and len(set(labels)) == 2 and all(l.startswith("rank0-pid") for l in labels), labels
    assert len({p["pid"] for p in recorded}) == 2
    assert len(list(out.glob("*.trace.json"))) == 2 and (out / "trace.json").is_file()  # each its own, and merged


# -- --out ---------------------------------------------------------------------------------------
QUICK = "import torch, graft.profiling as p\nfor _ in range(3):\n    torch.ones(2).add_(1); p.step()\n"


def test_out_holding_a_users_files_keeps_them(tmp_path):
    script = _script(tmp_path, "job.py", QUICK)
    out = tmp_path / "mine"
    out.mkdir()
    theirs = {"model.trace.json": "my own trace", "run.summary.json": "{}", "a.shapes.json": "[]", "notes.txt": "x"}
    for name, text in theirs.items():
        (out / name).write_text(text)
    run = _profile(out, script)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "not empty" in run.stderr and "Nothing was deleted" in run.stderr and "Traceback" not in run.stderr
    assert {p.name: p.read_text() for p in out.iterdir()} == theirs


def test_out_replaces_only_graft_s_earlier_profile_of_the_same_command(tmp_path):
    script = _script(tmp_path, "job.py", QUICK)
    out = tmp_path / "out"
    first = _profile(out, script)
    assert first.returncode == 0, first.stderr[-2000:]
    old_traces = {p.name for p in out.glob("pid*.trace.json")}
    second = _profile(out, script)  # the same command: its earlier profile is replaced
    assert second.returncode == 0, second.stderr[-2000:]
    assert old_traces and not old_traces & {p.name for p in out.glob("pid*.trace.json")}
    (out / "mine.txt").write_text("keep me")  # a file graft did not write: refused, nothing deleted
    before = sorted(p.name for p in out.iterdir())
    third = _profile(out, script)
    assert third.returncode == 2 and "mine.txt" in third.stderr and "nothing was deleted" in third.stderr
    assert sorted(p.name for p in out.iterdir()) == before and (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    other = _script(tmp_path, "other.py", QUICK)  # another command: its profile is kept
    fourth = _profile(out, other)
    assert fourth.returncode == 2 and "another command" in fourth.stderr
    assert sorted(p.name for p in out.iterdir()) == [n for n in before if n != "mine.txt"]


def test_bad_out_is_a_clear_error(tmp_path):
    script = _script(tmp_path, "job.py", QUICK)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, expect in ((a_file, "is a file"), (a_file / "below", "cannot write")):
        run = _profile(out, script)
        assert run.returncode == 2, (out, run.stderr[-2000:])
        assert str(out) in run.stderr and expect in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert a_file.read_text() == "x"


def test_corrupt_compare_files_are_clear_errors(tmp_path):
    good = {"format": report.FORMAT, "processes": [{"label": "pid1", "window": {"steps": 1}}]}
    cases = {"garbage.json": b"not json at all", "truncated.json": b'{"format": "graft-profile/1", "proc',
             "list.json": b"[1, 2]", "latin1.json": b'{"format": "\xff"}',
             "no-processes.json": json.dumps({"format": report.FORMAT}).encode(),
             "damaged.json": json.dumps(good).encode()}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        run = subprocess.run([sys.executable, "-m", "graft", "profile", "--compare", str(tmp_path / name),
                              str(tmp_path / name)], capture_output=True, text=True, timeout=60, env=_env())
        assert run.returncode == 2, (name, run.stderr[-2000:])
        assert name in run.stderr and "Traceback" not in run.stderr, (name, run.stderr[-2000:])


# -- how the command ends -----------------------------------------------------------------------
def test_a_command_killed_by_a_signal_passes_its_status_through(tmp_path):
    script = _script(tmp_path, "job.py", QUICK + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    run = _profile(tmp_path / "out", script)
    assert run.returncode == 128 + signal.SIGKILL, (run.returncode, run.stderr[-2000:])
    assert "killed by SIGKILL" in run.stderr and "A step is an optimizer step" not in run.stderr, run.stderr
    assert [p for p in report.load(tmp_path / "out")["processes"] if p.get("window")]  # its window was written


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_ctrl_c_twice_ends_the_command_and_leaves_no_orphan(tmp_path):
    """A command that ignores the first Ctrl-C (and has a child of its own): the second one
    ends both, and graft profile exits without a traceback."""
    pids = tmp_path / "pids"
    script = _script(tmp_path, "job.py", f"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(300)"])
open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
time.sleep(300)
""")
    proc = subprocess.Popen([sys.executable, "-m", "graft", "profile", "--out", str(tmp_path / "out"), "--", sys.executable,
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    job = grandchild = None
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        job, grandchild = map(int, pids.read_text().split())
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None and _alive(job)  # the first Ctrl-C was the job's to handle (it ignores it)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=40)
        assert "Traceback" not in err, err[-3000:]
        assert "ending the command" in err
        for _ in range(50):
            if not _alive(job) and not _alive(grandchild):
                break
            time.sleep(0.1)
        assert not _alive(job) and not _alive(grandchild), (job, grandchild)
    finally:
        for pid in (job, grandchild):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
