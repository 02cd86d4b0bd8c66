"""Backend selection by environment variables, fallback logging, strict mode."""
import logging

import pytest
import torch

from graft.errors import GraftConfigError, GraftUnsupportedError
from graft.hookspecs import hookimpl
from graft.plugins import PluginHost
from graft.selection import decide, reset_caches

from _toy_ops import ReferenceOnly, ToyAdapter

OP = "fused.toy_scale"


@pytest.fixture
def host(fresh_graft):
    reset_caches()
    h = PluginHost(load_entry_points=False)
    h.toy = ToyAdapter()
    h.register(h.toy, "toy")
    h.register(ReferenceOnly(), "toyref")
    yield h
    reset_caches()


def pick(host, x=None, device_type="cpu", dtype=torch.float32):
    x = torch.ones(4) if x is None else x
    return decide(host.registry, OP, device_type, dtype, "cpu", (x, 2.0), {}).selected.backend


def test_default_order_prefers_listed_then_registered_then_torch(host):
    # default priority hip,triton,torch: neither exists, so registered backends in name order, torch last.
    assert pick(host) == "fast"
    order = [c.impl.backend for c in decide(host.registry, OP, "cpu", torch.float32, "cpu").candidates]
    assert order == ["fast", "vendor", "torch"]


def test_global_priority_reorders(host, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "vendor,fast")
    assert pick(host) == "vendor"
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    assert pick(host) == "torch"


def test_family_and_op_overrides_take_precedence(host, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "fast")
    monkeypatch.setenv("GRAFT_FUSED", "vendor")
    assert pick(host) == "vendor"
    monkeypatch.setenv("GRAFT_FUSED_TOY_SCALE", "torch")
    assert pick(host) == "torch"


def test_invalid_backend_names_error_lists_valid_ones(host, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "fast,cuda-magic")
    with pytest.raises(GraftConfigError) as err:
        pick(host)
    message = str(err.value)
    assert "GRAFT_BACKENDS" in message and "'cuda-magic'" in message
    assert "fast, torch, vendor" in message


@pytest.mark.parametrize("var", ["GRAFT_FUSED", "GRAFT_FUSED_TOY_SCALE"])
def test_invalid_override_names_the_variable(host, monkeypatch, var):
    monkeypatch.setenv(var, "tritonn")
    with pytest.raises(GraftConfigError, match=var):
        pick(host)


def test_empty_priority_list_is_an_error(host, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", " , ")
    with pytest.raises(GraftConfigError, match="empty"):
        pick(host)


@pytest.mark.parametrize("value,expected", [("fast", "vendor"), ("fast,vendor", "torch"), ("fused", "torch"),
                                            ("fused.toy_scale", "torch"), ("all", "torch")])
def test_disable(host, monkeypatch, value, expected):
    monkeypatch.setenv("GRAFT_DISABLE", value)
    assert pick(host) == expected


def test_disable_rejects_unknown_names(host, monkeypatch):
    monkeypatch.setenv("GRAFT_DISABLE", "fastt")
    with pytest.raises(GraftConfigError, match="GRAFT_DISABLE.*'fastt'"):
        pick(host)


def test_torch_reference_cannot_be_disabled_away(host, monkeypatch):
    monkeypatch.setenv("GRAFT_DISABLE", "fast,vendor")
    assert pick(host) == "torch"
    monkeypatch.setenv("GRAFT_DISABLE", "torch,fast,vendor")  # asking for it is an error, not a no-op
    with pytest.raises(GraftConfigError, match="GRAFT_DISABLE: 'torch' is graft's torch reference.*cannot be disabled"):
        pick(host)


def test_static_reasons_dtype_and_device(host):
    decision = decide(host.registry, OP, "cpu", torch.float16, "cpu")
    reasons = {c.impl.backend: c.reason for c in decision.candidates}
    assert decision.selected.backend == "vendor"
    assert "dtype float16 not supported" in reasons["fast"]
    decision = decide(host.registry, OP, "cuda", torch.float32, "sm_90")
    assert decision.selected.backend == "fast"
    decision = decide(host.registry, OP, "cuda", torch.float16, "sm_90")
    reasons = {c.impl.backend: c.reason for c in decision.candidates}
    assert "device type 'cuda' not supported" in reasons["vendor"]
    assert decision.selected.backend == "torch"


def test_per_call_check_falls_back_and_logs_once(host, monkeypatch, caplog):
    monkeypatch.setenv("GRAFT_FUSED", "fast")
    caplog.set_level(logging.INFO, logger="graft")
    odd = torch.ones(3)
    assert pick(host, odd) == "vendor"
    assert pick(host, odd) == "vendor"
    warnings = [r for r in caplog.records if "odd numel 3" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING  # the user asked for 'fast' explicitly
    assert "fused.toy_scale: fast" in warnings[0].getMessage()


def test_routine_fallback_is_info_not_warning(host, caplog):
    caplog.set_level(logging.INFO, logger="graft")
    assert pick(host, torch.ones(5)) == "vendor"
    records = [r for r in caplog.records if "odd numel 5" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.INFO]


def test_strict_mode_raises_instead_of_falling_back(host, monkeypatch):
    monkeypatch.setenv("GRAFT_FUSED", "fast")
    monkeypatch.setenv("GRAFT_STRICT", "1")
    assert pick(host) == "fast"
    with pytest.raises(GraftUnsupportedError, match="odd numel 3.*GRAFT_STRICT"):
        pick(host, torch.ones(3))


def test_bad_boolean_value(host, monkeypatch):
    monkeypatch.setenv("GRAFT_STRICT", "maybe")
    with pytest.raises(GraftConfigError, match="GRAFT_STRICT='maybe'"):
        pick(host)


def test_decision_reports_fallback(host, monkeypatch):
    monkeypatch.setenv("GRAFT_FUSED", "fast")
    d = decide(host.registry, OP, "cpu", torch.float16, "cpu")
    assert d.fell_back and d.source == "GRAFT_FUSED" and d.requested == ("fast",)
    assert d.as_dict()["selected"]["backend"] == "vendor"


def test_vendor_default_priority_hook_firstresult(host, monkeypatch):
    class VendorDefaults:
        @hookimpl
        def graft_default_backend_priority(self, device):
            return ["vendor", "fast"] if device.type == "cpu" else None

    host.register(VendorDefaults(), "vendor-defaults")
    reset_caches()
    assert pick(host) == "vendor"
    monkeypatch.setenv("GRAFT_BACKENDS", "fast")  # the variable still wins
    assert pick(host) == "fast"


def test_no_implementation_at_all_is_a_clear_error(fresh_graft):
    reset_caches()
    bare = PluginHost(load_entry_points=False)  # no reference impl registered
    bare.register(ToyAdapter(), "toy")
    with pytest.raises(GraftUnsupportedError) as err:
        decide(bare.registry, OP, "cuda", torch.float16, "sm_90")
    message = str(err.value)
    assert "no implementation of fused.toy_scale" in message
    assert "dtype float16 not supported" in message and "device type 'cuda' not supported" in message


def test_runtime_failure_falls_back_with_the_reason_logged(fresh_graft, monkeypatch, caplog):
    """An impl that learns only when it runs that it can't serve (a failed lazy build)."""
    import graft
    from graft.errors import GraftUnsupportedError
    from graft.plugins import get_host
    from graft.registry import Implementation

    class LazyBuild:
        failure = None

        @hookimpl
        def graft_register_kernels(self, registry):
            def run(x, factor):
                LazyBuild.failure = "nvcc exited with status 1"
                raise GraftUnsupportedError(f"build failed: {LazyBuild.failure}")

            registry.add_impl(Implementation(op="fused.toy_scale", backend="lazy", fn=run,
                                             available=lambda: LazyBuild.failure and f"build failed: {LazyBuild.failure}"))

    host = get_host()
    host.register(ToyAdapter(), "toy")
    host.register(LazyBuild(), "lazy")
    monkeypatch.setenv("GRAFT_FUSED", "lazy,torch")
    caplog.set_level(logging.WARNING, logger="graft")
    out = graft.call("fused.toy_scale", torch.ones(3), 2.0)
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert any("lazy (lazy) failed at run time: build failed: nvcc exited" in r.getMessage() for r in caplog.records)
    assert graft.select("fused.toy_scale", torch.ones(3), 2.0).backend == "torch"  # remembered

    LazyBuild.failure = None
    monkeypatch.setenv("GRAFT_STRICT", "1")
    reset_caches()
    with pytest.raises(GraftUnsupportedError, match="build failed"):
        graft.call("fused.toy_scale", torch.ones(3), 2.0)
