"""Issue 42: `graft tune` under hostile input: every CLI input checked before anything is
measured (exit 2, a message naming the value, no traceback); one writer per table; shapes
recorded by `graft profile` (keyword arguments included) replay as valid calls."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from graft import tuning
from graft.profiling.ranges import _summary
from graft.tools.replay import call_arguments


def _tune(*argv, timeout=300, wait=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_") and k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "graft", "tune", *argv]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _shapes(path, entries):
    path.write_text(json.dumps({"format": tuning.SHAPES_FORMAT, "shapes": entries}))
    return str(path)


RMS = {"op": "fused.rms_norm", "dtype": "float32", "args": [{"shape": [8, 64]}, {"shape": [64]}, 1e-6, None]}


def _config(path, **cfg):
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("make, message", [
    (lambda p: ["--shapes", _shapes(p / "s.json", [RMS]), "--device", "foo"], "--device 'foo' is not a device"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [RMS]), "--device", "cuda"], "no GPU"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [RMS]), "--out", str(p)], "is a folder"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [RMS]), "--out", str(p / "no" / "t.json")], "does not exist"),
    (lambda p: ["--model", _config(p / "c.json", hidden_size="abc", num_attention_heads=4, intermediate_size=8)],
     "hidden_size must be a positive integer"),
    (lambda p: ["--model", _config(p / "c.json", hidden_size=64, num_attention_heads=3, intermediate_size=8)],
     "not a multiple of num_attention_heads"),
    (lambda p: ["--model", _config(p / "c.json", hidden_size=64, num_attention_heads=4, intermediate_size=8,
                                   rms_norm_eps="tiny")], "rms_norm_eps"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [dict(RMS, args=[{"shape": [8, -1]}, {"shape": [64]}, 1e-6, None])])],
     "non-negative ints"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [dict(RMS, dtype="float7")])], "'float7' is not a torch dtype"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [dict(RMS, kwargs={"nope": 1})])], "takes no argument 'nope'"),
    (lambda p: ["--shapes", _shapes(p / "s.json", [dict(RMS, kwargs=[1])])], "'kwargs' must be an object"),
    (lambda p: ["--shapes", str((p / "s.json").write_bytes(b"\xff\xfe") and p / "s.json")], "not UTF-8"),
])
def test_bad_input_is_a_clear_error_before_measuring(tmp_path, make, message):
    proc = _tune(*make(tmp_path), "--out", str(tmp_path / "t.json")) if "--out" not in make(tmp_path) \
        else _tune(*make(tmp_path))
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "t.json").exists()


def test_a_second_writer_of_one_table_is_refused(tmp_path):
    shapes = _shapes(tmp_path / "s.json", [dict(RMS, args=[{"shape": [64, h]}, {"shape": [h]}, 1e-6, None])
                                            for h in range(64, 2064)])  # 2000 buckets: minutes of work
    out = tmp_path / "t.json"
    first = _tune("--shapes", shapes, "--out", str(out), "--rounds", "3", "--frameworks", "", wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "t.json.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "t.json.lock").exists(), "the first run never took its lock"
        second = _tune("--shapes", shapes, "--out", str(out), "--frameworks", "")
        assert second.returncode == 2 and "being written by another graft tune (pid" in second.stderr, second.stderr
    finally:
        first.kill()
        first.communicate()
    # a killed holder does not keep the table locked
    third = _tune("--shapes", _shapes(tmp_path / "one.json", [RMS]), "--out", str(out), "--rounds", "1",
                  "--frameworks", "")
    assert third.returncode == 0, third.stderr[-2000:]
    assert not (tmp_path / "t.json.lock").exists()


def _recorded_cases():
    from graft.plugins import get_host
    from graft.tools.conformance.cases import all_cases

    host = get_host()
    out = []
    for case in all_cases(host, host.registry):
        spec = host.registry.op(case.op)
        if spec.family == "collectives" or "quick" not in case.tags:
            continue
        dtype = torch.float32 if torch.float32 in case.dtypes else case.dtypes[0]
        args, kwargs = case.inputs("cpu", dtype)
        entry = {"op": case.op, "dtype": str(dtype).replace("torch.", ""), "args": [_summary(a) for a in args],
                 "kwargs": {k: _summary(v) for k, v in kwargs.items()}}
        assert not any(isinstance(a, dict) and "type" in a for a in entry["args"]), (case.id, entry["args"])
        out.append((case, spec, args, kwargs, entry))
    return out


def test_recorded_calls_of_every_op_replay_as_valid_calls():
    """What the profiler records for each op's quick cases (its own summariser) replays as a
    call the op's validation accepts, in the bucket of the original call."""
    found = _recorded_cases()
    assert {c.op for c, *_ in found} >= {"attention.prefill", "attention.prefill_paged", "attention.decode_paged",
                                         "fused.rotary_embedding", "moe.fused_experts", "gemm.linear", "gemm.w8a8",
                                         "gemm.fp8"}
    for case, spec, args, kwargs, entry in found:
        a, k = call_arguments(entry, spec, "cpu", torch.Generator().manual_seed(0), case.id)
        if spec.validate is not None:
            spec.validate(*a, **k)
        spec.reference(*a, **k)
        assert tuning.bucket(case.op, a, k) == tuning.bucket(case.op, args, kwargs), case.id


def test_profile_to_tune_keeps_keyword_arguments(tmp_path):
    """attention.prefill called with keyword arguments, recorded as graft profile records
    it: graft tune measures it and its table entry is the original call's bucket."""
    q = torch.randn(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kwargs = {"max_seqlen_q": 7, "max_seqlen_k": 7, "causal": True}
    args = (q, q.clone(), q.clone(), cu, cu.clone())
    entry = {"op": "attention.prefill", "dtype": "float32", "args": [_summary(a) for a in args],
             "kwargs": {k: _summary(v) for k, v in kwargs.items()}, "calls": 3}
    out = tmp_path / "t.json"
    proc = _tune("--shapes", _shapes(tmp_path / "s.json", [entry]), "--out", str(out), "--rounds", "2",
                 "--frameworks", "")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = json.loads(out.read_text())
    assert [e["bucket"] for e in table["entries"]] == [tuning.bucket("attention.prefill", args, kwargs)], table
