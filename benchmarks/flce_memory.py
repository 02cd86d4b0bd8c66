"""Memory of ``loss.fused_linear_cross_entropy`` (graft's chunked Triton op) against the unfused
path (logits = x @ W.T, then cross-entropy), forward + backward, same inputs, same process.

    python benchmarks/flce_memory.py [--tokens 4096 --hidden 4096 --vocab 128256 --dtype bfloat16]
    python benchmarks/flce_memory.py --megatron [--tokens 512 --hidden 64 --vocab 32000 --dtype float32]

``--megatron`` compares a whole Megatron GPTModel training step (1 layer, TP1, ``tokens`` = batch 2 x
seq ``tokens / 2``) built as ``graft.adapters.megatron.GraftGPTModel`` with its fused output loss
on and off (off: Megatron's output layer and ``vocab_parallel_cross_entropy``), same weights.

On a GPU it reports ``torch.cuda.max_memory_allocated`` above the inputs for each path (and the
median time of 5 interleaved runs, as a ratio). On the CPU (Triton interpreted: use small
sizes) it reports the largest single tensor each path allocates, recorded by a dispatch mode:
the logits-sized buffer is exactly what the fused op avoids. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestAllocation(TorchDispatchMode):
    """Largest tensor (bytes) any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def inputs(tokens, hidden, vocab, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return x, w, target


def unfused(x, w, target):
    logits = x @ w.t()
    return torch.nn.functional.cross_entropy(logits.float(), target)


def fused(x, w, target):
    from graft.ops.loss import fused_linear_cross_entropy

    return fused_linear_cross_entropy(x, w, target)


def measure(fn, args, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*args).backward()
        torch.cuda.synchronize()
        return {"peak_bytes_above_inputs": torch.cuda.max_memory_allocated() - base}
    with LargestAllocation() as mode:
        fn(*args).backward()
    return {"largest_tensor_bytes": mode.largest}


def megatron_models(tokens, hidden, vocab, dtype, device):
    """(unfused, fused) GraftGPTModel pair with the same weights, and the step's inputs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from graft.adapters.megatron import GraftGPTModel, get_gpt_layer_graft_spec

    seq = tokens // 2
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=hidden * 2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        params_dtype=dtype)
    kwargs = dict(vocab_size=vocab, max_sequence_length=seq, position_embedding_type="learned_absolute")
    torch.manual_seed(0)
    spec = get_gpt_layer_graft_spec()
    unfused_model = GraftGPTModel(config, transformer_layer_spec=spec, fused_loss=False, **kwargs).to(device)
    fused_model = GraftGPTModel(config, transformer_layer_spec=spec, fused_loss=True, **kwargs).to(device)
    fused_model.load_state_dict(unfused_model.state_dict())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=gen).to(device)
    labels = torch.randint(0, vocab, (2, seq), generator=gen).to(device)
    positions = torch.arange(seq, device=device).expand(2, -1)

    def step(model):
        return lambda: model(ids, positions, attention_mask=None, labels=labels).mean()

    return step(unfused_model), step(fused_model)


def main_megatron(a, device, dtype):
    import torch.distributed as dist

    from graft.adapters.megatron import stats
    from graft.tools.bench.megatron_step import model_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    with model_parallel(1):
        unfused_step, fused_step = megatron_models(a.tokens, a.hidden, a.vocab, dtype, device)
        result = {"model": "Megatron GPTModel, 1 layer, TP1", "tokens": a.tokens, "hidden": a.hidden,
                  "vocab": a.vocab, "dtype": a.dtype, "device": str(device),
                  "logits_bytes": a.tokens * a.vocab * torch.finfo(dtype).bits // 8}
        losses = {}
        for name, step in (("unfused", unfused_step), ("fused", fused_step)):
            stats.reset()
            result[name] = measure(lambda: _keep(losses, name, step()), (), device)
            result[name]["served"] = graft_served(stats)
    key = next(k for k in result["fused"] if k != "served")
    result["memory_ratio_unfused_over_fused"] = result["unfused"][key] / max(result["fused"][key], 1)
    result["loss"] = {k: float(v) for k, v in losses.items()}
    print(json.dumps(result, indent=1))
    return result


def _keep(store, name, loss):
    store[name] = loss.detach()
    return loss


def graft_served(stats):
    return {k: v for k, v in stats.calls.items() if k.startswith(("loss.", "fallback."))}


def timed(fn, args, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--megatron", action="store_true", help="a Megatron GPTModel step, fused output loss on vs off")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import graft

    graft.get_registry()
    dtype = getattr(torch, a.dtype)
    if a.megatron:
        return main_megatron(a, device, dtype)
    args = inputs(a.tokens, a.hidden, a.vocab, dtype, device)
    result = {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "dtype": a.dtype, "device": str(device),
              "logits_bytes": a.tokens * a.vocab * torch.finfo(dtype).bits // 8}
    result["unfused"] = measure(unfused, args, device)
    result["fused"] = measure(fused, args, device)
    key = next(iter(result["fused"]))
    result["memory_ratio_unfused_over_fused"] = result["unfused"][key] / max(result["fused"][key], 1)
    if device.type == "cuda":
        times = {"unfused": [], "fused": []}
        for _ in range(5):  # interleaved
            for name, fn in (("unfused", unfused), ("fused", fused)):
                times[name].append(timed(fn, args, device))
        result["median_s"] = {k: statistics.median(v) for k, v in times.items()}
        result["speedup_fused_vs_unfused"] = result["median_s"]["unfused"] / result["median_s"]["fused"]
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
