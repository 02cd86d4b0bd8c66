"""graft's TorchTitan converter on one process: which parts it swaps (and only where graft is
wanted: measured selection), and a Llama 3 debug model's forward and backward equal with graft
on and off. Multi-rank training (FSDP2, TP) is in tests/test_torchtitan_training.py."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _titan  # noqa: E402

# fp32 on the CPU: graft's torch backend computes RMSNorm and SwiGLU with the same formulas
# as torch.nn.RMSNorm / F.silu(a) * b, but not necessarily the same op order (rsqrt vs
# division, one fused cat), so results may differ in the last bits of fp32 (eps 1.2e-7);
# through 2 layers and the output projection that stays well under 1e-5 relative.
RTOL, ATOL = 1e-5, 1e-6


def _converter():
    from graft.adapters.torchtitan import converter

    return converter


def test_no_graft_variable_leaves_every_part_to_torchtitan(fresh_graft):
    """Without a GRAFT_* variable or a tuning table entry, graft is not known faster: the
    converter swaps nothing and says why for each part."""
    from torchtitan.models.common.nn_modules import RMSNorm

    spec = _titan.model_spec("llama3", graft_on=True)
    report = _converter().last_report
    assert report["swapped"] == {}, report
    for part in ("norm", "swiglu"):
        assert "not known faster" in report["left"][part], report
    assert all(type(cfg) is RMSNorm.Config for _, cfg, _, _ in spec.model.traverse(RMSNorm.Config))


def test_graft_backends_swaps_norm_and_swiglu(fresh_graft, monkeypatch):
    from graft.adapters.torchtitan import GraftFeedForward, GraftRMSNorm

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    spec, model = _titan.build_model("llama3", graft_on=True, n_layers=2)
    report = _converter().last_report
    # the registry converts the full debug model (6 layers): 2 norms per layer + the final one
    assert report["swapped"] == {"norm": 13, "swiglu": 6}, report
    assert "GRAFT_BACKENDS" in report["why"]["norm"], report
    for part in ("attention", "moe", "output_loss", "optimizer"):
        assert part in report["left"], report
    norms = [m for m in model.modules() if isinstance(m, GraftRMSNorm)]
    ffns = [m for m in model.modules() if isinstance(m, GraftFeedForward)]
    assert len(norms) == 2 * 2 + 1 and len(ffns) == 2


def test_switch_off_leaves_model(fresh_graft, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    monkeypatch.setenv("GRAFT_TORCHTITAN", "0")
    _titan.model_spec("llama3", graft_on=True)
    report = _converter().last_report
    assert report["swapped"] == {} and "GRAFT_TORCHTITAN=0" in report["left"]["all"], report


def test_unknown_part_is_an_error():
    with pytest.raises(ValueError, match="unknown parts"):
        _converter().GraftConverter(_converter().GraftConverter.Config(parts=("norm", "attn")))


def _forward_backward(graft_on, n_layers=2, batch=2, seq=16):
    spec, model = _titan.build_model("llama3", graft_on, seed=0, n_layers=n_layers)
    tokens = torch.randint(0, spec.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    out = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_llama3_forward_backward_graft_on_equals_off(fresh_graft, monkeypatch):
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    counter.reset()
    out_off, grads_off = _forward_backward(False)
    assert counter.served_calls() == {}
    out_on, grads_on = _forward_backward(True)
    # 2 layers: 2 norms each + the final norm; one SwiGLU per layer (one forward)
    assert counter.served_calls() == {"fused.rms_norm:torch": 5, "fused.silu_and_mul:torch": 2}
    assert counter.fallbacks() == {}
    torch.testing.assert_close(out_on, out_off, rtol=RTOL, atol=ATOL)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=RTOL, atol=ATOL, msg=name)


def test_llama3_interpreted_triton_tiny(fresh_graft, monkeypatch):
    """graft's Triton kernels (interpreted on the CPU) serve the swapped parts of a 1-layer model."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest unless the environment chose otherwise)")
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "triton")
    counter.reset()
    out_off, grads_off = _forward_backward(False, n_layers=1, batch=1, seq=8)
    out_on, grads_on = _forward_backward(True, n_layers=1, batch=1, seq=8)
    served = counter.served_calls()
    assert served == {"fused.rms_norm:triton": 3, "fused.silu_and_mul:triton": 1}, served
    torch.testing.assert_close(out_on, out_off, rtol=1e-4, atol=1e-5)
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("graft_on", [False, True], ids=["torchtitan", "graft"])
def test_llama3_blocks_compile_fullgraph(fresh_graft, monkeypatch, graft_on):
    """Each TransformerBlock compiled with ``fullgraph=True``, as TorchTitan's ``apply_compile``
    does (backend aot_eager here: the graph capture is Dynamo's either way, and it keeps the
    test fast); graft's ops trace without a graph break and give eager's result."""
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    torch._dynamo.reset()
    spec, model = _titan.build_model("llama3", graft_on, seed=0, n_layers=1)
    tokens = torch.randint(0, spec.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    eager_out = model(tokens[:, :-1]).detach()
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True, backend="aot_eager"))
    counter.reset()
    out = model(tokens[:, :-1])
    out.float().sum().backward()
    torch.testing.assert_close(out.detach(), eager_out, rtol=RTOL, atol=ATOL)
    assert all(p.grad is not None for p in model.parameters())
    # Served by graft's torch backend inside the compiled graph. Not exact counts: AOTAutograd's
    # CSE pass (torch._functorch.compile_utils.fx_graph_cse, used by aot_eager and inductor)
    # merges the two identical ``graft.integration_count`` side-effect ops of the block's two
    # norms, so a compiled block records 1 rms_norm call per step where eager records 2
    # (graft's CallCounter under AOTAutograd backends, not TorchTitan-specific; the eager
    # Dynamo backend counts 3).
    served = counter.served_calls()
    if graft_on:
        assert set(served) == {"fused.rms_norm:torch", "fused.silu_and_mul:torch"}, served
    else:
        assert served == {}


def test_baselines_are_torchtitans_modules(fresh_graft, monkeypatch):
    """``graft conformance``'s TorchTitan baselines compute what TorchTitan's modules compute,
    and are found through the plugin hook."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.nn_modules import RMSNorm

    from graft.adapters.torchtitan import baselines
    from graft.plugins import get_host
    from graft.ops.fused import rms_norm_reference, silu_and_mul_reference

    monkeypatch.setenv("GRAFT_DISABLE_PLUGINS", "vllm,deepspeed,megatron,hip,triton")  # faster host start
    names = {b.name for group in get_host().collect("graft_conformance_baselines") for b in
             (group if isinstance(group, list) else [group])}
    assert {"torchtitan RMSNorm", "torchtitan FeedForward SwiGLU"} <= names, names
    _, model = _titan.build_model("llama3", False, seed=0, n_layers=1)  # TorchTitan's own modules
    norm, ffn = model.layers["0"].ffn_norm, model.layers["0"].feed_forward
    assert type(norm) is RMSNorm and type(ffn) is FeedForward
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, norm.weight.shape[0])
    eps = norm.eps
    torch.testing.assert_close(baselines.rms_norm(x, norm.weight, eps), norm(x))
    torch.testing.assert_close(baselines.rms_norm(x, norm.weight, eps), rms_norm_reference(x, norm.weight, eps))
    gate_up = torch.cat((ffn.w1(x), ffn.w3(x)), dim=-1)
    torch.testing.assert_close(ffn.w2(baselines.silu_and_mul(gate_up)), ffn(x))
    torch.testing.assert_close(baselines.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
    impls = {(i.op, i.backend) for i in baselines.implementations()}
    assert impls == {("fused.rms_norm", "torchtitan"), ("fused.silu_and_mul", "torchtitan")}


def _optim_run(config, steps=3):
    _, model = _titan.build_model("llama3", False, seed=0, n_layers=1)
    config.implementation = "for-loop"
    optim = config.build(model_parts=[model])
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        optim.zero_grad()
        tokens = torch.randint(0, 2048, (2, 9), generator=gen)
        out = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optim.step()
    return optim, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_graft_optimizer_container(fresh_graft, monkeypatch):
    """graft's OptimizersContainer: torch's AdamW unless graft is wanted for fused.adam_step;
    then GraftAdamW, whose updates equal torch AdamW's (fp32) and keep torch's state keys."""
    from torchtitan.components.optimizer import default_adamw

    from graft.adapters.torchtitan.integration import counter
    from graft.adapters.torchtitan.optimizer import graft_adamw

    optim, _ = _optim_run(graft_adamw(lr=1e-3), steps=1)
    assert [type(o).__name__ for o in optim.optimizers] == ["AdamW"]  # no GRAFT_* variable: torch's
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    _, want = _optim_run(default_adamw(lr=1e-3))
    counter.reset()
    optim, got = _optim_run(graft_adamw(lr=1e-3))
    (opt,) = optim.optimizers
    assert type(opt).__name__ == "GraftAdamW" and isinstance(opt, torch.optim.AdamW)
    n = len(want)
    assert counter.served_calls()["fused.adam_step:torch"] == 3 * n
    state = next(iter(opt.state.values()))
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 3.0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    # an option graft's op does not take: torch's step for that group, counted and logged
    from graft.adapters.torchtitan.optimizer import GraftAdamW

    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    ams, ref = GraftAdamW([p], lr=1e-2, amsgrad=True), torch.optim.AdamW([q := torch.nn.Parameter(p.detach().clone())],
                                                                         lr=1e-2, amsgrad=True)
    q.grad = p.grad.clone()
    ams.step()
    ref.step()
    assert counter.fallbacks() == {"GraftAdamW": 1}
    torch.testing.assert_close(p.detach(), q.detach())


def test_moe_routed_experts_equal_torchtitans_in_fp32(fresh_graft, monkeypatch):
    """Opt-in part ``moe``: DeepSeek-V3's routed experts as one ``moe.fused_experts`` call.
    TorchTitan's GroupedExperts compute in bfloat16; with its casts made the identity (test
    only) they compute in fp32, and graft's forward and backward match them to fp32 rounding."""
    from unittest import mock

    from graft.adapters.torchtitan import converter
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    counter.reset()
    results = {}
    with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self):
        for on in (False, True):
            spec, model = _titan.build_model("deepseek_v3", on, seed=0, n_layers=2, parts=("norm", "swiglu", "moe"))
            if on:
                assert converter.last_report["swapped"]["moe"] >= 1
            tokens = torch.randint(0, spec.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
            out = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            results[on] = (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    # 2 layers: layer 1 is the MoE layer (one routed-experts call a forward)
    assert counter.served_calls() == {"fused.rms_norm:torch": 7, "fused.silu_and_mul:torch": 2,
                                      "moe.fused_experts:torch": 1}, counter.served_calls()
    assert counter.fallbacks() == {}
    torch.testing.assert_close(results[True][0], results[False][0], rtol=RTOL, atol=ATOL)
    for name, want in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_moe_is_opt_in(fresh_graft, monkeypatch):
    from graft.adapters.torchtitan import converter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    _titan.model_spec("deepseek_v3", graft_on=True)
    assert "moe" not in converter.last_report["swapped"]
    assert converter.last_report["left"]["moe"] == "not in GraftConverter.Config.parts"


def _per_document_attention(q, k, v, positions, causal, scale):
    """The definition: each document of a row (it starts where positions is 0) attends
    within itself only, causally or fully; GQA by repeating KV heads."""
    out = torch.empty_like(q)
    group = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        starts = (positions[b] == 0).nonzero().flatten().tolist() + [q.shape[1]]
        for s, e in zip(starts[:-1], starts[1:]):
            qd, kd, vd = (t[b, s:e].transpose(0, 1) for t in (q, k, v))
            kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
            out[b, s:e] = torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, is_causal=causal, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("window,causal", [((-1, 0), True), ((-1, -1), False)])
def test_varlen_attention_serves_document_masks(fresh_graft, monkeypatch, window, causal):
    """GraftVarlenAttention on TorchTitan's VarlenMetadata for rows packing several documents
    (odd lengths, GQA 4/2 heads): forward and q/k/v gradients equal per-document attention."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from graft.adapters.torchtitan import GraftVarlenAttention
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    attn = GraftVarlenAttention(GraftVarlenAttention.Config(window_size=window))
    gen = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in (5, 7, 1, 3)] + [torch.arange(9), torch.arange(7)]).view(2, 16)
    q = torch.randn(2, 16, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 16, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    counter.reset()
    out = attn(q, k, v, attention_masks=create_varlen_metadata_for_document(positions), scale=0.3)
    ref = _per_document_attention(q, k, v, positions, causal, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert counter.served_calls() == {"attention.prefill:torch": 1} and counter.fallbacks() == {}


def test_varlen_attention_leaves_what_it_cannot_serve(fresh_graft, monkeypatch):
    """A sliding window, an LSE epilogue or MLA's narrower value heads go to TorchTitan's own
    varlen forward (here a stand-in: its CUDA flash attention cannot run on the CPU), counted
    with the reason."""
    from torchtitan.models.common.attention import VarlenAttention, create_varlen_metadata_for_document

    from graft.adapters.torchtitan import GraftVarlenAttention
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    monkeypatch.setattr(VarlenAttention, "forward", lambda self, q, k, v, **kw: "titan")
    meta = create_varlen_metadata_for_document(torch.arange(8).view(1, 8))
    q = k = torch.randn(1, 8, 2, 8)
    counter.reset()
    sliding = GraftVarlenAttention(GraftVarlenAttention.Config(window_size=(4, 0)))
    plain = GraftVarlenAttention(GraftVarlenAttention.Config())
    assert sliding(q, k, k, attention_masks=meta) == "titan"
    assert plain(q, k, k, attention_masks=meta, out_transform=lambda o, lse: o) == "titan"
    assert plain(q, k, torch.randn(1, 8, 2, 4), attention_masks=meta) == "titan"
    assert counter.fallbacks() == {"GraftVarlenAttention": 3} and counter.served_calls() == {}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_varlen_attention_compiles_fullgraph(fresh_graft, monkeypatch, backend):
    """Graft's varlen attention traces with fullgraph=True and equals eager, gradients
    included: on Triton a custom op with a fake and a backward; on torch, whose per-document
    lengths are host reads, the custom op attention_prefill_torch under compile."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from graft.adapters.torchtitan import GraftVarlenAttention

    monkeypatch.setenv("GRAFT_BACKENDS", backend)
    attn = GraftVarlenAttention(GraftVarlenAttention.Config())
    meta = create_varlen_metadata_for_document(torch.cat([torch.arange(9), torch.arange(7)]).view(1, 16))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 16, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    eager = attn(q, k, v, attention_masks=meta)
    grads = torch.autograd.grad(eager.sum(), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attn(q, k, v, attention_masks=meta), backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, eager)
    for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- only where graft computes the same (issue 42)


def _linear(i, o):
    from torchtitan.models.common.linear import Linear

    return Linear.Config(in_features=i, out_features=o, bias=False)


def test_converter_leaves_configs_graft_would_compute_differently():
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.nn_modules import RMSNorm

    differs = _converter()._differs
    assert differs("swiglu", FeedForward.Config(w1=_linear(16, 32), w2=_linear(32, 16), w3=_linear(16, 32))) is None
    why = differs("swiglu", FeedForward.Config(w1=_linear(16, 32), w2=_linear(32, 16), w3=_linear(16, 1)))
    assert why and "w1 and w3 differ" in why and "16->1" in why
    assert differs("norm", RMSNorm.Config(normalized_shape=16)) is None
    assert "over 2 dims" in differs("norm", RMSNorm.Config(normalized_shape=[4, 16]))
    assert differs("norm", RMSNorm.Config(normalized_shape=16, elementwise_affine=False)) == "RMSNorm without a weight"


def test_graft_modules_fall_back_where_their_op_would_differ(fresh_graft, monkeypatch):
    """Built directly (not through the converter): a float64 RMSNorm, a multi-dim one and a
    SwiGLU whose w3 broadcasts compute exactly what TorchTitan's modules do, through their code."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.nn_modules import RMSNorm

    from graft.adapters.torchtitan import GraftFeedForward, GraftRMSNorm
    from graft.adapters.torchtitan.integration import counter

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    counter.reset()
    torch.manual_seed(0)
    for shape, dtype in ((16, torch.float64), ([4, 16], torch.float32), (16, torch.float32)):
        titan = RMSNorm(RMSNorm.Config(normalized_shape=shape)).to(dtype)
        ours = GraftRMSNorm(GraftRMSNorm.Config(normalized_shape=shape)).to(dtype)
        with torch.no_grad():
            titan.weight.normal_()
            ours.weight.copy_(titan.weight)
        x = torch.randn(3, 4, 16, dtype=dtype)
        torch.testing.assert_close(ours(x), titan(x), rtol=1e-5, atol=1e-6)
    fallbacks = counter.fallbacks()
    assert fallbacks.get("GraftRMSNorm") == 2 and counter.served_calls().get("fused.rms_norm:torch") == 1, counter.calls
    cfg = dict(w1=_linear(16, 32), w2=_linear(32, 16), w3=_linear(16, 1))
    titan, ours = FeedForward(FeedForward.Config(**cfg)), GraftFeedForward(GraftFeedForward.Config(**cfg))
    ours.load_state_dict(titan.state_dict())
    x = torch.randn(5, 16)
    torch.testing.assert_close(ours(x), titan(x))
    assert counter.fallbacks().get("GraftFeedForward") == 1
