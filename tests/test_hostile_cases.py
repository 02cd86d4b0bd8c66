"""Hostile inputs, each group in a child process with a bounded timeout: a clear error
naming the bad value, or the reference's result; never a crash, a hang or a traceback.

The cases that need a fresh process run from tests/_hostile_cases.py (one process per
group: values, numerics, settings, threads, layouts, reloads, gradients, fallback, leaks,
configuration, the user's view). Plugins are installed as real entry points (a ``*.dist-info`` on PYTHONPATH) and
driven through dispatch, ``graft info`` and ``graft conformance``; the CLI reproducers run
``python -m graft``. Collectives reproducers run on 2 gloo ranks in tests/test_collectives.py
and the collectives cases of tests/test_fuzz.py; bad values with the checks off on every
backend in tests/test_kernel_safety.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _hostile_cases import GROUPS  # noqa: E402

TIMEOUT_S = 300


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env.update(TRITON_INTERPRET="1", PYTHONFAULTHANDLER="1")
    env.update(extra or {})
    return env


# (group, extra environment): the layout group runs once per dispatch entry too
# (GRAFT_DISPATCH_C is read when graft is imported).
RUNS = [(g, {}) for g in sorted(GROUPS)] + [("layouts", {"GRAFT_DISPATCH_C": "0"})]


@pytest.mark.parametrize("group,extra", RUNS, ids=[f"{g}{'-python_entry' if e else ''}" for g, e in RUNS])
def test_hostile_case_group(group, extra):
    groups = GROUPS
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "_hostile_cases.py"), group],
                          capture_output=True, text=True, env=_env(extra), timeout=TIMEOUT_S)
    found, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("START "):
            current = line[6:]
        elif line.startswith("PASS "):
            found[line[5:]], current = "PASS", None
        elif line.startswith("FAIL "):
            found[line[5:]] = proc.stdout.split(line, 1)[1].split(f"END {line[5:]}", 1)[0]
            current = None
    if current is not None:
        found[current] = f"the process died in this case (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    bad = {c: found.get(c, f"not reached (exit {proc.returncode}): {proc.stderr[-1500:]}")
           for c in groups[group] if found.get(c) != "PASS"}
    assert not bad, "\n".join(f"--- {c}: {why}" for c, why in bad.items())


# ------------------------------------------------------------------------------ plugins (2)

PLUGINS = {
    # registers an impl, then its hook raises: nothing it registered may stay
    "repro_sneaky": '''
@hookimpl
def graft_register_kernels(registry):
    registry.add_impl(Implementation(op="fused.silu_and_mul", backend="sneaky", fn=lambda x: x * 0))
    raise RuntimeError("sneaky hook failed half-way")
''',
    # claims graft's own backend names
    "repro_impostor": '''
@hookimpl
def graft_register_kernels(registry):
    registry.add_impl(Implementation(op="fused.silu_and_mul", backend="torch", fn=lambda x: x * 0))
    registry.add_impl(Implementation(op="fused.silu_and_mul", backend="triton", fn=lambda x: x * 0))
''',
    # wrong output shape and dtype
    "repro_wrong": '''
@hookimpl
def graft_register_kernels(registry):
    registry.add_impl(Implementation(op="fused.silu_and_mul", backend="wrongvendor",
                                     fn=lambda x: x.double()))
''',
    # check() / available() raise
    "repro_buggy": '''
def _boom(*args, **kwargs):
    raise ZeroDivisionError("buggy plugin")

@hookimpl
def graft_register_kernels(registry):
    registry.add_impl(Implementation(op="fused.rms_norm", backend="buggycheck", fn=lambda *a, **k: None,
                                     check=_boom))
    registry.add_impl(Implementation(op="fused.rms_norm", backend="buggyavail", fn=lambda *a, **k: None,
                                     available=_boom))
''',
}

PROBE = r"""
import json, torch, graft
from graft.errors import GraftError
from graft.plugins import get_host
from graft.ops import fused
host = get_host()
impls = host.registry.impls["fused.silu_and_mul"] + host.registry.impls["fused.rms_norm"]
x = torch.randn(4, 16)
result = {"records": {n: [r.status, r.error] for n, r in host.records.items() if n.startswith("repro_")},
          "providers": sorted({(i.backend, i.provider) for i in impls if i.provider.startswith("repro_")})}
# GRAFT_DISABLE=all: the reference really is graft's reference
with graft.override_config(GRAFT_DISABLE="all"):
    result["disable_all_ok"] = torch.equal(fused.silu_and_mul(x), fused.silu_and_mul_reference(x))
with graft.override_config(GRAFT_FUSED_SILU_AND_MUL="wrongvendor", GRAFT_STRICT="1"):
    try:
        fused.silu_and_mul(x)
        result["strict_wrong"] = "no error"
    except GraftError as exc:
        result["strict_wrong"] = str(exc)
w = torch.ones(16)
for backend in ("buggycheck", "buggyavail"):
    with graft.override_config(GRAFT_FUSED_RMS_NORM=backend + ",torch"):
        out, impl = graft.dispatch.run("fused.rms_norm", x, w, 1e-6)
        result[backend] = [impl.backend, torch.equal(out, fused.rms_norm_reference(x, w, 1e-6))]
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The four hostile plugins, installed as entry points (a dist-info on PYTHONPATH)."""
    site = tmp_path_factory.mktemp("repro_site")
    for name, body in PLUGINS.items():
        (site / f"{name}.py").write_text("from graft.hookspecs import hookimpl\n"
                                         "from graft.registry import Implementation\n" + body)
    info = site / "repro_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repro-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[graft.adapters]\n" + "".join(f"{n} = {n}\n" for n in PLUGINS))
    return site


def _run(args, site=None, timeout=TIMEOUT_S):
    extra = {"PYTHONPATH": str(site)} if site else {}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(extra), timeout=timeout)


def test_hostile_plugins_cannot_subvert_dispatch(plugin_site):
    proc = _run(["-c", PROBE], plugin_site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    records = result["records"]
    assert records["repro_sneaky"][0] == "failed" and "half-way" in records["repro_sneaky"][1], records
    assert records["repro_impostor"][0] == "failed" and "may not register backend" in records["repro_impostor"][1]
    providers = {tuple(p) for p in result["providers"]}
    assert ("sneaky", "repro_sneaky") not in providers and not any(p == "repro_impostor" for _, p in providers)
    assert result["disable_all_ok"]
    assert "wrongvendor" in result["strict_wrong"] and "float64" in result["strict_wrong"], result["strict_wrong"]
    assert result["buggycheck"] == ["torch", True] and result["buggyavail"] == ["torch", True], result


def test_graft_info_and_conformance_survive_raising_plugins(plugin_site):
    info = _run(["-m", "graft", "info", "--op", "fused.rms_norm"], plugin_site)
    assert info.returncode == 0 and "Traceback" not in info.stderr, info.stderr[-3000:]
    assert "buggyavail" in info.stdout and "ZeroDivisionError" in info.stdout, info.stdout[-3000:]
    assert "repro_sneaky" in info.stdout and "half-way" in info.stdout, info.stdout[-3000:]
    conf = _run(["-m", "graft", "conformance", "--op", "fused.rms_norm", "--impl", "buggycheck", "--impl",
                 "buggyavail", "--no-timing", "--json-only", "--out", str(plugin_site / "report")], plugin_site)
    assert "Traceback" not in conf.stderr, conf.stderr[-3000:]
    assert conf.returncode in (0, 1), (conf.returncode, conf.stderr[-3000:])
    text = (plugin_site / "report" / "report.json").read_text()
    assert "buggyavail" in text and "ZeroDivisionError" in text, text[:3000]


# ------------------------------------------------------------------------------ CLI (7)


def test_cli_usage_errors_exit_2_before_running(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    cases = [
        (["conformance", "--out", str(a_file)], "exists and is not a directory"),
        (["conformance", "--impl", "torch", "--out", str(tmp_path / "r1")], "torch is the reference"),
        (["conformance", "--tags", "gpu", "--out", str(tmp_path / "r2")], "--allow-slow"),
        (["info", "--device", "tpu"], "tpu"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((["conformance", "--out", str(readonly / "sub")], "cannot be written"))
    procs = [(args, needle, subprocess.Popen([sys.executable, "-m", "graft", *args], stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=_env()))
             for args, needle in cases]
    for args, needle, proc in procs:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 2, (args, proc.returncode, err[-2000:])
        assert needle in err and "Traceback" not in err, (args, err[-2000:])
    for out in ("r1", "r2"):  # refused before running: no report (--out is made only to check it)
        assert not (tmp_path / out).exists() or not any((tmp_path / out).iterdir()), out
