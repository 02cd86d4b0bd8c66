"""Selection decides in one module (graft.selection): nothing else reads the priority
settings or a tuning table's choices, and what `graft.explain` / `graft info --shape` says a
call gets is what dispatch then runs, for every op."""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import graft
from graft import dispatch, selection, tuning
from graft.selection import Origin

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graft"

# What only selection may call: the parsed priorities (any object's) and the tuning tables'
# choices (graft.tuning's functions).
DECIDING = {"priority_for", "load_settings", "global_priority", "overrides"}
TABLE_CHOICES = {"choices", "lookup", "first_entry"}
# Where they are defined (config: the settings; tuning: the tables) and where they are used.
ALLOWED = {"graft/selection.py", "graft/config.py", "graft/tuning.py"}


def deciding_reads(source: str) -> list:
    """(line, name) of every call or attribute read of a deciding name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr in DECIDING or (
                node.attr in TABLE_CHOICES and isinstance(node.value, ast.Name) and node.value.id == "tuning")):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DECIDING:
            found.append((node.lineno, node.func.id))
        elif isinstance(node, ast.ImportFrom) and node.module in ("graft.tuning", "graft.config"):
            found += [(node.lineno, a.name) for a in node.names if a.name in DECIDING | TABLE_CHOICES]
    return found


def test_no_other_module_reads_priorities_or_table_choices():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        offenders += [f"{rel}:{line}: {name}" for line, name in deciding_reads(path.read_text())]
    assert not offenders, "selection is decided outside graft/selection.py:\n" + "\n".join(offenders)


def test_the_walk_catches_a_planted_read():
    planted = ("from graft import config, tuning\n"
               "def f(s, op):\n    return s.priority_for(op, 'fused'), tuning.choices(op, 'cpu', None)\n"
               "from graft.tuning import lookup\n")
    assert sorted(name for _, name in deciding_reads(planted)) == ["choices", "lookup", "priority_for"]


def test_the_removed_rooms_are_gone():
    assert not (PACKAGE / "priorities.py").exists()
    assert "_left_to_vllm" not in (PACKAGE / "adapters" / "vllm" / "plugin.py").read_text()
    assert "def explicitly_requested" not in (PACKAGE / "kernels" / "collectives" / "_common.py").read_text()
    assert "def graft_wanted" not in (PACKAGE / "tuning.py").read_text()


# --------------------------------------------------------------------------- every op


def _first_cases():
    from graft.plugins import get_host
    from graft.tools.conformance.cases import all_cases

    host = get_host()
    registry = host.registry
    firsts = {}
    for case in all_cases(host, registry):
        if registry.op(case.op).family == "collectives":
            continue  # a process group: tests/test_selection_collectives.py checks them on one gloo rank
        dtype = torch.float32 if torch.float32 in case.dtypes else case.dtypes[0] if case.dtypes else None
        if case.op not in firsts or (dtype == torch.float32 and firsts[case.op][1] != torch.float32):
            firsts[case.op] = (case, dtype)
    return registry, firsts


def _inputs(first):
    case, dtype = first
    return case.inputs("cpu", dtype)


def _same(a, b) -> bool:
    return (a.backend, a.provider) == (b.backend, b.provider)


def test_every_op_has_a_case_to_explain():
    registry, firsts = _first_cases()
    missing = sorted(op for op, spec in registry.ops.items() if spec.family != "collectives" and op not in firsts)
    assert not missing, f"ops without a conformance case: {missing}"


def test_explain_matches_what_dispatch_runs_for_every_op(fresh_graft):
    registry, firsts = _first_cases()
    for op, first in sorted(firsts.items()):
        args, kwargs = _inputs(first)
        decision = graft.explain(op, *args, **kwargs)
        _, impl = dispatch.run(op, *args, **kwargs)
        assert decision.selected is not None and _same(decision.selected, impl), (op, decision.why, impl)
        assert decision.origin in (Origin.SHIPPED_DEFAULT, Origin.PLUGIN_DEFAULT, Origin.FRAMEWORK_FIRST), op
        assert decision.bucket == tuning.bucket(op, args, kwargs)


def _key(op, args, kwargs):
    from graft.plugins import get_registry
    from graft.registry import key_tensor

    return key_tensor(get_registry().op(op), args, kwargs)


def _table(path, entries):
    path.write_text(json.dumps({"format": tuning.FORMAT, "device": tuning.device_key("cpu"),
                                "versions": tuning.versions(), "entries": entries}))
    return str(path)


def test_a_table_entry_is_explained_and_run_for_every_op(fresh_graft, tmp_path, monkeypatch):
    """For each op with two usable implementations: a table naming the one the default does
    not pick; explain names the table entry and dispatch runs that implementation."""
    registry, firsts = _first_cases()
    entries, expected = [], {}
    for op, first in sorted(firsts.items()):
        args, kwargs = _inputs(first)
        dtype = _key(op, args, kwargs).dtype
        st = selection.static(registry, op, "cpu", dtype, "cpu")
        usable = st.usable()
        if len(usable) < 2:
            continue
        other = usable[-1]
        entries.append({"op": op, "dtype": str(dtype).replace("torch.", ""), "bucket": tuning.bucket(op, args, kwargs),
                        "backend": other.backend, "provider": other.provider, "ratio": 1.5})
        expected[op] = other
    assert len(expected) >= 5, expected  # the torch fast paths and references at least
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path / "t.json", entries))
    graft.reload_config()
    for op, want in expected.items():
        args, kwargs = _inputs(firsts[op])
        decision = graft.explain(op, *args, **kwargs)
        _, impl = dispatch.run(op, *args, **kwargs)
        assert decision.origin is Origin.TUNING_TABLE and decision.choice is not None, (op, decision.why)
        assert _same(decision.selected, want) and _same(impl, want), (op, decision.selected, impl, want)
        assert "names " + want.backend in decision.why and "1.50x faster" in decision.why


def test_a_variable_beats_the_table_in_explain_and_dispatch(fresh_graft, tmp_path, monkeypatch):
    x, w = torch.randn(4, 64), torch.randn(64)
    bucket = tuning.bucket("fused.rms_norm", (x, w, 1e-6, None), {})
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path / "t.json", [
        {"op": "fused.rms_norm", "dtype": "float32", "bucket": bucket, "backend": "torch", "provider": "torch"}]))
    monkeypatch.setenv("GRAFT_FUSED_RMS_NORM", "torch")
    graft.reload_config()
    decision = graft.explain("fused.rms_norm", x, w, 1e-6, None)
    assert decision.origin is Origin.OP_VARIABLE and decision.choice is None
    assert _same(decision.selected, dispatch.run("fused.rms_norm", x, w, 1e-6, None)[1])
    assert decision.why.startswith("GRAFT_FUSED_RMS_NORM=torch")


@pytest.mark.parametrize("env, origin", [
    ({}, Origin.SHIPPED_DEFAULT),
    ({"GRAFT_BACKENDS": "torch"}, Origin.GLOBAL_VARIABLE),
    ({"GRAFT_FUSED": "torch"}, Origin.FAMILY_VARIABLE),
    ({"GRAFT_FUSED_RMS_NORM": "torch"}, Origin.OP_VARIABLE),
])
def test_origin_is_an_enum_naming_what_set_the_order(fresh_graft, monkeypatch, env, origin):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    graft.reload_config()
    assert graft.explain("fused.rms_norm", dtype=torch.float32).origin is origin


@pytest.mark.parametrize("op", ["attention.decode_paged", "gemm.w4a16", "fused.rms_norm", "fused.silu_and_mul",
                                "moe.topk_routing"])
def test_the_stated_default_is_the_true_default(fresh_graft, op):
    """hip, triton, torch: no per-op file reorders it (graft.priorities is gone)."""
    decision = graft.explain(op, device="cuda", arch="sm_90", dtype=torch.float16)
    order = [c.impl.backend for c in decision.candidates]
    assert order.index("hip") < order.index("triton") < order.index("torch"), order
    assert decision.origin is Origin.SHIPPED_DEFAULT and decision.source == "default"


def test_graft_info_shape_names_what_dispatch_runs(fresh_graft, tmp_path, monkeypatch):
    """The command line's answer for a shape, without and with a table entry for its bucket,
    is the implementation dispatch runs for a call of that shape in the same environment."""
    import os

    x, w = torch.randn(16, 256), torch.randn(256)
    bucket = tuning.bucket("fused.rms_norm", (x, w, 1e-6, None), {})
    table = _table(tmp_path / "t.json", [{"op": "fused.rms_norm", "dtype": "float32", "bucket": bucket,
                                          "backend": "torch", "provider": "torch", "ratio": 1.2}])
    for name in [k for k in os.environ if k.startswith("GRAFT_")]:
        monkeypatch.delenv(name)
    for extra, want_why in ((None, "default order"), (table, "tuning table")):
        if extra:
            monkeypatch.setenv("GRAFT_TUNING_TABLE", extra)
        graft.reload_config()
        impl = dispatch.run("fused.rms_norm", x, w, 1e-6, None)[1]
        assert (impl.provider == "torch") == bool(extra), impl
        proc = subprocess.run([sys.executable, "-m", "graft", "info", "--op", "fused.rms_norm", "--dtype", "float32",
                               "--shape", "16x256,256", "--json"], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        entry = json.loads(proc.stdout)
        assert entry["bucket"] == bucket
        assert (entry["selected"]["backend"], entry["selected"]["provider"]) == (impl.backend, impl.provider), entry
        assert want_why in entry["why"], entry["why"]
        text = subprocess.run([sys.executable, "-m", "graft", "info", "--op", "fused.rms_norm", "--dtype", "float32",
                               "--shape", "x=16x256,weight=256"], capture_output=True, text=True, timeout=180)
        assert f"served by: {impl.backend} ({impl.provider})" in text.stdout and "why: " in text.stdout, text.stdout


@pytest.mark.parametrize("shape, message", [
    ("16x2x", "give dimensions joined by x"),
    ("16x256,256,7,9,9,9", "tensor argument(s)"),
    ("nope=4", "has no positional argument 'nope'"),
])
def test_graft_info_shape_rejects_bad_shapes_naming_them(shape, message):
    proc = subprocess.run([sys.executable, "-m", "graft", "info", "--op", "fused.rms_norm", "--shape", shape],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr)
