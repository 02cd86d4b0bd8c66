"""graft's ModuleSpec provider inside the real megatron-core (0.16.x) on the CPU.

A GPT ``TransformerLayer`` built from ``get_gpt_layer_graft_spec()`` and one built from
Megatron's ``get_gpt_layer_local_spec()`` get the same weights (the state dicts have the
same keys) and must agree, forward and backward, in fp32.

What runs where (megatron-core 0.16.1 on a CPU-only torch):

* graft's layer (norms, linears, core attention, MoE experts) needs no CUDA.
* Megatron's local ``DotProductAttention`` (the reference here) hard-codes CUDA in three
  places: its score buffer (``parallel_state.get_global_memory_buffer()`` allocates on
  ``torch.cuda.current_device()``), the dropout RNG tracker fork, and the default causal
  mask (``device="cuda"``). The fixture installs stand-ins for the first two (a buffer
  on the test's device, a no-op fork: dropout is 0) and the reference layer gets an
  explicit causal mask; its attention math is unchanged.
* A full MoE layer forward needs CUDA: ``TopKRouter.gating`` moves the router weight to
  ``torch.cuda.current_device()`` unconditionally (and the all-to-all dispatcher creates a
  ``torch.cuda.Stream``). On the CPU the MoE layer is *built* from graft's spec and its
  experts submodule (graft's fused-experts path) is run against Megatron's
  ``SequentialMLP``; ``test_moe_layer_matches_local_spec_gpu`` runs the whole MoE layer
  when ``GRAFT_TEST_DEVICE=cuda``.
* Rotary position embeddings need CUDA (``RotaryEmbedding.get_emb`` moves its frequencies
  to ``torch.cuda.current_device()``): the whole-GPTModel test uses learned positions.
"""
import importlib
import contextlib
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from graft.errors import GraftError  # noqa: E402

from _reference_calls import reference_calls  # noqa: E402,F401  (fixture)

HIDDEN, HEADS, GROUPS, FFN = 64, 4, 2, 96


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _MemoryBufferOn:
    """Stand-in for Megatron's global memory buffer, allocating on ``device`` (CUDA-only upstream)."""

    device = torch.device("cpu")

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(*shape, dtype=dtype, device=self.device)


class _NoForkRngTracker:
    def fork(self, name=None):
        return contextlib.nullcontext()

    def is_initialized(self):
        return True


@pytest.fixture(scope="module")
def megatron_cpu():
    """A 1-rank gloo world with Megatron's model-parallel state, plus the CPU stand-ins."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(1, 1)
    saved = (parallel_state._GLOBAL_MEMORY_BUFFER, mrandom._CUDA_RNG_STATE_TRACKER,
             mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    # Dropout is 0 everywhere here, so the RNG tracker's fork has nothing to do.
    parallel_state._GLOBAL_MEMORY_BUFFER = _MemoryBufferOn()
    mrandom._CUDA_RNG_STATE_TRACKER = _NoForkRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    yield
    (parallel_state._GLOBAL_MEMORY_BUFFER, mrandom._CUDA_RNG_STATE_TRACKER,
     mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED) = saved
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                  ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
                  attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
                  masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def _build_pair(config, **spec_kwargs):
    """(local layer, graft layer) with identical weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from graft.adapters.megatron import get_gpt_layer_graft_spec

    torch.manual_seed(0)
    local = build_module(get_gpt_layer_local_spec(normalization="RMSNorm", **spec_kwargs), config=config,
                         layer_number=1)
    grafted = build_module(get_gpt_layer_graft_spec(normalization="RMSNorm", **spec_kwargs), config=config,
                           layer_number=1)
    state = local.state_dict()
    # Non-default norm scales, so the norms' weights matter to the comparison.
    for key in state:
        if key.endswith("layernorm.weight"):
            state[key] = 1.0 + 0.1 * torch.randn(state[key].shape)
    local.load_state_dict(state)
    missing, unexpected = grafted.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return local, grafted


def _causal_mask(seq):
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked


@pytest.fixture
def calls(fresh_graft):
    from graft.adapters.megatron.integration import counter

    counter.reset()
    return counter.calls


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_dense_layer_matches_local_spec(megatron_cpu, calls, qk_layernorm, reference_calls):
    from graft.adapters.megatron.modules import (
        GraftColumnParallelLinear,
        GraftDotProductAttention,
        GraftRMSNorm,
        GraftRowParallelLinear,
    )

    local, grafted = _build_pair(_config(), qk_layernorm=qk_layernorm)
    attn = grafted.self_attention
    assert isinstance(grafted.input_layernorm, GraftRMSNorm)
    assert isinstance(grafted.pre_mlp_layernorm, GraftRMSNorm)
    assert isinstance(attn.linear_qkv, GraftColumnParallelLinear)
    assert isinstance(attn.linear_proj, GraftRowParallelLinear)
    assert isinstance(attn.core_attention, GraftDotProductAttention)
    assert isinstance(grafted.mlp.linear_fc1, GraftColumnParallelLinear)
    assert isinstance(grafted.mlp.linear_fc2, GraftRowParallelLinear)
    assert isinstance(attn.q_layernorm, GraftRMSNorm) == qk_layernorm

    seq, batch = 13, 2  # odd sequence length
    x = torch.randn(seq, batch, HIDDEN)
    x_ref, x_graft = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, _ = local(x_ref, attention_mask=_causal_mask(seq))
    out_graft, _ = grafted(x_graft, attention_mask=None)  # causal by the spec's mask type
    torch.testing.assert_close(out_graft, out_ref, rtol=1e-4, atol=1e-5)

    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_graft.backward(grad)
    torch.testing.assert_close(x_graft.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for name, p in local.named_parameters():
        q = dict(grafted.named_parameters())[name]
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")

    served = {key.split(":")[0] for key, n in calls.items() if n and not key.startswith("fallback.")}
    assert {"fused.rms_norm", "gemm.linear", "attention.prefill"} <= served, dict(calls)
    assert not [k for k in calls if k.startswith("fallback.")], dict(calls)
    # Forward and backward ran graft's Triton kernels only: no torch reference was recomputed.
    assert reference_calls == {}, reference_calls


def _layer_norm_config(**extra):
    return _config(normalization="LayerNorm", **extra)


def test_layernorm_config_is_served_by_fused_layer_norm(megatron_cpu, calls, reference_calls):
    """With the spec called without arguments, a LayerNorm config gets graft LayerNorms (weight
    and bias, so the local spec's checkpoint loads strictly) on fused.layer_norm, trained by its
    Triton backward."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from graft.adapters.megatron import get_gpt_layer_graft_spec
    from graft.adapters.megatron.modules import GraftLayerNorm

    config = _layer_norm_config()
    torch.manual_seed(0)
    local = build_module(get_gpt_layer_local_spec(normalization="LayerNorm"), config=config, layer_number=1)
    grafted = build_module(get_gpt_layer_graft_spec(), config=config, layer_number=1)
    assert isinstance(grafted.input_layernorm, GraftLayerNorm)
    state = local.state_dict()
    for key in state:
        if "layernorm." in key:
            state[key] = (1.0 if key.endswith("weight") else 0.0) + 0.1 * torch.randn(state[key].shape)
    local.load_state_dict(state)
    missing, unexpected = grafted.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    x = torch.randn(7, 2, HIDDEN)
    x_ref, x_graft = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, _ = local(x_ref, attention_mask=_causal_mask(7))
    out_graft, _ = grafted(x_graft, attention_mask=_causal_mask(7))
    torch.testing.assert_close(out_graft, out_ref, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_graft.backward(grad)
    torch.testing.assert_close(x_graft.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for name, p in local.named_parameters():
        torch.testing.assert_close(dict(grafted.named_parameters())[name].grad, p.grad, rtol=1e-4, atol=1e-5,
                                   msg=f"gradient of {name}")
    assert calls["fused.layer_norm:triton"] == 2 and calls["attention.prefill:triton"] == 1, dict(calls)
    assert not [k for k in calls if k.startswith("fallback.")], dict(calls)
    assert reference_calls == {}, reference_calls


def test_normalization_mismatch_and_unsupported_are_refused(megatron_cpu, calls):
    from megatron.core.transformer.spec_utils import build_module

    from graft.adapters.megatron import get_gpt_layer_graft_spec

    with pytest.raises(ValueError, match="built for normalization='RMSNorm' but config.normalization is 'LayerNorm'"):
        build_module(get_gpt_layer_graft_spec(normalization="RMSNorm"), config=_layer_norm_config(), layer_number=1)
    with pytest.raises(ValueError, match="normalization must be one of"):
        get_gpt_layer_graft_spec(normalization="L2Norm")
    from graft.adapters.megatron.modules import GraftNorm

    config = _config()
    config.normalization = "L2Norm"
    with pytest.raises(ValueError, match="serves config.normalization in .*got 'L2Norm'"):
        GraftNorm(config, HIDDEN)


def test_gpt_model_with_graft_layers_matches_local(megatron_cpu, calls):
    """A whole GPTModel (2 layers, embeddings, output layer, loss) built with graft's layer spec.

    Learned absolute positions: Megatron's RotaryEmbedding moves its frequencies to
    ``torch.cuda.current_device()`` in ``get_emb``, so RoPE models need a GPU in 0.16.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from graft.adapters.megatron import get_gpt_layer_graft_spec

    config = _config(num_layers=2)
    kwargs = dict(vocab_size=96, max_sequence_length=32, position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    local = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kwargs)
    grafted = GPTModel(config, transformer_layer_spec=get_gpt_layer_graft_spec(normalization="RMSNorm"), **kwargs)
    grafted.load_state_dict(local.state_dict(), strict=True)
    tokens = torch.randint(0, 96, (2, 11))
    positions = torch.arange(11).expand(2, -1)
    labels = torch.randint(0, 96, (2, 11))
    loss_ref = local(tokens, positions, attention_mask=_causal_mask(11), labels=labels)
    loss_graft = grafted(tokens, positions, attention_mask=None, labels=labels)
    assert loss_graft.shape == (2, 11)
    torch.testing.assert_close(loss_graft, loss_ref, rtol=1e-5, atol=1e-5)
    loss_ref.mean().backward()
    loss_graft.mean().backward()
    for name, p in local.named_parameters():
        q = dict(grafted.named_parameters())[name]
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")

    def served(op):
        return sum(n for k, n in calls.items() if k.startswith(op + ":"))

    # Per layer: 2 norms, 4 linears (qkv, proj, fc1, fc2), 1 attention; the final norm and
    # the embedding/output layers are the GPTModel's own.
    assert (served("fused.rms_norm"), served("gemm.linear"), served("attention.prefill")) == (4, 8, 2), dict(calls)


def test_causal_mask_is_served_and_other_masks_fall_back(megatron_cpu, calls, caplog):
    """Megatron passes the causal mask tensor with the causal mask type: graft serves it. Any
    other mask (here causal plus a padded last key) goes to Megatron's own attention."""
    local, grafted = _build_pair(_config())
    x = torch.randn(5, 1, HIDDEN)
    padded = _causal_mask(5).clone()
    padded[..., 4] = True
    caplog.set_level(logging.INFO, logger="graft.integration.megatron")
    with torch.no_grad():
        out_ref, _ = local(x, attention_mask=_causal_mask(5))
        out_graft, _ = grafted(x, attention_mask=_causal_mask(5))
        torch.testing.assert_close(out_graft, out_ref, rtol=1e-4, atol=1e-5)
        assert calls["attention.prefill:triton"] == 1 and not calls["fallback.GraftDotProductAttention"], dict(calls)
        pad_ref, _ = local(x, attention_mask=padded)
        pad_graft, _ = grafted(x, attention_mask=padded)
        grafted(x, attention_mask=padded)  # the same reason again: counted, not logged again
    torch.testing.assert_close(pad_graft, pad_ref, rtol=1e-4, atol=1e-5)
    assert calls["fallback.GraftDotProductAttention"] == 2
    # The rest of the layer was still graft's.
    served = {key.split(":")[0] for key in calls if not key.startswith("fallback.")}
    assert {"fused.rms_norm", "gemm.linear"} <= served, dict(calls)
    logged = [r.getMessage() for r in caplog.records if r.name == "graft.integration.megatron"]
    assert logged == ["graft did not serve GraftDotProductAttention (explicit attention_mask); megatron's own code "
                      "ran it"], logged
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "graft.integration.megatron")


def test_call_counter_is_torch_compile_safe(calls, caplog):
    """Counting and fallback logging inside a compiled region: no graph break, recorded on every run."""
    from graft.adapters.megatron.integration import counter

    caplog.set_level(logging.INFO, logger="graft.integration.megatron")

    def fn(x):
        counter.count("probe:compiled")
        counter.fallback("Probe", "traced reason")
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for _ in range(3):
        torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert calls["probe:compiled"] == 3 and calls["fallback.Probe"] == 3, dict(calls)
    logged = [r.getMessage() for r in caplog.records if r.name == "graft.integration.megatron"]
    assert logged == ["graft did not serve Probe (traced reason); megatron's own code ran it"], logged
    counter.reset()
    assert not calls
    compiled(torch.ones(3))  # reset forgets what was logged, too
    assert calls["fallback.Probe"] == 1 and len([r for r in caplog.records if r.name == "graft.integration.megatron"]) == 2


def test_packed_sequences_match_per_sequence_attention(megatron_cpu, calls):
    """thd packing (which Megatron's local attention rejects) equals attending each sequence alone."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from graft.adapters.megatron.modules import GraftDotProductAttention

    core = GraftDotProductAttention(_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self")
    head_dim = HIDDEN // HEADS
    lengths = [3, 7, 1]
    q = torch.randn(sum(lengths), 1, HEADS, head_dim)
    k = torch.randn(sum(lengths), 1, GROUPS, head_dim)
    v = torch.randn(sum(lengths), 1, GROUPS, head_dim)
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    out = core(q, k, v, None, packed_seq_params=packed)
    assert out.shape == (11, 1, HIDDEN)
    for start, n in zip([0, 3, 10], lengths):
        alone = core(q[start:start + n], k[start:start + n], v[start:start + n], None)
        torch.testing.assert_close(out[start:start + n], alone, rtol=1e-5, atol=1e-6)
    # Independent check of one sequence against plain softmax attention.
    qs, ks, vs = q[3:10, 0], k[3:10, 0].repeat_interleave(2, 1), v[3:10, 0].repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", qs, ks) / head_dim**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(7, 7, dtype=torch.bool), 1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).reshape(7, HIDDEN)
    torch.testing.assert_close(out[3:10, 0], expected, rtol=1e-5, atol=1e-6)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_token_dispatcher_type="allgather")


def test_moe_experts_match_sequential_mlp(megatron_cpu, calls):
    from graft.adapters.megatron.modules import GraftColumnParallelLinear, GraftSequentialMLP

    local, grafted = _build_pair(_config(**MOE), num_experts=4)
    experts = grafted.mlp.experts
    assert isinstance(experts, GraftSequentialMLP)
    assert isinstance(experts.local_experts[0].linear_fc1, GraftColumnParallelLinear)
    assert type(local.mlp.experts).__name__ == "SequentialMLP"

    tokens_per_expert = torch.tensor([3, 0, 6, 2])  # one expert gets no token
    hidden = torch.randn(11, HIDDEN)
    probs = torch.rand(11)
    h_ref, h_graft = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out_ref, bias_ref = local.mlp.experts(h_ref, tokens_per_expert, probs)
    out_graft, bias_graft = experts(h_graft, tokens_per_expert, probs)
    assert bias_ref is None and bias_graft is None
    torch.testing.assert_close(out_graft, out_ref, rtol=1e-4, atol=1e-5)
    out_ref.sum().backward()
    out_graft.sum().backward()
    torch.testing.assert_close(h_graft.grad, h_ref.grad, rtol=1e-4, atol=1e-5)
    w_ref = local.mlp.experts.local_experts[2].linear_fc1.weight.grad
    w_graft = experts.local_experts[2].linear_fc1.weight.grad
    torch.testing.assert_close(w_graft, w_ref, rtol=1e-4, atol=1e-5)
    assert any(k.startswith("moe.fused_experts:") for k in calls), dict(calls)


@pytest.mark.gpu
def test_moe_layer_matches_local_spec_gpu(megatron_cpu, calls, device):
    if device.type != "cuda":
        pytest.skip("Megatron's MoE router moves its weight to CUDA: the full MoE layer needs a GPU")
    local, grafted = _build_pair(_config(**MOE), num_experts=4)
    local, grafted = local.to(device), grafted.to(device)
    x = torch.randn(9, 2, HIDDEN, device=device)
    _MemoryBufferOn.device = device
    try:
        with torch.no_grad():
            out_ref, _ = local(x, attention_mask=None)
            out_graft, _ = grafted(x, attention_mask=None)
    finally:
        _MemoryBufferOn.device = torch.device("cpu")
    torch.testing.assert_close(out_graft, out_ref, rtol=1e-3, atol=1e-4)
    assert any(k.startswith("moe.fused_experts:") for k in calls), dict(calls)


def test_env_var_off_gives_megatron_local_spec(megatron_cpu, calls, monkeypatch):
    from megatron.core.transformer.spec_utils import build_module

    from graft.adapters.megatron import get_gpt_layer_graft_spec

    monkeypatch.setenv("GRAFT_MEGATRON", "0")
    layer = build_module(get_gpt_layer_graft_spec(normalization="RMSNorm"), config=_config(), layer_number=1)
    assert not [m for m in layer.modules() if type(m).__module__.startswith("graft.")]
    assert type(layer.self_attention.linear_qkv).__name__ == "ColumnParallelLinear"


def test_parts_whose_ops_are_disabled_use_megatrons_local_modules(megatron_cpu, calls, monkeypatch, caplog):
    from megatron.core.transformer.spec_utils import build_module

    from graft.adapters.megatron import get_gpt_layer_graft_spec
    from graft.adapters.megatron.integration import integration

    monkeypatch.setenv("GRAFT_DISABLE", "fused.rms_norm,attention.prefill")
    ok, why = integration().status()
    assert ok and "left to megatron-core: norm (fused.rms_norm is disabled" in why and "attention (" in why, why
    with caplog.at_level("WARNING", logger="graft.integration.megatron"):
        layer = build_module(get_gpt_layer_graft_spec(normalization="RMSNorm"), config=_config(), layer_number=1)
    assert "megatron's norm stays megatron's own code" in caplog.text
    assert not type(layer.input_layernorm).__module__.startswith("graft.")
    assert type(layer.self_attention.core_attention).__name__ == "DotProductAttention"
    assert type(layer.self_attention.linear_qkv).__name__ == "GraftColumnParallelLinear"  # still graft's
    x = torch.randn(5, 2, layer.config.hidden_size)
    out, _ = layer(x, attention_mask=_causal_mask(5))  # Megatron's own attention takes the mask
    assert out.shape == x.shape and torch.isfinite(out).all()
    monkeypatch.setenv("GRAFT_DISABLE", "moe")
    moe = build_module(get_gpt_layer_graft_spec(num_experts=4), config=_config(num_moe_experts=4), layer_number=1)
    assert type(moe.mlp.experts).__name__ == "SequentialMLP", type(moe.mlp.experts)


def test_unsupported_version_is_a_clear_error(fresh_graft, monkeypatch):
    from graft.adapters.megatron import get_gpt_layer_graft_spec
    activation = importlib.import_module("graft.adapters.megatron.integration")  # the module (the package exports a function of that name)

    monkeypatch.setattr(activation, "SUPPORTED", ">=0.17,<0.18")
    with pytest.raises(GraftError, match=r"does not support this version: megatron-core 0\.16\.\d+ is outside"):
        get_gpt_layer_graft_spec()


def test_integration_is_declared(fresh_graft):
    from graft.integration import integrations

    (integ,) = [i for i in integrations() if i.name == "megatron"]
    assert integ.env_var == "GRAFT_MEGATRON"
    assert integ.status()[0], integ.status()
    assert integ.activate() is True


def test_status_command_and_switch(fresh_graft):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    on = subprocess.run([sys.executable, "-m", "graft.adapters.megatron"], env=env, capture_output=True, text=True,
                        timeout=180)
    assert on.returncode == 0, on.stderr[-3000:]
    assert "graft Megatron-core integration: active" in on.stdout
    assert "self_attention.core_attention" in on.stdout and "GraftDotProductAttention" in on.stdout
    assert "mlp.experts" in on.stdout and "GraftSequentialMLP" in on.stdout
    off = subprocess.run([sys.executable, "-m", "graft.adapters.megatron"], env=dict(env, GRAFT_MEGATRON="0"),
                         capture_output=True, text=True, timeout=180)
    assert off.returncode == 0, off.stderr[-3000:]
    assert "graft Megatron-core integration: off (GRAFT_MEGATRON=0)" in off.stdout
