"""Hostile plugins: every hook answering each wrong type, a third party's entry point named
after one of graft's own adapters, a priority hook that raises or answers garbage, a plugin
whose import calls sys.exit(). Ops still run, `graft info --json` exits 0 and says why."""
import json
import sys
import types
from importlib import metadata

import pytest
import torch

import graft
from graft import hookspecs, plugins
from graft.hookspecs import hookimpl
from graft.tools import cli

from _toy_ops import TOY_OP, ReferenceOnly, ToyAdapter

OP = TOY_OP.name
LIST_HOOKS = [h for h, shape in plugins.HOOK_RESULTS.items() if isinstance(shape, tuple)]


class _RaisesOnIteration:
    def __iter__(self):
        raise RuntimeError("iteration bug")


WRONG = {"none": None, "wrong-items": [1, None, object()], "non-iterable": 42,
         "raises-on-iteration": _RaisesOnIteration(), "a-string": "oops"}


def _plugin(hook_name, value):
    plugin = types.SimpleNamespace()
    args = list(getattr(hookspecs, hook_name).__code__.co_varnames[:getattr(hookspecs, hook_name).__code__.co_argcount])
    ns = {}
    exec(f"def {hook_name}({', '.join(args)}):\n    return VALUE", {"VALUE": value}, ns)
    setattr(plugin, hook_name, hookimpl(ns[hook_name]))
    return plugin


@pytest.fixture
def install(fresh_graft, monkeypatch):
    def _install(host):
        monkeypatch.setattr(plugins, "_host", host)
        graft.reload_config()
        return host

    yield _install
    plugins.reset()


def _host(*extra):
    host = plugins.PluginHost(load_entry_points=False)
    host.register(ToyAdapter(), "toy")
    host.register(ReferenceOnly(), "toyref")
    for name, plugin in extra:
        host.register(plugin, name)
    return host


def _info_json(capsys):
    capsys.readouterr()
    assert cli.main(["info", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_hook_is_declared():
    declared = {n for n in dir(hookspecs) if n.startswith("graft_")}
    assert declared == set(plugins.HOOK_RESULTS)


@pytest.mark.parametrize("kind", sorted(WRONG))
@pytest.mark.parametrize("hook_name", LIST_HOOKS)
def test_every_list_hook_answering_a_wrong_type(install, hook_name, kind, capsys):
    host = install(_host(("hostile", _plugin(hook_name, WRONG[kind]))))
    assert torch.equal(graft.call(OP, torch.ones(4), 2.0), torch.full((4,), 2.0))
    for _, items in host.call_each(hook_name, registry=host.registry):
        assert isinstance(items, list)
    info = _info_json(capsys)
    if kind != "none":  # None is "nothing to add"
        assert any(e.startswith(f"hostile.{hook_name}") for e in info["hook_errors"]), info["hook_errors"]


@pytest.mark.parametrize("value", [42, [1, 2], "x", _RaisesOnIteration()])
def test_adapter_info_wrong_type(install, value, capsys):
    install(_host(("hostile", _plugin("graft_adapter_info", value))))
    info = _info_json(capsys)
    assert any(e.startswith("hostile.graft_adapter_info") for e in info["hook_errors"])


class _Priority:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl(tryfirst=True)
    def graft_default_backend_priority(self, device):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer", [RuntimeError("prio bug"), SystemExit(2), [1, None], "fast", 7,
                                    ["nosuch", "alsonot"]])
def test_priority_hook_hostile_answers_are_ignored(install, answer, capsys):
    install(_host(("hostile", _Priority(answer))))
    assert torch.equal(graft.call(OP, torch.ones(4), 2.0), torch.full((4,), 2.0))
    info = _info_json(capsys)
    assert any(e.startswith("hostile.graft_default_backend_priority") for e in info["hook_errors"])


def test_priority_hook_unknown_names_dropped_known_kept(install):
    host = install(_host(("hostile", _Priority(["nosuch", "Vendor"]))))
    host.registry
    assert host.default_priority(None) == ("vendor",)


# --- entry points -----------------------------------------------------------------------------

class _Dist:
    def __init__(self, name):
        self.name, self.version = name, "6.6.6"


def _fake_entry_points(monkeypatch, extra):
    real = list(metadata.entry_points(group=plugins.ENTRY_POINT_GROUP))
    fakes = []
    for name, value, dist in extra:
        ep = metadata.EntryPoint(name, value, plugins.ENTRY_POINT_GROUP)
        ep = ep._for(_Dist(dist)) if hasattr(ep, "_for") else ep
        fakes.append(ep)
    original = metadata.entry_points

    def entry_points(**kwargs):
        if kwargs == {"group": plugins.ENTRY_POINT_GROUP}:
            return fakes + real
        return original(**kwargs)

    monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)


@pytest.fixture
def hostile_module(monkeypatch):
    module = types.ModuleType("hostile_graft_plugin")
    module.graft_register_ops = hookimpl(lambda registry: None)
    monkeypatch.setitem(sys.modules, "hostile_graft_plugin", module)
    return module


@pytest.mark.parametrize("name", sorted(plugins.RESERVED_PLUGIN_NAMES))
def test_a_third_party_cannot_take_a_builtin_name(fresh_graft, monkeypatch, hostile_module, name, capsys):
    _fake_entry_points(monkeypatch, [(name, "hostile_graft_plugin", "evil-dist")])
    plugins.reset()
    host = plugins.get_host()
    assert host.records[name].builtin and host.records[name].status == "loaded"
    refused = host.records[f"evil-dist:{name}"]
    assert refused.status == "failed" and "reserved" in refused.error and "evil-dist" in refused.error
    if name == "triton":
        assert any(i.backend == "triton" for impls in host.registry.impls.values() for i in impls)
    info = _info_json(capsys)
    assert any(p["name"] == f"evil-dist:{name}" and p["status"] == "failed" for p in info["plugins"])
    plugins.reset()


def test_a_plugin_whose_import_calls_sys_exit_is_a_failed_plugin(fresh_graft, monkeypatch, tmp_path, capsys):
    (tmp_path / "exiting_graft_plugin.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, [("exiting", "exiting_graft_plugin", "exit-dist")])
    plugins.reset()
    host = plugins.get_host()
    assert host.records["exiting"].status == "failed" and "sys.exit(3)" in host.records["exiting"].error
    assert graft.get_registry().ops
    info = _info_json(capsys)
    assert any(p["name"] == "exiting" and p["status"] == "failed" for p in info["plugins"])
    plugins.reset()


def test_a_plugin_raising_keyboardinterrupt_at_import_is_a_failed_plugin(fresh_graft, monkeypatch, tmp_path):
    (tmp_path / "kbi_graft_plugin.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, [("kbi", "kbi_graft_plugin", "kbi-dist")])
    plugins.reset()
    host = plugins.get_host()
    assert host.records["kbi"].status == "failed" and "KeyboardInterrupt" in host.records["kbi"].error
    plugins.reset()


def test_a_real_ctrl_c_during_a_plugins_import_still_interrupts(fresh_graft, monkeypatch, tmp_path):
    (tmp_path / "sigint_graft_plugin.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, [("sigint", "sigint_graft_plugin", "sigint-dist")])
    plugins.reset()
    with pytest.raises(KeyboardInterrupt):
        plugins.PluginHost()
    plugins.reset()
