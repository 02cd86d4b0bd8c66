"""Megatron's output layer + loss on loss.fused_linear_cross_entropy (GraftGPTModel, opt-in):
per-token losses and the gradients of the output weight and hidden states match the unfused
GPTModel in fp32, the call is counted as served, no [tokens, vocab] tensor is ever created
(torch backend and Triton, interpreted), and where it cannot apply Megatron's path runs with
the reason logged."""
import logging

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_integration import _causal_mask, _config, megatron_cpu  # noqa: E402,F401  (fixture)

# T = SEQ * BATCH = 96 tokens, VOCAB = 112: the op's chunks of logits are at most 64 x VOCAB
# (VOCAB differs from every other width of the model, so only logits are vocabulary-wide).
VOCAB, SEQ, BATCH = 112, 48, 2


@pytest.fixture
def calls(fresh_graft):
    from graft.adapters.megatron.integration import counter

    counter.reset()
    return counter.calls


def _models(fused_loss=True, share=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from graft.adapters.megatron import GraftGPTModel, get_gpt_layer_graft_spec

    config = _config(num_layers=1)
    kwargs = dict(vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="learned_absolute",
                  share_embeddings_and_output_weights=share)
    torch.manual_seed(0)
    local = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kwargs)
    fused = GraftGPTModel(config, transformer_layer_spec=get_gpt_layer_graft_spec(), fused_loss=fused_loss, **kwargs)
    fused.load_state_dict(local.state_dict(), strict=True)
    return local, fused


def _batch():
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).expand(BATCH, -1), labels


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest vocabulary-wide tensor (last dim VOCAB: logits or a chunk of them)
    any op creates."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("backends", ["torch", "triton,torch"])
@pytest.mark.parametrize("share", [False, True], ids=["separate_output_weight", "shared_embedding"])
def test_fused_output_loss_matches_megatron_and_never_holds_the_logits(megatron_cpu, calls, backends, share):
    import graft

    local, fused = _models(share=share)
    tokens, positions, labels = _batch()
    hidden = {}
    # The output layer's input: the hidden states whose gradient the fused loss produces.
    def keep(name):
        def hook(module, args, out):
            out.retain_grad()
            hidden[name] = out
        return hook

    for name, model in (("local", local), ("fused", fused)):
        model.decoder.final_layernorm.register_forward_hook(keep(name))
    loss_ref = local(tokens, positions, attention_mask=_causal_mask(SEQ), labels=labels)
    loss_ref.mean().backward()
    with graft.override_config(GRAFT_BACKENDS=backends), _LargestTensor() as mode:
        loss = fused(tokens, positions, attention_mask=None, labels=labels)
        loss.mean().backward()
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32
    # fp32: the op's fp32 log-sum-exp against Megatron's vocab_parallel_cross_entropy.
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden["fused"].grad, hidden["local"].grad, rtol=1e-4, atol=1e-6)
    weight = "embedding.word_embeddings.weight" if share else "output_layer.weight"
    params = dict(fused.named_parameters())
    for name, p in local.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
    assert params[weight].grad.abs().sum() > 0
    backend = backends.split(",")[0]
    assert calls[f"loss.fused_linear_cross_entropy:{backend}"] == 1, dict(calls)
    assert not [k for k in calls if k.startswith("fallback.")], dict(calls)
    assert mode.largest < BATCH * SEQ * VOCAB, f"a tensor of {mode.largest} elements: the logits were materialised"


def test_without_labels_megatron_returns_logits_with_the_reason_logged(megatron_cpu, calls, caplog):
    local, fused = _models()
    tokens, positions, _ = _batch()
    with caplog.at_level(logging.INFO, logger="graft.integration.megatron"):
        logits = fused(tokens, positions, attention_mask=None)
    torch.testing.assert_close(logits, local(tokens, positions, attention_mask=_causal_mask(SEQ)),
                               rtol=1e-5, atol=1e-5)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert calls["fallback.fused_output_loss"] == 1 and "no labels" in caplog.text, dict(calls)


def test_option_off_is_megatrons_output_layer(megatron_cpu, calls):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from graft.adapters.megatron.output_loss import GraftOutputLayer

    local, plain = _models(fused_loss=False)
    assert type(plain.output_layer) is ColumnParallelLinear
    tokens, positions, labels = _batch()
    torch.testing.assert_close(plain(tokens, positions, attention_mask=None, labels=labels),
                               local(tokens, positions, attention_mask=_causal_mask(SEQ), labels=labels),
                               rtol=1e-5, atol=1e-6)
    assert not [k for k in calls if k.startswith("loss.")], dict(calls)
    _, on = _models(fused_loss=True)
    assert type(on.output_layer) is GraftOutputLayer


def test_env_var_turns_it_on(megatron_cpu, calls):
    import graft

    with graft.override_config(GRAFT_MEGATRON_FUSED_LOSS="1"):
        _, fused = _models(fused_loss=None)
    assert fused.fused_loss
    _, default = _models(fused_loss=None)
    assert not default.fused_loss


def test_what_it_cannot_serve_is_refused_with_a_reason(megatron_cpu):
    """Under tensor parallelism the output layer is vocab-parallel: the fused loss refuses it
    (Megatron's vocab_parallel_cross_entropy runs), as it does sequence parallelism and the
    other features named in adapters/megatron/output_loss.py."""
    from graft.adapters.megatron.output_loss import static_reason

    assert static_reason(_config(), 1) is None
    assert "tensor parallel size 2" in static_reason(_config(), 2)
    assert static_reason(_config(gradient_accumulation_fusion=False, mtp_num_layers=1), 1) == "multi-token prediction"
    config = _config()
    config.sequence_parallel = True
    assert static_reason(config, 1) == "sequence parallelism"
