"""Memory of ``loss.fused_linear_cross_entropy`` (graft's chunked Triton op) against the unfused
path (logits = x @ W.T, then cross-entropy), forward + backward, same inputs, same process.

    python benchmarks/flce_memory.py [--tokens 4096 --hidden 4096 --vocab 128256 --dtype bfloat16]

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
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import graft

    graft.get_registry()
    dtype = getattr(torch, a.dtype)
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
