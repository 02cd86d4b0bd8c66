"""Megatron GPTModel with graft's layer spec at tensor parallel 1 and 2 (gloo ranks on the
CPU, Triton interpreted) against the local spec, same seed and weights: losses identical
in fp32, gradients close, and graft serving (counted) the norms, the attention and the
linears (row- and column-parallel, the latter on Megatron's allreduce_dgrad path under TP>1),
with no torch reference recomputed."""
from __future__ import annotations

import pytest
import torch

from _dist_helpers import run_ranks

pytest.importorskip("megatron.core")

HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 32, 4, 2, 48, 64, 8


def _gpt_pair_rank(rank, world_size):
    import contextlib

    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    from graft.adapters.megatron import counter, get_gpt_layer_graft_spec

    class _Buffer:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(*shape, dtype=dtype)

    class _Tracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

        def is_initialized(self):
            return True

    parallel_state.initialize_model_parallel(world_size, 1)
    parallel_state._GLOBAL_MEMORY_BUFFER = _Buffer()
    mrandom._CUDA_RNG_STATE_TRACKER = _Tracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=FFN,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, tensor_model_parallel_size=world_size)
    kwargs = dict(vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    local = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kwargs)
    grafted = GPTModel(config, transformer_layer_spec=get_gpt_layer_graft_spec(), **kwargs)
    grafted.load_state_dict(local.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    positions = torch.arange(SEQ)[None]
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    loss_ref = local(tokens, positions, attention_mask=mask, labels=labels)
    counter.reset()
    loss_graft = grafted(tokens, positions, attention_mask=mask, labels=labels)
    loss_ref.mean().backward()
    loss_graft.mean().backward()
    grad_err = max(float((dict(grafted.named_parameters())[n].grad - p.grad).abs().max() / p.grad.abs().max())
                   for n, p in local.named_parameters())
    parallel_state.destroy_model_parallel()
    # plain Python values: tensors sent through the result queue would outlive their process's memory
    return loss_ref.detach().tolist(), loss_graft.detach().tolist(), grad_err, dict(counter.calls)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpt_model_graft_spec_matches_local_spec_under_tp(world_size):
    env = {"GRAFT_DISABLE_PLUGINS": "hip,vllm,deepspeed", "TRITON_INTERPRET": "1"}
    results = run_ranks(_gpt_pair_rank, world_size, timeout=240, env=env)
    for loss_ref, loss_graft, grad_err, calls in results:
        torch.testing.assert_close(torch.tensor(loss_graft), torch.tensor(loss_ref), rtol=1e-5, atol=1e-6)
        assert grad_err < 1e-4, grad_err

        def served(op):
            return sum(n for k, n in calls.items() if k.startswith(op + ":triton"))

        # one layer: 2 norms, 1 attention, 2 row-parallel and 2 column-parallel linears
        assert served("fused.rms_norm") == 2 and served("attention.prefill") == 1, calls
        assert served("gemm.linear") >= 4, calls
        assert "fallback.reference_backward" not in calls and "fallback.GraftDotProductAttention" not in calls, calls
