"""A plugin cannot subvert selection: a failing hook registers nothing, graft's own backend
names are reserved, a raising check()/available() is a reason (the next candidate serves),
a wrong output shape is caught under GRAFT_STRICT=1, and GRAFT_DISABLE_PLUGINS is validated."""
import dataclasses

import pytest
import torch

import graft
from graft import plugins
from graft.errors import GraftConfigError, GraftError
from graft.hookspecs import hookimpl
from graft.registry import Implementation

from _toy_ops import TOY_OP, ReferenceOnly, ToyAdapter

OP = TOY_OP.name


def _host(*extra):
    host = plugins.PluginHost(load_entry_points=False)
    host.register(ToyAdapter(), "toy")
    host.register(ReferenceOnly(), "toyref")
    for name, plugin in extra:
        host.register(plugin, name)
    return host


@pytest.fixture
def install(fresh_graft, monkeypatch):
    """Make a host graft's global one (dispatch and info use it)."""

    def _install(host):
        monkeypatch.setattr(plugins, "_host", host)
        graft.reload_config()
        return host

    yield _install
    plugins.reset()


class _RaisesAfterRegistering:
    @hookimpl
    def graft_register_kernels(self, registry):
        registry.add_impl(Implementation(op=OP, backend="sneaky", fn=lambda x, factor: x * 0))
        raise RuntimeError("half-way")


def test_hook_that_raises_registers_nothing(install):
    host = install(_host(("sneaky", _RaisesAfterRegistering())))
    assert "sneaky" not in {i.backend for i in host.registry.impls[OP]}
    assert host.records["sneaky"].status == "failed" and "half-way" in host.records["sneaky"].error
    assert torch.equal(graft.call(OP, torch.ones(4), 2.0), torch.full((4,), 2.0))


class _Impostor:
    def __init__(self, backend, fn=None):
        self.backend, self.fn = backend, fn

    @hookimpl
    def graft_register_kernels(self, registry):
        registry.add_impl(Implementation(op=OP, backend=self.backend, fn=self.fn or (lambda x, factor: x * 0)))


@pytest.mark.parametrize("backend", ["triton", "hip", "torch"])
def test_graft_backend_names_are_reserved(install, backend, monkeypatch):
    host = install(_host(("impostor", _Impostor(backend))))
    impls = host.registry.impls[OP]
    assert not any(i.provider == "impostor" for i in impls)
    record = host.records["impostor"]
    assert record.status == "failed" and f"may not register backend '{backend}'" in record.error
    monkeypatch.setenv("GRAFT_DISABLE", "all")  # the reference really is the reference
    assert torch.equal(graft.call(OP, torch.ones(4), 3.0), torch.full((4,), 3.0))


def test_a_plugin_may_register_an_ops_own_reference_as_torch(install):
    host = install(_host())
    torch_impls = [i for i in host.registry.impls[OP] if i.backend == "torch"]
    assert len(torch_impls) == 1 and torch_impls[0].fn is TOY_OP.reference


class _RaisingChecks:
    def __init__(self, where):
        self.where = where

    @hookimpl
    def graft_register_kernels(self, registry):
        def boom(*args, **kwargs):
            raise ZeroDivisionError("plugin bug")

        impl = Implementation(op=OP, backend="buggy", fn=lambda x, factor: x * 0, priority=100)
        impl = dataclasses.replace(impl, **{self.where: boom})
        registry.add_impl(impl)


@pytest.mark.parametrize("where", ["check", "available"])
def test_raising_check_or_available_is_a_reason_and_the_next_candidate_serves(install, where, monkeypatch):
    install(_host(("buggy", _RaisingChecks(where))))
    monkeypatch.setenv("GRAFT_BACKENDS", "buggy,fast,torch")
    out, impl = graft.dispatch.run(OP, torch.ones(4), 2.0)
    assert impl.backend == "fast" and torch.equal(out, torch.full((4,), 2.0))
    decision = graft.explain(OP, device="cpu", dtype=torch.float32)
    buggy = [c for c in decision.candidates if c.impl.backend == "buggy"]
    if where == "available":  # static: explain() sees it without arguments
        assert buggy and f"buggy's {where}() raised ZeroDivisionError: plugin bug" in buggy[0].reason
    from graft.tools.info import collect

    collect()  # graft info must not crash


class _WrongShape:
    @hookimpl
    def graft_register_kernels(self, registry):
        registry.add_impl(Implementation(op=OP, backend="wrong", fn=lambda x, factor: (x * factor)[:-1]))


def test_strict_mode_verifies_output_shape_and_dtype(install, monkeypatch):
    install(_host(("wrong", _WrongShape())))
    monkeypatch.setenv("GRAFT_BACKENDS", "wrong,torch")
    assert graft.call(OP, torch.ones(4), 2.0).shape == (3,)  # unchecked without strict (no cost per call)
    monkeypatch.setenv("GRAFT_STRICT", "1")
    with pytest.raises(GraftError, match=r"wrong \(wrong\) returned tensor\(3,\) float32.*gives tensor\(4,\) float32"):
        graft.call(OP, torch.ones(4), 2.0)


def test_disable_plugins_rejects_unknown_and_essential_names(fresh_graft, monkeypatch):
    monkeypatch.setenv("GRAFT_DISABLE_PLUGINS", "tritn")
    with pytest.raises(GraftConfigError, match=r"unknown plugin\(s\) 'tritn'.*installed adapter plugins are:.*triton"):
        plugins.PluginHost()
    monkeypatch.setenv("GRAFT_DISABLE_PLUGINS", "torch")
    with pytest.raises(GraftConfigError, match="cannot be disabled.*GRAFT_DISABLE=all"):
        plugins.PluginHost()
    monkeypatch.setenv("GRAFT_DISABLE_PLUGINS", "triton,hip")
    host = plugins.PluginHost()
    assert host.records["triton"].status == "disabled"
    assert "gemm.linear" in host.registry.ops
