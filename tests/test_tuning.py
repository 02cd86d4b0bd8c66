"""Measured selection: the framework's own code as a backend, tuning tables (keys, buckets,
foreign tables, batch invariance, explicit variables), dispatch reading them, ``graft tune``
end to end and ``graft info``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from graft import framework_backend, selection, tuning
from graft.errors import GraftConfigError
from graft.hookspecs import hookimpl

FW = "toyfw"
OP = "fused.silu_and_mul"


class ToyFramework:
    """A framework plugin whose own silu_and_mul is a backend named after it (counts its calls)."""

    def __init__(self):
        self.calls = 0

    def silu_and_mul(self, x):
        self.calls += 1
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    @hookimpl
    def graft_framework_implementations(self):
        return [framework_backend.implementation(FW, OP, self.silu_and_mul, "toy framework's own silu_and_mul")]


@pytest.fixture
def toy(fresh_graft):
    from graft.plugins import get_host

    fw = ToyFramework()
    get_host().register(fw, "toyfw-plugin")
    framework_backend.enable(FW)
    yield fw
    framework_backend.disable(FW)


def _table(tmp_path, entries, device=None, versions=None, name="table.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": tuning.FORMAT, "device": device or tuning.device_key("cpu"),
                                "versions": versions or tuning.versions(), "entries": entries}))
    return str(path)


def _entry(bucket, backend, provider="", median=None, ratio=1.5, op=OP):
    entry = {"op": op, "dtype": "float32", "bucket": bucket, "backend": backend, "provider": provider, "ratio": ratio}
    if median is not None:
        entry["median_us"] = median
    return entry


def _served(tokens, width=64):
    from graft import dispatch

    _, impl = dispatch.run(OP, torch.randn(tokens, width))
    return impl.backend


# --------------------------------------------------------------------------- keys


def test_token_buckets_are_powers_of_two():
    assert [tuning.token_bucket(n) for n in (0, 1, 2, 3, 16, 17, 100, 512)] == [0, 1, 2, 4, 16, 32, 128, 512]


def test_bucket_key_names_shapes_ints_and_none_but_not_floats(fresh_graft):
    x, w = torch.randn(10, 256), torch.randn(256)
    assert tuning.bucket("fused.rms_norm", (x, w, 1e-6, None)) == "t<=16 x=[t,256] weight=[256] residual=None"
    assert tuning.bucket("fused.rms_norm", (torch.randn(9, 256), w, 1e-5, torch.randn(9, 256))) == \
        "t<=16 x=[t,256] weight=[256] residual=[t,256]"
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    key = tuning.bucket("fused.rotary_embedding", (torch.zeros(3, dtype=torch.long), q, k, 8, torch.randn(32, 8), True))
    assert key == "t<=4 positions=[t] q=[t,4,8] k=[t,2,8] head_size=8 cos_sin_cache=[32,8] is_neox=True"
    # The hidden size equal to the token count stays a number (only the token arguments' first dim is t).
    assert tuning.bucket("fused.rms_norm", (torch.randn(256, 256), w)) == "t<=256 x=[t,256] weight=[256]"
    assert tuning.without_tokens("t<=16 x=[t,256]") == "x=[t,256]"


def test_device_key_and_versions_name_this_machine():
    key = tuning.device_key("cpu")
    assert key["type"] == "cpu" and key["name"] and key["arch"]
    assert tuning.versions()["torch"] == torch.__version__.split("+")[0]


# --------------------------------------------------------------------------- tables


def test_bad_tables_are_clear_errors(tmp_path, fresh_graft, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "nope", "entries": []}))
    with pytest.raises(GraftConfigError, match="format must be 'graft-tuning/1', got 'nope'"):
        tuning.load(str(bad))
    bad.write_text(json.dumps({"format": tuning.FORMAT, "entries": [{"op": OP, "dtype": "float32"}]}))
    with pytest.raises(GraftConfigError, match="entry 0 lacks bucket, backend"):
        tuning.load(str(bad))
    monkeypatch.setenv("GRAFT_TUNING_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(GraftConfigError, match="cannot read tuning table"):
        tuning.tables("cpu")


def test_foreign_tables_are_ignored_and_said(tmp_path, toy, monkeypatch):
    other_device = dict(tuning.device_key("cpu"), name="Some Other CPU")
    foreign = _table(tmp_path, [_entry("t<=16 x=[t,64]", "torch")], device=other_device, name="foreign.json")
    old = _table(tmp_path, [_entry("t<=16 x=[t,64]", "torch")], versions={"torch": "1.0.0", "triton": None},
                 name="old.json")
    monkeypatch.setenv("GRAFT_TUNING_TABLE", f"{foreign}:{old}")
    found = tuning.tables("cpu")
    assert [t.used for t in found] == [False, False]
    assert "measured on another device (name 'Some Other CPU'" in found[0].ignored
    assert "measured with torch 1.0.0" in found[1].ignored
    assert _served(10) == FW  # nothing applies: the framework's own code serves
    from graft.tools.info import collect, render_text

    text = render_text(collect(device="cpu", ops=[OP]))
    assert f"{foreign}  (1 entries)  ignored: measured on another device" in text


def test_without_a_table_the_framework_serves_first(toy):
    assert _served(10) == FW and toy.calls == 1
    from graft.selection import explain

    decision = explain(__import__("graft.plugins").plugins.get_registry(), OP, device="cpu", dtype=torch.float32)
    assert decision.selected.backend == FW and decision.source.startswith("default (the framework's own code first")


def test_framework_code_serves_only_where_enabled(toy):
    framework_backend.disable(FW)
    assert _served(10) != FW and toy.calls == 0
    from graft.plugins import get_registry
    from graft.selection import explain

    (cand,) = [c for c in explain(get_registry(), OP, device="cpu", dtype=torch.float32).candidates
               if c.impl.backend == FW]
    assert "its graft integration is not active in this process" in cand.reason


def test_table_moves_graft_first_per_bucket(tmp_path, toy, monkeypatch):
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path, [
        _entry("t<=16 x=[t,64]", "torch", "graft"), _entry("t<=128 x=[t,64]", FW, "toyfw-plugin")]))
    for _ in range(3):  # the first call builds the plan, later ones hit the remembered signature
        assert _served(10) == "torch"
        assert _served(100) == FW
        assert _served(1000) == FW  # no entry: the framework's own code
        assert _served(10, width=32) == FW  # another shape, no entry
    from graft import dispatch

    assert dispatch.select(OP, torch.randn(12, 64)).backend == "torch"
    # The tuned choice is made before the signature is remembered: a repeated call hits the
    # remembered signature, which returns the bucket's plan (no table lookup on the hot path).
    state = dispatch._ops[OP]
    x = torch.randn(10, 64)
    plans = [p for p in (hit(x) for hit in state.hits) if p is not None]
    assert plans and plans[0].impls[0].backend == "torch" and plans[0].tune is None


def test_explicit_variable_wins_over_the_table(tmp_path, toy, monkeypatch):
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path, [_entry("t<=128 x=[t,64]", FW, "toyfw-plugin")]))
    monkeypatch.setenv("GRAFT_FUSED_SILU_AND_MUL", "torch")
    assert _served(100) == "torch"
    monkeypatch.setenv("GRAFT_FUSED_SILU_AND_MUL", FW)
    assert _served(10) == FW
    assert selection.graft_wanted(OP) is None  # the variable puts the framework first


def test_graft_wanted_says_why(tmp_path, toy, monkeypatch):
    assert selection.graft_wanted(OP) is None
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    assert selection.graft_wanted(OP) == "GRAFT_BACKENDS puts torch first"
    monkeypatch.delenv("GRAFT_BACKENDS")
    path = _table(tmp_path, [_entry("t<=16 x=[t,64]", "torch", ratio=1.31), _entry("t<=1 x=[t,64]", FW)])
    monkeypatch.setenv("GRAFT_TUNING_TABLE", path)
    assert selection.graft_wanted(OP) == f"{path}: torch for float32 t<=16 x=[t,64] (1.31x faster)"


def test_a_table_naming_an_unusable_backend_keeps_the_default(tmp_path, toy, monkeypatch):
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path, [_entry("t<=16 x=[t,64]", "hip")]))
    assert _served(10) == FW


def test_batch_invariant_mode_keeps_one_backend_for_every_token_count(tmp_path, toy, monkeypatch):
    # torch wins at 1 token by a little, the framework at 16 by a lot: least total time wins everywhere.
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path, [
        _entry("t<=1 x=[t,64]", "torch", "graft", median={"torch": 5.0, FW: 6.0}),
        _entry("t<=16 x=[t,64]", FW, "toyfw-plugin", median={FW: 10.0, "torch": 30.0})]))
    assert _served(1) == "torch"  # per-bucket choice
    monkeypatch.setenv("GRAFT_TUNING_BATCH_INVARIANT", "1")
    assert {_served(n) for n in (1, 16, 500)} == {FW}


_RANK_SCRIPT = """
import json, sys, torch
from graft import framework_backend, dispatch
from graft.plugins import get_host
sys.path.insert(0, {tests!r})
from test_tuning import ToyFramework
get_host().register(ToyFramework(), "toyfw-plugin")
framework_backend.enable("toyfw")
torch.manual_seed(int(sys.argv[1]))  # each rank its own data and load
print(json.dumps([dispatch.select("fused.silu_and_mul", torch.randn(n, 64)).backend for n in (1, 5, 10, 16, 17, 100)]))
"""


def test_ranks_reading_one_table_agree(tmp_path):
    # The choice is a function of the table and the shapes only (no timing at run time):
    # two processes (ranks) with different data and load choose alike.
    path = _table(tmp_path, [_entry("t<=16 x=[t,64]", "torch", "graft"), _entry("t<=1 x=[t,64]", "torch", "graft")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env["GRAFT_TUNING_TABLE"] = path
    script = _RANK_SCRIPT.format(tests=os.path.dirname(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for rank in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1] == ["torch", FW, "torch", "torch", FW, FW]  # t<=8 and t<=32: no entry


def test_info_shows_per_bucket_choice_ratio_and_table(tmp_path, toy, monkeypatch):
    path = _table(tmp_path, [_entry("t<=16 x=[t,64]", "torch", "graft", median={"torch": 2.0, FW: 2.6}, ratio=1.3)])
    monkeypatch.setenv("GRAFT_TUNING_TABLE", path)
    from graft.tools.info import collect, render_text

    report = collect(device="cpu", ops=[OP])
    assert report["tuning"]["tables"][0]["used"] is True
    text = render_text(report)
    assert f"{path}  (1 entries)  used" in text
    assert (f"tuned [float32] t<=16 x=[t,64]: served by torch (faster here by 1.30x than {FW})  (table {path})"
            in text)


def test_a_plugin_ships_tables(tmp_path, toy):
    from graft.plugins import get_host

    path = _table(tmp_path, [_entry("t<=16 x=[t,64]", "torch", "graft")])

    class Vendor:
        @hookimpl
        def graft_tuning_tables(self):
            return [path, {"format": "broken"}]

    get_host().register(Vendor(), "vendor-tables")
    tuning.reset()
    found = tuning.tables("cpu")
    assert [t.source for t in found] == [f"vendor-tables: {path}", "vendor-tables: in memory"]
    assert found[0].used and "format must be" in found[1].ignored
    assert _served(10) == "torch"


def test_framework_implementation_must_be_named_after_its_framework(fresh_graft):
    from graft.plugins import PluginHost
    from graft.registry import Implementation

    class Bad:
        @hookimpl
        def graft_framework_implementations(self):
            return [Implementation(op=OP, backend="triton", fn=lambda x: x, framework="triton")]

    host = PluginHost()
    host.register(Bad(), "bad")
    assert not [i for i in host.registry.implementations(OP) if i.provider == "bad"]
    assert any("backend 'triton' is one of graft's own" in e for e in host.hook_errors)


# --------------------------------------------------------------------------- integration


def test_vllm_parts_stay_vllms_own_unless_graft_is_known_faster(tmp_path, fresh_graft, monkeypatch):
    from graft.adapters.vllm.integration import INTEGRATION
    from graft.adapters.vllm.plugin import OPT_IN_PARTS

    assert "attention" in OPT_IN_PARTS  # attention changes nothing unless selected
    left = INTEGRATION.not_wanted(("rms_norm", "linear", "moe"))
    assert set(left) == {"rms_norm", "linear", "moe"}
    assert "graft is not known faster here" in left["rms_norm"]
    monkeypatch.setenv("GRAFT_TUNING_TABLE", _table(tmp_path, [
        _entry("t<=16 x=[t,64] weight=[64] residual=None", "torch", op="fused.rms_norm")]))
    assert set(INTEGRATION.not_wanted(("rms_norm", "linear"))) == {"linear"}
    monkeypatch.setenv("GRAFT_GEMM", "torch")
    assert INTEGRATION.not_wanted(("rms_norm", "linear")) == {}


# --------------------------------------------------------------------------- graft tune


def _tune(tmp_path, *args):
    from graft.tools.cli import main

    return main(["tune", *args])


def test_tune_quick_end_to_end_and_resume(tmp_path, fresh_graft, capsys, monkeypatch):
    cfg = tmp_path / "model"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                                                 "intermediate_size": 48, "torch_dtype": "float32",
                                                 "max_position_embeddings": 64}))
    out = tmp_path / "t.json"
    monkeypatch.setenv("GRAFT_DISABLE", "triton")  # the interpreter's times mean nothing; keep it short
    args = ["--model", str(cfg), "--quick", "--tokens", "1,8", "--rounds", "2", "--frameworks", "",
            "--ops", "fused.rms_norm,fused.silu_and_mul", "--out", str(out)]
    assert _tune(tmp_path, *args) == 0
    text = capsys.readouterr().out
    assert "graft tune: 6 shapes on cpu" in text and "s left" in text
    table = json.loads(out.read_text())
    assert table["format"] == tuning.FORMAT and table["device"] == tuning.device_key("cpu")
    assert len(table["entries"]) == 6
    entry = next(e for e in table["entries"] if e["op"] == OP and e["tokens"] == 8)
    assert entry["bucket"] == "t<=8 x=[t,96]" and entry["backend"] == "torch" and entry["median_us"]["torch"] > 0
    # Resume: nothing is measured again.
    assert _tune(tmp_path, *args) == 0
    assert capsys.readouterr().out.count("(resumed)") == 6
    # The table serves: graft info reads it.
    monkeypatch.setenv("GRAFT_TUNING_TABLE", str(out))
    from graft.tools.info import collect

    assert len(collect(device="cpu", ops=[OP])["tuning"]["ops"][OP]) == 2


def _tune_one_shape(tmp_path) -> dict:
    """graft tune on a recorded-shapes file of one silu_and_mul shape; the table written."""
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"format": tuning.SHAPES_FORMAT, "shapes": [
        {"op": OP, "dtype": "float32", "args": [{"shape": [4, 64]}]}]}))
    out = tmp_path / "t.json"
    assert _tune(tmp_path, "--shapes", str(shapes), "--rounds", "3", "--frameworks", "", "--out", str(out)) == 0
    return json.loads(out.read_text())


def test_tune_from_recorded_shapes_with_a_competing_framework(tmp_path, toy, capsys):
    (entry,) = _tune_one_shape(tmp_path)["entries"]
    assert FW in entry["median_us"] and "torch" in entry["median_us"]
    assert entry["backend"] in entry["median_us"] and entry["ratio"] > 0


def test_tune_rejects_bad_input(tmp_path, fresh_graft, capsys):
    from graft.tools.cli import main

    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"format": "x"}))
    assert main(["tune", "--shapes", str(bad)]) == 2
    assert "format must be 'graft-shapes/1'" in capsys.readouterr().err
    bad.write_text(json.dumps({"format": tuning.SHAPES_FORMAT, "shapes": [{"op": "fused.nope", "args": []}]}))
    assert main(["tune", "--shapes", str(bad)]) == 2
    assert "unknown op 'fused.nope'" in capsys.readouterr().err
    assert main(["tune", "--model", str(tmp_path), "--tokens", "a"]) == 2
    assert "--tokens 'a': give comma-separated token counts" in capsys.readouterr().err
    assert main(["tune", "--model", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_each_framework_registers_its_own_code(fresh_graft):
    from graft import dispatch
    from graft.plugins import get_registry

    registry = get_registry()
    frameworks = {op: {i.backend for i in registry.implementations(op) if i.framework}
                  for op in ("fused.rms_norm", "fused.silu_and_mul", "fused.rotary_embedding", "gemm.linear")}
    assert frameworks == {"fused.rms_norm": {"vllm", "megatron", "torchtitan"}, "fused.silu_and_mul": {"vllm", "torchtitan"},
                          "fused.rotary_embedding": {"vllm"}, "gemm.linear": {"vllm", "megatron"}}
    framework_backend.enable("megatron")
    try:
        x, w = torch.randn(5, 32), torch.randn(32)
        out, impl = dispatch.run("fused.rms_norm", x, w, 1e-6)
        assert impl.backend == "megatron"
        torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (32,), w, 1e-6))
        _, impl = dispatch.run("fused.rms_norm", x, w, 1e-6, torch.randn(5, 32))
        assert impl.backend != "megatron"  # no fused residual add in Megatron's norm: graft's serves
    finally:
        framework_backend.disable("megatron")


@pytest.mark.slow
def test_deepspeeds_fused_adam_is_backend_deepspeed(fresh_graft):
    """DeepSpeed's FusedAdam as DeepSpeed builds it (a JIT C++ build on the CPU, minutes the
    first time, cached after) serves fused.adam_step as backend deepspeed, matching graft's."""
    pytest.importorskip("deepspeed")
    from graft import dispatch
    from graft.ops.fused import adam_step_reference

    framework_backend.enable("deepspeed")
    try:
        gen = torch.Generator().manual_seed(0)
        p, g, m, v = (torch.randn(1000, generator=gen) for _ in range(4))
        v = v.abs()
        args = (p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 3, 0.01, True, True)
        out, impl = dispatch.run("fused.adam_step", *args)
        assert impl.backend == "deepspeed", impl
        for got, want in zip(out, adam_step_reference(*args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, torch.randn(1000, generator=torch.Generator().manual_seed(0)))  # inputs untouched
    finally:
        framework_backend.disable("deepspeed")


def test_tune_keeps_the_framework_where_its_code_cannot_be_measured(tmp_path, fresh_graft, capsys, monkeypatch):
    """vLLM's CPU linear is prepacked per layer: no op-level stand-in races graft's; the bucket
    is recorded as the framework's (graft not known faster), so the integration leaves it alone."""
    from graft.plugins import get_host

    class GpuOnly:
        @hookimpl
        def graft_framework_implementations(self):
            return [framework_backend.implementation(FW, OP, lambda x: x, devices=("cuda",))]

    get_host().register(GpuOnly(), "toyfw-plugin")
    framework_backend.enable(FW)
    try:
        (entry,) = _tune_one_shape(tmp_path)["entries"]
        assert entry["backend"] == FW and entry["ratio"] is None and "could not be measured here" in entry["note"]
        monkeypatch.setenv("GRAFT_TUNING_TABLE", str(tmp_path / "t.json"))
        assert selection.graft_wanted(OP) is None
    finally:
        framework_backend.disable(FW)


def test_tune_draws_weights_at_their_fan_in_scale_on_the_device(device):
    """A model's weights are drawn as random normal / sqrt(fan-in) (unit-sized outputs, as in
    a trained model: with unscaled weights a MoE layer's outputs reach 1e5 and bf16 rounding
    fails candidates that are right), on the measuring device; shapes alone (meta) for keys."""
    from graft.tools import tune

    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    shapes = tune.model_shapes(cfg, (8,), torch.float32)
    moe = next(s for s in shapes if s["op"] == "moe.fused_experts")
    x, w13, w2 = tune.make_args(moe, device, tune.generator(device))[:3]
    assert x.device.type == w13.device.type == device.type
    assert abs(float(x.std()) - 1.0) < 0.1
    assert abs(float(w13.std()) * 64 ** 0.5 - 1.0) < 0.05 and abs(float(w2.std()) * 96 ** 0.5 - 1.0) < 0.05
    meta = tune.make_args(moe, "meta", None)
    assert all(t.device.type == "meta" for t in meta[:5])
    assert tuning.bucket("moe.fused_experts", meta) == tuning.bucket("moe.fused_experts", tune.make_args(moe, device, tune.generator(device)))
    ids = tune.make_args(moe, device, tune.generator(device))[4]
    assert all(len(set(row.tolist())) == 2 for row in ids)  # distinct experts per token
