"""Issue 42, item 2 and 5: a call's tuning-table choice depends only on the call and the
table, never on which calls came before (two ranks with different histories agree), and
the table and the batch-invariant switch are read once per configuration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import graft
from graft import dispatch, tuning

# Each op's first float32 case, then its last varying integer scalar made larger (still
# valid: a longer max_seqlen, a later step) for the "history" call.
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import graft
    from graft import dispatch
    from graft.plugins import get_host
    from graft.tools.conformance.cases import all_cases
    op, history = sys.argv[1], sys.argv[2] == "1"
    host = get_host()
    case = next(c for c in all_cases(host, host.registry) if c.op == op and torch.float32 in c.dtypes)
    args, kwargs = case.inputs("cpu", torch.float32)
    spec = host.registry.op(op)
    import inspect
    names = list(inspect.signature(spec.reference).parameters)
    at = max(i for i, n in enumerate(names) if n in spec.varying_names and i < len(args)
             and isinstance(args[i], int) and not isinstance(args[i], bool))
    if history:
        earlier = list(args)
        earlier[at] = args[at] + 1
        dispatch.run(op, *[a.clone() if isinstance(a, torch.Tensor) else a for a in earlier], **kwargs)
    served = dispatch.run(op, *args, **kwargs)[1]
    print(json.dumps({"served": [served.backend, served.provider], "bucket": __import__("graft.tuning").tuning.bucket(op, args, kwargs)}))
""")


def _table(path, entries):
    path.write_text(json.dumps({"format": tuning.FORMAT, "device": tuning.device_key("cpu"),
                                "versions": tuning.versions(), "entries": entries}))
    return str(path)


def _rank(op, history, env):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, op, "1" if history else "0"], capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("op", ["attention.prefill", "fused.adam_step"])
def test_two_ranks_with_different_histories_serve_a_call_alike(tmp_path, op):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_") and k != "TRITON_INTERPRET"}
    fresh = _rank(op, False, env)
    assert fresh["served"] == ["torch", "graft"]  # the default order, without a table
    # A table sends this call's bucket to the torch reference.
    env["GRAFT_TUNING_TABLE"] = _table(tmp_path / "t.json", [
        {"op": op, "dtype": "float32", "bucket": fresh["bucket"], "backend": "torch", "provider": "torch",
         "ratio": 1.3}])
    first, later = _rank(op, False, env), _rank(op, True, env)
    assert first["served"] == later["served"] == ["torch", "torch"], (first, later)


def test_varying_scalars_are_not_in_the_bucket():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    a = tuning.bucket("attention.prefill", (q, q, q, cu, cu, 4, 4, True, None))
    b = tuning.bucket("attention.prefill", (q, q, q, cu, cu, 9, 9, True, None))
    assert a == b and "max_seqlen" not in a and "causal=True" in a


def test_a_meta_call_does_not_reread_the_table(fresh_graft, tmp_path, monkeypatch):
    x, w = torch.randn(4, 64), torch.randn(64)
    bucket = tuning.bucket("fused.rms_norm", (x, w, 1e-6, None), {})
    path = tmp_path / "t.json"
    entry = {"op": "fused.rms_norm", "dtype": "float32", "bucket": bucket, "backend": "torch", "provider": "torch"}
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(path, [entry]))
    graft.reload_config()
    assert dispatch.run("fused.rms_norm", x, w, 1e-6, None)[1].provider == "torch"
    _table(path, [dict(entry, provider="graft")])  # edited on disk: applies after a reload only
    tuning.tables("meta")
    assert [t.entries[("fused.rms_norm", "float32", bucket)]["provider"] for t in tuning.tables("cpu")] == ["torch"]
    dispatch.run("fused.rms_norm", x.half(), w.half(), 1e-6, None)  # another dtype plans after the edit
    assert tuning.tables("cpu")[0].entries[("fused.rms_norm", "float32", bucket)]["provider"] == "torch"
    graft.reload_config()
    assert tuning.tables("cpu")[0].entries[("fused.rms_norm", "float32", bucket)]["provider"] == "graft"


def test_vllm_batch_invariant_is_read_once_per_configuration(fresh_graft, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    graft.reload_config()
    assert tuning.invariant() is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert tuning.invariant() is False  # not re-read on a lookup
    graft.reload_config()
    assert tuning.invariant() is True


def test_an_entry_naming_a_backend_that_cannot_serve_here_wants_nothing(fresh_graft, tmp_path, monkeypatch):
    """A table made on a GPU names triton; on this CPU (no interpreter) triton cannot serve:
    integrations must not take a layer over for it, and graft info says so."""
    from graft import selection

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(4, 64), torch.randn(64)
    bucket = tuning.bucket("fused.rms_norm", (x, w, 1e-6, None), {})
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path / "t.json", [
        {"op": "fused.rms_norm", "dtype": "float32", "bucket": bucket, "backend": "triton", "provider": "triton",
         "ratio": 2.0}]))
    graft.reload_config()
    from graft.platform import triton_interpret

    if triton_interpret():
        pytest.skip("TRITON_INTERPRET is read at import here")
    assert selection.entry_reason("fused.rms_norm", "triton", "float32", "cpu")
    assert selection.graft_wanted("fused.rms_norm") is None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "graft", "info", "--op", "fused.rms_norm"], capture_output=True,
                          text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "names triton, which cannot serve here" in proc.stdout, proc.stdout


def test_strict_checks_the_output_device(fresh_graft, monkeypatch):
    from graft.errors import GraftError
    from graft.registry import Implementation

    spec = graft.get_registry().op("fused.rms_norm")
    x, w = torch.randn(4, 64), torch.randn(64)
    good = spec.reference(x, w, 1e-6, None)
    impl = Implementation("fused.rms_norm", "triton", fn=lambda *a: None, provider="test")
    dispatch.verify_output(spec, impl, good, (x, w, 1e-6, None), {})
    with pytest.raises(GraftError, match="on meta"):
        dispatch.verify_output(spec, impl, torch.empty_like(good, device="meta"), (x, w, 1e-6, None), {})


@pytest.mark.parametrize("content, field", [
    (b'{"format": "graft-tuning/1", "entries": {"op": 1}}', "'entries' must be a list"),
    (b'{"format": "graft-tuning/1", "entries": [7]}', "entry 0 must be an object"),
    (b'{"format": "graft-tuning/1", "entries": [{"op": "fused.rms_norm", "dtype": "float32", "bucket": "b"}]}',
     "lacks backend"),
    (b'{"format": "graft-tuning/1", "entries": [{"op": "fused.rms_norm", "dtype": "float32", "bucket": "b", '
     b'"backend": "torch", "median_us": {"torch": "fast"}}]}', "field 'median_us' must be an object of numbers"),
    (b'{"format": "graft-tuning/1", "device": ["cpu"], "entries": []}', "'device' must be an object"),
    (b'{"format": "graft-tuning/1", "versions": {"torch": 2}, "entries": []}', "'versions' must be"),
    (b'{"format": "graft-tuning/1", "entries": [{"op": "fused.rms_norm", "dtype": "float32", "bucket": "b", '
     b'"backend": "torch", "ratio": "1.3"}]}', "field 'ratio' must be a number"),
    (b'\xff\xfe{"format"', "is not UTF-8"),
    (b'[' * 100000, "nested too deeply"),
])
def test_a_bad_table_is_a_clear_error_naming_file_and_field(tmp_path, content, field):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(graft.GraftConfigError, match="bad.json") as err:
        tuning.load(str(path))
    assert field in str(err.value), str(err.value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env["GRAFT_TUNING_TABLE"] = str(path)
    proc = subprocess.run([sys.executable, "-m", "graft", "info"], capture_output=True, text=True, env=env, timeout=180)
    assert "Traceback" not in proc.stderr and field in proc.stdout + proc.stderr, proc.stderr[-2000:]
