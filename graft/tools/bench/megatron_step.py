"""Megatron-core GPTModel training steps, graft's layer spec against Megatron's local spec,
at tensor-parallel size 1 and 2, both models in the same processes, steps interleaved.

On a CPU-only torch Megatron 0.16's local core attention allocates its score buffer and
forks its dropout RNG on CUDA: like the tests, the bench installs CPU stand-ins for those
two (dropout is 0) and gives the local model an explicit causal mask; RoPE needs CUDA, so
positions are learned.
"""
from __future__ import annotations

import contextlib

import torch

from graft.tools.bench.timing import framework_steps

HIDDEN, HEADS, GROUPS, FFN, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 96, 2, 96, 32, 2


class _CpuMemoryBuffer:
    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(*shape, dtype=dtype)


class _NoForkRngTracker:
    def fork(self, name=None):
        return contextlib.nullcontext()

    def is_initialized(self):
        return True


@contextlib.contextmanager
def model_parallel(tp: int):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.initialize_model_parallel(tp, 1)
    saved = (parallel_state._GLOBAL_MEMORY_BUFFER, mrandom._CUDA_RNG_STATE_TRACKER,
             mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    mrandom._CUDA_RNG_STATE_TRACKER = _NoForkRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        yield
    finally:
        (parallel_state._GLOBAL_MEMORY_BUFFER, mrandom._CUDA_RNG_STATE_TRACKER,
         mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED) = saved
        parallel_state.destroy_model_parallel()


def build_pair(tp: int):
    """(local-spec GPTModel, graft-spec GPTModel) with the same weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from graft.adapters.megatron import get_gpt_layer_graft_spec

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, tensor_model_parallel_size=tp)
    kwargs = dict(vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    local = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kwargs)
    grafted = GPTModel(config, transformer_layer_spec=get_gpt_layer_graft_spec(normalization="RMSNorm"), **kwargs)
    grafted.load_state_dict(local.state_dict(), strict=True)
    return local, grafted


def batch():
    gen = torch.Generator().manual_seed(7)  # the same on every rank: TP ranks share their input
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, positions, labels, mask


def train_step(model, mask, tokens, positions, labels) -> float:
    loss = model(tokens, positions, attention_mask=mask, labels=labels).mean()
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.item()


def measure(tps, rounds: int, progress=print) -> list:
    import torch.distributed as dist

    from graft.adapters.megatron.integration import counter

    tokens, positions, labels, mask = batch()
    rows = []
    for tp in tps:
        with model_parallel(tp):
            local, grafted = build_pair(tp)
            losses: dict[str, list] = {"local": [], "graft": []}
            steps = {"local": lambda: losses["local"].append(train_step(local, mask, tokens, positions, labels)),
                     "graft": lambda: losses["graft"].append(train_step(grafted, None, tokens, positions, labels))}
            row = {"tp": tp, **framework_steps(steps, losses, counter.calls, rounds, "local", sync=dist.barrier)}
        progress(f"  megatron GPTModel TP{tp} step: local spec {row['local_ms']:7.2f} ms, graft spec "
                 f"{row['graft_ms']:7.2f} ms -> {row['ratio']:.2f}x")
        rows.append(row)
    return rows
