"""The plugin host: entry-point discovery of a separately pip-installed adapter, isolation
of broken plugins, GRAFT_DISABLE_PLUGINS, provider stamping."""
import json
import os
import subprocess
import sys

import pytest

from graft.plugins import PluginHost

from _toy_ops import ReferenceOnly, ToyAdapter

DUMMY_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "graft-dummy-adapter"
version = "1.2.3"

[project.entry-points."graft.adapters"]
dummy = "graft_dummy_adapter"
broken = "graft_dummy_broken"

[tool.setuptools]
py-modules = ["graft_dummy_adapter", "graft_dummy_broken"]
"""

DUMMY_MODULE = '''
import torch
from graft.hookspecs import hookimpl
from graft.registry import Implementation, OpSpec

CALLS = []

def _double_ref(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@hookimpl
def graft_adapter_info():
    return {"description": "dummy vendor adapter"}

@hookimpl
def graft_register_ops(registry):
    registry.add_op(OpSpec(name="fused.dummy_double", family="fused",
                           signature="(Tensor x) -> Tensor", reference=_double_ref))

@hookimpl
def graft_register_kernels(registry):
    def dummy_double(x):
        CALLS.append(tuple(x.shape))
        return x + x
    registry.add_impl(Implementation(op="fused.dummy_double", backend="dummyvendor", fn=dummy_double))
'''

PROBE = """
import json, torch, graft
from graft.plugins import get_host
host = get_host()
out = graft.call("fused.dummy_double", torch.arange(3.0))
import graft_dummy_adapter
print(json.dumps({
    "records": {n: r.as_dict() for n, r in host.records.items()},
    "out": out.tolist(),
    "calls": graft_dummy_adapter.CALLS,
    "selected": graft.select("fused.dummy_double", torch.ones(1)).backend,
}))
"""


@pytest.fixture(scope="module")
def dummy_site(tmp_path_factory):
    """pip-install a dummy adapter distribution into its own target directory."""
    src = tmp_path_factory.mktemp("dummy_src")
    (src / "pyproject.toml").write_text(DUMMY_PYPROJECT)
    (src / "graft_dummy_adapter.py").write_text(DUMMY_MODULE)
    (src / "graft_dummy_broken.py").write_text("raise ImportError('vendor runtime libfoo.so not found')\n")
    target = tmp_path_factory.mktemp("dummy_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        check=True,
        timeout=240,
    )
    return target


def _run_probe(site, extra_env=None, code=PROBE):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env["PYTHONPATH"] = str(site)
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_pip_installed_adapter_is_discovered_and_active_without_import(dummy_site):
    proc = _run_probe(dummy_site)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    dummy = result["records"]["dummy"]
    assert dummy["status"] == "loaded"
    assert dummy["distribution"] == "graft-dummy-adapter" and dummy["version"] == "1.2.3"
    assert dummy["info"]["description"] == "dummy vendor adapter"
    # its backend outranks the torch reference with no configuration at all
    assert result["selected"] == "dummyvendor"
    assert result["out"] == [0.0, 2.0, 4.0] and result["calls"] == [[3]]
    # graft's own adapters come through the same entry-point group
    assert {"torch", "triton", "hip"} <= set(result["records"])


def test_broken_plugin_is_reported_not_fatal(dummy_site):
    proc = _run_probe(dummy_site)
    broken = json.loads(proc.stdout.strip().splitlines()[-1])["records"]["broken"]
    assert broken["status"] == "failed"
    assert "libfoo.so not found" in broken["error"]
    assert "failed to load" in proc.stderr


def test_disable_plugins_variable(dummy_site):
    code = PROBE.replace('graft_dummy_adapter.CALLS', '[]').replace(
        'out = graft.call("fused.dummy_double", torch.arange(3.0))', 'out = torch.zeros(0)').replace(
        '"selected": graft.select("fused.dummy_double", torch.ones(1)).backend,', '')
    proc = _run_probe(dummy_site, {"GRAFT_DISABLE_PLUGINS": "dummy,broken"}, code)
    records = json.loads(proc.stdout.strip().splitlines()[-1])["records"]
    assert records["dummy"]["status"] == "disabled" and records["broken"]["status"] == "disabled"
    assert "fused.dummy_double" not in _registry_ops(dummy_site, {"GRAFT_DISABLE_PLUGINS": "dummy"})


def _registry_ops(site, env):
    code = "import json; from graft.plugins import get_registry; print(json.dumps(sorted(get_registry().ops)))"
    return json.loads(_run_probe(site, env, code).stdout.strip().splitlines()[-1])


def test_graft_info_lists_the_plugin(dummy_site):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env["PYTHONPATH"] = str(dummy_site)
    proc = subprocess.run([sys.executable, "-m", "graft", "info", "--json", "--op", "fused.dummy_double"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    (op,) = report["ops"]
    assert op["selected"]["backend"] == "dummyvendor" and op["selected"]["provider"] == "dummy"


def test_hook_failure_is_isolated(fresh_graft):
    class Exploding:
        from graft.hookspecs import hookimpl

        @hookimpl
        def graft_register_kernels(self, registry):
            raise RuntimeError("kaboom")

    host = PluginHost(load_entry_points=False)
    host.register(ToyAdapter(), "toy")
    host.register(ReferenceOnly(), "toyref")
    host.register(Exploding(), "exploding")
    registry = host.registry
    assert {i.backend for i in registry.implementations("fused.toy_scale")} == {"fast", "vendor", "torch"}
    assert any("exploding.graft_register_kernels failed: RuntimeError: kaboom" in e for e in host.hook_errors)
    assert "kaboom" in host.records["exploding"].error


def test_provider_is_stamped_with_plugin_name(fresh_graft):
    host = PluginHost(load_entry_points=False)
    host.register(ToyAdapter(), "toy")
    host.register(ReferenceOnly(), "toyref")
    providers = {i.backend: i.provider for i in host.registry.implementations("fused.toy_scale")}
    assert providers == {"fast": "toy", "vendor": "toy", "torch": "toyref"}


def test_duplicate_implementation_is_rejected(fresh_graft):
    host = PluginHost(load_entry_points=False)
    host.register(ToyAdapter(), "toy")
    host.register(ToyAdapter(define_op=False), "toy2")  # same backend names, different plugin: allowed
    impls = host.registry.implementations("fused.toy_scale")
    assert sorted((i.backend, i.provider) for i in impls) == [("fast", "toy"), ("fast", "toy2"),
                                                                ("vendor", "toy"), ("vendor", "toy2")]
    # the same plugin registering the same backend twice is an error, reported and isolated
    host.register(ToyAdapter(define_op=False), "toy3")
    twice = ToyAdapter(define_op=False)
    registry = host.registry
    twice.graft_register_kernels(registry)  # called directly, not via the host: provider stays ""
    with pytest.raises(Exception, match="registered twice"):
        twice.graft_register_kernels(registry)
