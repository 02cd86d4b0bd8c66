"""GPU kernel benchmark over model shapes, each graft kernel against the library baseline it
replaces, measured in the same run (``ci/gpu_bench.sh``; ``graft bench-kernels``)::

    python -m graft.tools.bench.kernels --device cuda --out benchmarks         # one H200: < 8 minutes
    python -m graft.tools.bench.kernels --device cpu --quick --backends torch  # tiny shapes: the logic only

Families and shapes (from the kernels' target models):

* ``gemm``: (N, K) of Llama-3-8B and Llama-3-70B/TP8 projections at M in {1, 16, 64, 128,
  512, 4096, 8192}: ``gemm.linear`` bf16 vs ``torch.matmul`` (cuBLAS), ``gemm.w8a8`` vs
  ``torch._int_mm`` + scales, ``gemm.fp8`` (per tensor) vs ``torch._scaled_mm``, ``gemm.fp8``
  (128x128 blocks) vs ``torch._scaled_mm`` row-wise, ``gemm.w4a16`` vs bf16 cuBLAS on the
  dense weight;
* ``prefill``: 32 query / 8 KV heads, d=128, causal, ragged 512..32k per sequence, vs SDPA's
  flash and cuDNN backends (one call per sequence: SDPA has no varlen form);
* ``decode``: paged decode at batch {1, 8, 64, 256} x context {1k, 4k, 32k}, vs SDPA on a
  contiguous cache; and the fp8 (e4m3) KV cache at the same shapes vs graft's bf16-cache
  decode (the bytes a decode step reads halve);
* ``prefill_paged``: chunks of new tokens after a cached context (chunked prefill, prefix
  caching), 32/8 heads, d=128, block size 16, scattered pages: ``attention.prefill_paged``
  (K/V read through the block table) vs vLLM-style gather of the pages into a contiguous
  K/V followed by graft's ``attention.prefill`` (both timed), and vs SDPA flash with a
  bottom-right causal mask on an already contiguous K/V (the gather not timed);
* ``moe``: Mixtral (8 experts, top-2, 4096/14336) and DeepSeek-V3 (256, top-8, 7168/2048)
  at T in {1, 64, 1024, 8192}, vs a loop over experts and a dense all-experts bf16 MoE;
* ``fused``: rms_norm / silu_and_mul / rotary at T in {1, 256, 4096, 16384} x H in {4096,
  7168, 8192}, vs ``F.rms_norm`` and eager torch.

Timing: inputs are built on the device; each implementation is warmed up (Triton compiles
there), then ``inner`` calls are captured in one CUDA graph (eager where capture is
impossible, e.g. a baseline with host syncs, noted per result) and the implementations of
a case are replayed in interleaved rounds; the median over rounds per call is reported,
and ratios are baseline median / graft median (> 1: graft is faster). Value checks are
off (``GRAFT_CHECK_VALUES=0``): each one is a device sync. Every case runs in try/except
(its error recorded), and each finished case prints one progress line.

Roofline: each case carries the bytes and FLOPs it must move; on a target of
:data:`ROOFLINES` (from the GPU's name or ``--target``) its ideal time is the larger of
bytes / peak bandwidth and FLOPs / peak MMA rate (8-bit cases at the 8-bit rate), and every
timed implementation gets its "fraction of the limit" (ideal / measured) beside the ratio.

Order and budget: cases run by tier (0: per family the most informative, then 1, then 2),
families taking turns inside a tier; a case starts only when its family's longest case so
far still fits ``--budget-s`` (the rest are recorded as skipped). The report holds the whole
plan from the start (``pending`` until run) and is rewritten after every case, by write and
rename; SIGTERM/SIGINT mark the case in flight ``killed`` and write it before exiting.
Writes ``kernels-<tag>.json`` and ``.html``; ``--dry-run`` prints the plan.

A case that breaks the process cannot take the rest of the run with it: a sticky device error
(an illegal address poisons the CUDA context for every later case) or a case still running
after ``--case-timeout-s`` (a hung kernel) is recorded (error / killed, with the reason), the
report written, and the process exits with :data:`EXIT_RESUME`; ``ci/gpu_bench.sh`` then
starts it again with ``--resume``, which keeps every finished case of the report and runs
the rest.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from graft.tools.bench import timing
from graft.tools.bench.timing import TARGET_GRAPH_S, clock as _clock, prepare, sync as _sync  # noqa: F401 - re-exported

LLAMA_8B_NK = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
LLAMA_70B_TP8_NK = ((1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584))
GEMM_M = (1, 16, 64, 128, 512, 4096, 8192)
PREFILL_LENS = {  # name -> per-sequence lengths (ragged where there are several)
    "ragged_4k": (512, 1024, 2560), "ragged_16k": (1024, 3072, 4096, 8192), "single_8k": (8192,),
    "ragged_32k": (512, 7680, 8192, 16384), "single_32k": (32768,),
}
PREFILL_PAGED = {  # name -> (new tokens, cached context) per sequence
    "chunk2k_ctx6k": ((2048,), (6144,)), "b4_q512_ctx4k": ((512,) * 4, (4096,) * 4),
    "b8_q128_ctx16k": ((128,) * 8, (16384,) * 8), "ragged_prefix": ((1024, 256, 2048, 64), (0, 8192, 2048, 30000)),
}
DECODE_BATCH = (1, 8, 64, 256)
DECODE_CTX = (1024, 4096, 32768)
MOE_MODELS = {"mixtral": (8, 2, 4096, 14336), "deepseek_v3": (256, 8, 7168, 2048)}  # E, top_k, H, I
MOE_T = (1, 64, 1024, 8192)
FUSED_T = (1, 256, 4096, 16384)
FUSED_H = (4096, 7168, 8192)

# Roofline per target: (HBM bytes/s, dense MMA FLOP/s per operand class). The 8-bit classes
# (fp8, int8) run twice the 16-bit rate on both. Vendor peak figures: a kernel's "fraction
# of the limit" is its ideal time (bytes at full bandwidth or FLOPs at full MMA rate, the
# larger) over its measured time.
ROOFLINES: dict[str, dict[str, Any]] = {
    "h200": {"bandwidth": 4.8e12, "flops": {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}},
    "mi300x": {"bandwidth": 5.3e12, "flops": {"bf16": 1307e12, "fp8": 2615e12, "int8": 2615e12}},
}
INT_MM_MIN_M = 17  # torch._int_mm (cuBLASLt / hipBLASLt int8) refuses M <= 16

DENSE_MOE_MAX_FLOPS = 2e14  # the dense all-experts baseline past this takes seconds per call
BASELINE_MAX_BYTES = 16 << 30  # skip a baseline whose extra inputs would take more memory
EXIT_RESUME = 75  # EX_TEMPFAIL: this process can go no further, a new one (--resume) can
FINISHED = ("ok", "error", "killed")  # statuses --resume keeps (a killed case is not tried twice)


@dataclass
class Case:
    family: str
    name: str
    params: dict
    build: Callable  # (device, dtype) -> (graft impls {label: fn}, baselines {label: fn})
    tier: int = 1  # tier 0 runs first, so a budget cut drops the tail, not whole families
    flops: float = 0.0
    bytes: float = 0.0
    mma: str = "bf16"  # operand class of the FLOPs (roofline): bf16 | fp8 | int8
    # False where the first baseline computes other numbers by design (a cost floor, e.g.
    # row-wise scales on block-quantised data): its difference would be read as an error
    compare_values: bool = True


@dataclass
class Result:
    family: str
    name: str
    params: dict
    status: str = "ok"  # ok | error | skipped (budget) | pending (not reached yet) | killed (stopped mid-case)
    note: str = ""
    timings: dict = field(default_factory=dict)  # label -> {"median_s", "mode", "inner", ...} or {"error"}
    ratios: dict = field(default_factory=dict)  # "graft_label vs baseline_label" -> baseline/graft
    value_check: dict = field(default_factory=dict)  # graft label -> max relative difference vs first baseline
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    tier: int = 1
    roofline: dict = field(default_factory=dict)  # target, ideal_s, bound, and per graft label the fraction of it
    memory: dict = field(default_factory=dict)  # GPU: peak allocated during the case, reserved after it (GiB)


# --------------------------------------------------------------------------- cases


def _gen(device):
    import torch

    return torch.Generator(device=device).manual_seed(0)


def _randn(shape, device, dtype, gen, scale=1.0):
    import torch

    return (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * scale).to(dtype)


def graft_impls(op: str, args: tuple, backends) -> dict:
    """``{"graft:<backend>": fn}`` for every registered implementation of ``op`` that can serve
    ``args`` here (``backends``: the ones to keep; None: all but the torch reference, which is
    kept only when nothing else serves)."""
    from graft import get_registry
    from graft.dispatch import key_tensor
    from graft.platform import device_info

    registry = get_registry()
    spec = registry.op(op)
    tensor = key_tensor(spec, args, {})
    assert tensor is not None, f"{op}: a benchmark case needs a tensor argument"
    device_type, dtype = tensor.device.type, tensor.dtype
    arch = device_info(tensor.device).arch if device_type == "cuda" else device_type
    found = {}
    for impl in registry.impls[op]:
        if backends is not None and impl.backend not in backends:
            continue
        if impl.static_reason(device_type, dtype, arch) is not None:
            continue
        if impl.check is not None and impl.check(*args) is not None:
            continue
        found[f"graft:{impl.backend}"] = (lambda fn: lambda: fn(*args))(impl.fn)
    if backends is None and len(found) > 1:
        found.pop("graft:torch", None)
    return found


def _gemm_cases(quick: bool, backends) -> list:
    shapes = [(64, 96)] if quick else list(LLAMA_8B_NK + LLAMA_70B_TP8_NK)
    ms = (1, 16, 33) if quick else GEMM_M

    def linear(m, n, k):
        def build(device, dtype):
            import torch

            gen = _gen(device)
            x, w = _randn((m, k), device, dtype, gen), _randn((n, k), device, dtype, gen, 1 / math.sqrt(k))
            return graft_impls("gemm.linear", (x, w, None, "none"), backends), {"torch.matmul": lambda: torch.matmul(x, w.t())}
        return build

    def w8a8(m, n, k):
        def build(device, dtype):
            import torch

            from graft import quant

            gen = _gen(device)
            x_q, xs = quant.quantize_per_token_int8(_randn((m, k), device, torch.float32, gen))
            w_q, ws = quant.quantize_per_channel_int8(_randn((n, k), device, torch.float32, gen))
            args = (x_q, w_q, xs, ws, None, dtype)
            wt = w_q.t()
            if m >= INT_MM_MIN_M:
                base = {"torch._int_mm+scales": lambda: (torch._int_mm(x_q, wt).float() * xs * ws).to(dtype)}
            else:
                # _int_mm refuses these M: what a framework does there is pad the rows (the copy
                # is part of its cost), or keep a bf16 copy of the weight
                rows = torch.zeros((32, k), device=device, dtype=torch.int8)
                w_bf16 = (w_q.float() * ws.reshape(n, 1)).to(dtype)
                x_bf16 = (x_q.float() * xs).to(dtype)

                def padded():
                    rows[:m].copy_(x_q)
                    return (torch._int_mm(rows, wt)[:m].float() * xs * ws).to(dtype)
                base = {"torch._int_mm(rows padded to 32)+scales": padded,
                        "torch.matmul(bf16 weight)": lambda: torch.matmul(x_bf16, w_bf16.t())}
            return graft_impls("gemm.w8a8", args, backends), base
        return build

    def fp8(m, n, k, blockwise):
        def build(device, dtype):
            import torch

            from graft import quant

            gen = _gen(device)
            x, w = _randn((m, k), device, torch.float32, gen), _randn((n, k), device, torch.float32, gen, 1 / math.sqrt(k))
            fmt = torch.float8_e4m3fnuz if _is_rocm() else torch.float8_e4m3fn
            if blockwise:
                (x_q, xs), (w_q, ws) = quant.quantize_fp8_per_token_group(x, dtype=fmt), quant.quantize_fp8_block(w, dtype=fmt)
                # the row-wise scaled_mm: the same fp8 MMA with scales applied once (its cost floor)
                row_xs = xs.amax(dim=1, keepdim=True)
                row_ws = ws.amax(dim=1).repeat_interleave(128)[:n].reshape(1, n).contiguous()
                base = {"torch._scaled_mm(rowwise)": lambda: torch._scaled_mm(
                    x_q, w_q.t(), scale_a=row_xs, scale_b=row_ws, out_dtype=dtype)}
            else:
                (x_q, xs), (w_q, ws) = quant.quantize_fp8_per_tensor(x, fmt), quant.quantize_fp8_per_tensor(w, fmt)
                xs0, ws0 = xs.reshape(()), ws.reshape(())
                base = {"torch._scaled_mm": lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=xs0, scale_b=ws0,
                                                                     out_dtype=dtype)}
            return graft_impls("gemm.fp8", (x_q, w_q, xs, ws, None, dtype), backends), base
        return build

    def w4a16(m, n, k, fmt="gptq"):
        def build(device, dtype):
            import torch

            from graft.quant import dequantize_int4, pack_int4

            gen = _gen(device)
            g = 128 if k % 128 == 0 else -1
            groups = 1 if g == -1 else k // g
            q = torch.randint(0, 16, (k, n), device=device, generator=gen, dtype=torch.int32)
            z = torch.randint(1, 16, (groups, n), device=device, generator=gen, dtype=torch.int32)
            qweight, qzeros = pack_int4(q, z, fmt)
            scales = _randn((groups, n), device, dtype, gen, 1 / (4 * math.sqrt(k))).abs()
            x = _randn((m, k), device, dtype, gen)
            w = dequantize_int4(q, z, scales.float(), g).t().contiguous().to(dtype)  # the same weight, dense
            args = (x, qweight, scales, qzeros, None, g, fmt)
            return graft_impls("gemm.w4a16", args, backends), {"torch.matmul(bf16 weight)": lambda: torch.matmul(x, w.t())}
        return build

    cases = []
    for n, k in shapes:
        for m in ms:
            # tier 0: per GEMM kind one decode M and one large M on the widest Llama-3-8B
            # projection; tier 1: the rest of the 8B shapes at the common M; tier 2: the rest
            big = (n, k) in ((28672, 4096), (64, 96))
            tier = 0 if big and m in (16, 4096, 33) else 1 if (n, k) in LLAMA_8B_NK + ((64, 96),) and m in (
                1, 16, 128, 4096) else 2
            flops, shape = 2.0 * m * n * k, dict(M=m, N=n, K=k)
            groups = k // 128 if k % 128 == 0 else 1
            for op, build, nbytes, mma in (
                ("linear_bf16", linear(m, n, k), 2 * (m * k + n * k + m * n), "bf16"),
                ("w8a8", w8a8(m, n, k), m * k + n * k + 2 * m * n + 4 * (m + n), "int8"),
                ("fp8_tensor", fp8(m, n, k, False), m * k + n * k + 2 * m * n, "fp8"),
                ("fp8_block", fp8(m, n, k, True), m * k + n * k + 2 * m * n + 4 * (m + -(-n // 128)) * groups, "fp8"),
                ("w4a16_gptq", w4a16(m, n, k), 2 * m * k + n * k / 2 + 2 * m * n + 2.5 * groups * n, "bf16"),
                # the same codes in graft's interleaved layout (K in blocks of 128: the Llama shapes)
                *((("w4a16_gptq_interleaved", w4a16(m, n, k, "gptq_interleaved"),
                    2 * m * k + n * k / 2 + 2 * m * n + 2.5 * groups * n, "bf16"),) if k % 128 == 0 else ()),
            ):
                cases.append(Case("gemm", f"{op}_m{m}_n{n}_k{k}", dict(shape, op=op), build, tier, flops, nbytes, mma,
                                  compare_values=op != "fp8_block"))
    return cases


def _sdpa_loop(q, k, v, lens, backend, causal=True):
    """One SDPA call per sequence (GQA heads expanded outside the timed region)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    views, start = [], 0
    for n in lens:
        views.append(tuple(t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
        start += n

    def run():
        with sdpa_kernel(which):
            return [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal) for a, b, c in views]
    return run


def _prefill_cases(quick: bool, backends) -> list:
    table = {"ragged_tiny": (16, 40, 24)} if quick else PREFILL_LENS
    hq, hkv, d = (4, 2, 64) if quick else (32, 8, 128)

    def build_for(lens):
        def build(device, dtype):
            import torch

            gen = _gen(device)
            total = sum(lens)
            q = _randn((total, hq, d), device, dtype, gen)
            k = _randn((total, hkv, d), device, dtype, gen)
            v = _randn((total, hkv, d), device, dtype, gen)
            cu = torch.tensor([0, *itertools_accumulate(lens)], dtype=torch.int32, device=device)
            args = (q, k, v, cu, cu, max(lens), max(lens), True, None)
            ke, ve = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
            base = {f"sdpa_{b}": _sdpa_loop(q, ke, ve, lens, b) for b in ("flash", "cudnn")}
            return graft_impls("attention.prefill", args, backends), base
        return build

    cases = []
    for name, lens in table.items():
        pairs = sum(n * (n + 1) // 2 for n in lens)
        tier = 0 if name in ("ragged_16k", "ragged_tiny") else 1 if name == "ragged_4k" else 2
        cases.append(Case("prefill", name, dict(seq_lens=list(lens), heads=f"{hq}/{hkv}", head_dim=d, causal=True),
                          build_for(lens), tier, 4.0 * pairs * hq * d, 2.0 * sum(lens) * (hq + 2 * hkv + hq) * d))
    return cases


def itertools_accumulate(values):
    total = 0
    for v in values:
        total += v
        yield total


def _prefill_paged_cases(quick: bool, backends) -> list:
    table = {"tiny": ((16, 40), (24, 7))} if quick else PREFILL_PAGED
    hq, hkv, d, block = (4, 2, 64, 16) if quick else (32, 8, 128, 16)

    def build_for(new, ctx):
        def build(device, dtype):
            import torch

            gen = _gen(device)
            seq = [n + c for n, c in zip(new, ctx)]
            per_seq = max(-(-s // block) for s in seq)
            num_blocks = len(seq) * per_seq
            kc = _randn((num_blocks, block, hkv, d), device, dtype, gen)
            vc = _randn((num_blocks, block, hkv, d), device, dtype, gen)
            tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32).reshape(len(seq), per_seq)
            q = _randn((sum(new), hq, d), device, dtype, gen)
            cu_q = torch.tensor([0, *itertools_accumulate(new)], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, *itertools_accumulate(seq)], dtype=torch.int32, device=device)
            lens = torch.tensor(seq, dtype=torch.int32, device=device)
            args = (q, kc, vc, tables, cu_q, lens, max(new), True, None)
            # vLLM's former path: the pages' tokens gathered by (block, slot), then varlen prefill.
            req = torch.repeat_interleave(torch.arange(len(seq), device=device), lens.long())
            pos = torch.cat([torch.arange(s, device=device) for s in seq])
            blocks, slots = tables[req, pos // block].long(), pos % block
            from graft import get_registry

            # Which attention.prefill implementations serve here (k/v stand-ins: only shapes matter).
            flat = graft_impls("attention.prefill", (q, kc[0], kc[0], cu_q, cu_k, max(new), max(seq), True, None),
                               backends)
            base = {}
            for impl in get_registry().impls["attention.prefill"]:
                if f"graft:{impl.backend}" in flat:
                    def gather_prefill(fn=impl.fn):
                        k, v = kc[blocks, slots], vc[blocks, slots]
                        return fn(q, k, v, cu_q, cu_k, max(new), max(seq), True, None)
                    base[f"gather+prefill(graft:{impl.backend})"] = gather_prefill
            k, v = kc[blocks, slots], vc[blocks, slots]
            ke, ve = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
            base["sdpa_flash(contiguous)"] = _sdpa_lower_right(q, ke, ve, new, seq)
            return graft_impls("attention.prefill_paged", args, backends), base
        return build

    cases = []
    for name, (new, ctx) in table.items():
        seq = [n + c for n, c in zip(new, ctx)]
        pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(new, ctx))
        tier = 0 if name in ("b4_q512_ctx4k", "tiny") else 2
        cases.append(Case("prefill_paged", name, dict(new=list(new), context=list(ctx), heads=f"{hq}/{hkv}",
                                                      head_dim=d, block_size=block, causal=True),
                          build_for(new, ctx), tier, 4.0 * pairs * hq * d,
                          2.0 * (sum(new) * 2 * hq + sum(seq) * 2 * hkv) * d))
    return cases


def _sdpa_lower_right(q, k, v, new, seq):
    """SDPA flash per sequence with a bottom-right causal mask (queries = the context's last tokens)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    views, qs, ks = [], 0, 0
    for n, s in zip(new, seq):
        views.append((q[qs:qs + n].transpose(0, 1).unsqueeze(0), k[ks:ks + s].transpose(0, 1).unsqueeze(0),
                      v[ks:ks + s].transpose(0, 1).unsqueeze(0), causal_lower_right(n, s)))
        qs, ks = qs + n, ks + s

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return [torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=m) for a, b, c, m in views]
    return run


def _decode_cases(quick: bool, backends) -> list:
    from graft.platform import dtype_name

    grid = [(2, 48), (3, 100)] if quick else [(b, c) for c in DECODE_CTX for b in DECODE_BATCH]
    hq, hkv, d, block = (4, 2, 64, 16) if quick else (32, 8, 128, 16)

    def build_for(batch, ctx):
        def build(device, dtype):
            import torch

            gen = _gen(device)
            per_seq = -(-ctx // block)
            num_blocks = batch * per_seq
            kc = _randn((num_blocks, block, hkv, d), device, dtype, gen)
            vc = _randn((num_blocks, block, hkv, d), device, dtype, gen)
            tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32).reshape(batch, per_seq)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            query = _randn((batch, hq, d), device, dtype, gen)
            args = (query, kc, vc, tables, lens, None, 0)
            base = {}
            if 2 * batch * ctx * hkv * d * kc.element_size() <= BASELINE_MAX_BYTES:
                # SDPA on a contiguous cache (the gather is not timed), GQA in the kernel
                def contiguous(cache, heads=hkv):
                    flat = cache[tables.long().reshape(-1)].reshape(batch, per_seq * block, hkv, d)[:, :ctx]
                    return flat.repeat_interleave(heads // hkv, dim=2).transpose(1, 2).contiguous()
                ks, vs, qs = contiguous(kc), contiguous(vc), query.unsqueeze(2)
                base = {f"sdpa_{b}": _sdpa_single(qs, ks, vs, b, gqa=True) for b in ("flash", "cudnn")}
                if 2 * batch * ctx * hq * d * kc.element_size() <= BASELINE_MAX_BYTES:  # where GQA is refused
                    ke, ve = contiguous(kc, hq), contiguous(vc, hq)
                    base["sdpa_flash(kv expanded)"] = _sdpa_single(qs, ke, ve, "flash")
            return graft_impls("attention.decode_paged", args, backends), base
        return build

    def build_fp8_for(batch, ctx):
        def build(device, dtype):
            import torch

            from graft.quant import fp8_max

            gen = _gen(device)
            per_seq = -(-ctx // block)
            num_blocks = batch * per_seq
            fp8 = torch.float8_e4m3fn  # vLLM's kv_cache_dtype="fp8" on NVIDIA (OCP e4m3)
            caches, scales = [], []
            for _ in range(2):
                cache = _randn((num_blocks, block, hkv, d), device, dtype, gen)
                scale = (cache.abs().amax().float() / fp8_max(fp8)).reshape(1)
                quantised = torch.empty(cache.shape, dtype=fp8, device=device)
                for i in range(0, num_blocks, 4096):  # chunks: no fp32 copy of a 30 GB cache
                    quantised[i:i + 4096] = (cache[i:i + 4096].float() / scale).to(fp8)
                caches.append((cache, quantised))
                scales.append(scale)
            (kc, kq), (vc, vq) = caches
            tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32).reshape(batch, per_seq)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            query = _randn((batch, hq, d), device, dtype, gen)
            args = (query, kq, vq, tables, lens, None, 0, scales[0], scales[1])
            bf16 = graft_impls("attention.decode_paged", (query, kc, vc, tables, lens, None, 0), backends)
            impls = graft_impls("attention.decode_paged", args, backends)
            return impls, {f"{label} {dtype_name(dtype)} cache": fn for label, fn in bf16.items()}
        return build

    cases = []
    for batch, ctx in grid:
        tier = 0 if (batch, ctx) in ((64, 4096), (2, 48)) else 1 if (batch, ctx) == (1, 4096) else 2
        note_bytes = 2.0 * batch * ctx * hkv * d * 2
        params = dict(batch=batch, ctx=ctx, heads=f"{hq}/{hkv}", head_dim=d)
        cases.append(Case("decode", f"b{batch}_ctx{ctx}", params, build_for(batch, ctx), tier,
                          4.0 * batch * ctx * hq * d, note_bytes))
        cases.append(Case("decode", f"b{batch}_ctx{ctx}_fp8kv", dict(params, kv_cache="fp8_e4m3"),
                          build_fp8_for(batch, ctx), tier,
                          4.0 * batch * ctx * hq * d, note_bytes / 2))
    return cases



def _sdpa_single(q, k, v, backend, gqa=False):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    extra = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}

    def run():
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **extra)
    return run


def _moe_cases(quick: bool, backends) -> list:
    models = {"tiny": (4, 2, 64, 96)} if quick else MOE_MODELS
    ts = (1, 5, 33) if quick else MOE_T

    def build_for(e, top_k, h, inter, t):
        def build(device, dtype):
            import torch

            gen = _gen(device)
            hidden = _randn((t, h), device, dtype, gen)
            w13 = _randn((e, 2 * inter, h), device, dtype, gen, 1 / math.sqrt(h))
            w2 = _randn((e, h, inter), device, dtype, gen, 1 / math.sqrt(inter))
            logits = torch.randn((t, e), device=device, generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
            weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
            args = (hidden, w13, w2, weights, ids, "silu")
            base = {"loop_over_experts": lambda: _moe_loop(hidden, w13, w2, weights, ids)}
            if 6.0 * t * e * h * inter <= DENSE_MOE_MAX_FLOPS:
                dense_w = torch.zeros((t, e), device=device, dtype=torch.float32).scatter_(1, ids.long(), weights)
                base["dense_bf16_all_experts"] = lambda: _moe_dense(hidden, w13, w2, dense_w)
            return graft_impls("moe.fused_experts", args, backends), base
        return build

    def build_fp8(e, top_k, h, inter, t):
        def build(device, dtype):
            import torch

            from graft import quant

            gen = _gen(device)
            fmt = torch.float8_e4m3fnuz if _is_rocm() else torch.float8_e4m3fn
            hidden = _randn((t, h), device, dtype, gen)
            w13 = _randn((e, 2 * inter, h), device, dtype, gen, 1 / math.sqrt(h))
            w2 = _randn((e, h, inter), device, dtype, gen, 1 / math.sqrt(inter))
            # per expert: the fp32 temporaries of one expert at a time, not of all 256
            q13, q2 = [quant.quantize_fp8_block(w, dtype=fmt) for w in w13], [quant.quantize_fp8_block(w, dtype=fmt) for w in w2]
            w13_q, w13_s = torch.stack([q for q, _ in q13]), torch.stack([s for _, s in q13])
            w2_q, w2_s = torch.stack([q for q, _ in q2]), torch.stack([s for _, s in q2])
            logits = torch.randn((t, e), device=device, generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
            weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
            args = (hidden, w13_q, w2_q, w13_s, w2_s, weights, ids, "silu")
            impls = graft_impls("moe.fused_experts_fp8", args, backends)
            # graft's own bf16 fused MoE on the same (unquantized) weights: what fp8 buys
            impls.update({f"{k} (bf16 weights)": v for k, v in
                          graft_impls("moe.fused_experts", (hidden, w13, w2, weights, ids, "silu"), backends).items()})
            return impls, {"loop_over_experts(bf16)": lambda: _moe_loop(hidden, w13, w2, weights, ids)}
        return build

    def build_act_quant(h, t):
        def build(device, dtype):
            import torch

            from graft.kernels.triton.moe_fused_experts_fp8 import quantize_act_launch
            from graft.quant import FP8_BLOCK, quantize_fp8_per_token_group

            fmt = torch.float8_e4m3fnuz if _is_rocm() else torch.float8_e4m3fn
            hidden = _randn((t, h), device, dtype, _gen(device))
            return {"graft:triton": lambda: quantize_act_launch(hidden, fmt)}, {"torch ops (graft.quant)": lambda: quantize_fp8_per_token_group(hidden, FP8_BLOCK, fmt)}
        return build

    cases = []
    for model, (e, top_k, h, inter) in models.items():
        for t in ts:
            tier = 0 if t in (1024, 5) else 1 if t == 64 else 2
            # the fp8 MoE's activation quantization, twice a layer (a Triton launcher, not an op)
            if model in ("deepseek_v3", "tiny") and (backends is None or "triton" in backends):
                cases.append(Case("moe", f"{model}_fp8_act_quant_t{t}", dict(model=model, hidden=h, T=t, op="act_quant"),
                                  build_act_quant(h, t), max(tier, 1), 0.0, t * h * 3.0 + t * h / 32.0))
            flops = 6.0 * t * top_k * h * inter
            touched = e * (1 - (1 - top_k / e) ** t)  # experts a uniform routing reaches (expected)
            cases.append(Case("moe", f"{model}_t{t}", dict(model=model, experts=e, top_k=top_k, hidden=h, inter=inter, T=t),
                              build_for(e, top_k, h, inter, t), tier, flops, 2.0 * touched * 3 * h * inter + 4.0 * t * h))
            if model in ("deepseek_v3", "tiny"):  # DeepSeek-V3 ships fp8 block-scaled experts
                cases.append(Case("moe", f"{model}_fp8_t{t}", dict(model=model, experts=e, top_k=top_k, hidden=h,
                                                                    inter=inter, T=t, weights="fp8 128x128 blocks"),
                                  build_fp8(e, top_k, h, inter, t), tier, flops,
                                  1.0 * touched * 3 * h * inter + 4.0 * t * h, "fp8"))
    return cases


def _moe_loop(hidden, w13, w2, weights, ids):
    """The loop-over-experts MoE most frameworks start from (host syncs: eager only)."""
    import torch

    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gu = hidden[tok] @ w13[e].t()
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (act @ w2[e].t()).float() * weights[tok, slot, None])
    return out.to(hidden.dtype)


def _moe_dense(hidden, w13, w2, dense_w):
    """Every token through every expert, weighted by its (mostly zero) routing weight."""
    import torch

    gu = torch.einsum("th,eih->eti", hidden, w13)
    inter = w13.shape[1] // 2
    act = torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]
    y = torch.einsum("eti,ehi->eth", act, w2)
    return torch.einsum("eth,te->th", y.float(), dense_w).to(hidden.dtype)


def _fused_cases(quick: bool, backends) -> list:
    ts = (1, 7) if quick else FUSED_T
    hs = (64,) if quick else FUSED_H

    def rms(t, h):
        def build(device, dtype):
            import torch

            gen = _gen(device)
            x, w = _randn((t, h), device, dtype, gen), _randn((h,), device, dtype, gen)
            return graft_impls("fused.rms_norm", (x, w, 1e-6, None), backends), {
                "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (h,), w, 1e-6)}
        return build

    def silu(t, h):
        def build(device, dtype):
            import torch

            x = _randn((t, 2 * h), device, dtype, _gen(device))
            return graft_impls("fused.silu_and_mul", (x,), backends), {
                "torch eager": lambda: torch.nn.functional.silu(x[:, :h]) * x[:, h:]}
        return build

    def rope(t, h):
        def build(device, dtype):
            import torch

            from graft.ops.fused import cos_sin_cache, rotary_embedding_reference

            gen = _gen(device)
            d = 64 if quick else 128
            q, k = _randn((t, h), device, dtype, gen), _randn((t, max(h // 4, d)), device, dtype, gen)
            cache = cos_sin_cache(8192, d, device=device)
            pos = torch.randint(0, 8192, (t,), device=device, generator=gen)
            args = (pos, q, k, d, cache, True)
            return graft_impls("fused.rotary_embedding", args, backends), {
                "torch eager": lambda: rotary_embedding_reference(*args)}
        return build

    cases = []
    for h in hs:
        for t in ts:
            tier = 0 if (h in (4096, 64) and t in (4096, 7)) else 1 if (h, t) == (8192, 16384) else 2
            for op, build, nbytes in (("rms_norm", rms(t, h), 4 * t * h), ("silu_and_mul", silu(t, h), 6 * t * h),
                                      ("rotary", rope(t, h), 5 * t * h)):
                cases.append(Case("fused", f"{op}_t{t}_h{h}", dict(op=op, T=t, H=h), build, tier, 0.0, nbytes))
    return cases


FAMILIES = {"gemm": _gemm_cases, "prefill": _prefill_cases, "prefill_paged": _prefill_paged_cases,
            "decode": _decode_cases, "moe": _moe_cases,
            "fused": _fused_cases}


def all_cases(families, quick: bool, backends) -> list:
    keyed = []
    for fam in families:
        for i, case in enumerate(FAMILIES[fam](quick, backends)):
            keyed.append(((case.tier, i), case))
    # tier 0 first; inside a tier the families take turns, so a budget cut spreads over all
    return [case for _, case in sorted(keyed, key=lambda kc: kc[0])]


# --------------------------------------------------------------------------- timing


def _is_rocm() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def release(device, result: Result | None = None) -> None:
    """Give a finished case's device memory back before the next one. Its inputs, outputs and
    captured graphs can sit in reference cycles (closures, tracebacks) that only the cyclic
    collector frees, and a graph's private memory pool is released only once the graph is
    gone; cached blocks of a private pool are not reused by later cases. Without this, an
    H200 run kept 137 GiB reserved after 130 cases and later captures (and a 32 GiB decode
    case) failed with out-of-memory. What stays reserved is recorded."""
    import gc

    gc.collect()
    if device.type != "cuda":
        return
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a lost context: context_lost() reports it after the case
        return
    if result is not None:
        result.memory = {"reserved_gib_after": round(torch.cuda.memory_reserved(device) / 2**30, 2),
                         "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
        torch.cuda.reset_peak_memory_stats(device)


def context_lost(device) -> str | None:
    """Why the device can run nothing more in this process (None: it can). A CUDA error such
    as an illegal address is sticky: every later call in the process fails with it."""
    if device.type != "cuda":
        return None
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
    except Exception as exc:  # noqa: BLE001 - any failure here means the context is gone
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def _max_rel_diff(a, b) -> float | None:
    import torch

    def first(t):
        if isinstance(t, list) and t and all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in t):
            return torch.cat([x[0].transpose(0, 1) for x in t])  # per-sequence SDPA [1, H, S, D] -> packed
        while isinstance(t, (list, tuple)) and t:
            t = t[0]
        return t if isinstance(t, torch.Tensor) else None

    a, b = first(a), first(b)
    if a is None or b is None or a.numel() != b.numel():
        return None
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def ideal_time(case: Case, target: str | None) -> dict:
    """The case's roofline on ``target`` (a key of :data:`ROOFLINES`): the time its bytes take
    at full memory bandwidth, its FLOPs at the full MMA rate of its operand class, and the
    larger of the two (what bounds it). Empty without a target."""
    if target is None:
        return {}
    peak = ROOFLINES[target]
    memory_s = case.bytes / peak["bandwidth"]
    compute_s = case.flops / peak["flops"][case.mma]
    return {"target": target, "ideal_s": max(memory_s, compute_s), "memory_s": memory_s, "compute_s": compute_s,
            "bound": "compute" if compute_s > memory_s else "memory", "fraction": {}}


def new_result(case: Case, target: str | None, status: str = "ok", note: str = "") -> Result:
    return Result(case.family, case.name, case.params, status=status, note=note, flops=case.flops,
                  bytes=case.bytes, tier=case.tier, roofline=ideal_time(case, target))


def run_case(case: Case, device, dtype, use_graphs: bool, rounds: int, target: str | None = None,
             result: Result | None = None) -> Result:
    """Build, warm up and time one case; ``result`` (made by :func:`new_result` when None) is
    filled in place, so a run stopped mid-case still holds what was measured."""
    result = result if result is not None else new_result(case, target)
    result.status, result.note = "ok", ""
    t0 = time.perf_counter()
    _time_case(case, device, dtype, use_graphs, rounds, result)
    # Only once _time_case's frame is gone (its inputs, outputs and captured graphs with it)
    # can their memory go back; released inside it, an H200 run kept 80 GiB reserved.
    release(device, result)
    result.seconds = time.perf_counter() - t0
    return result


def _time_case(case: Case, device, dtype, use_graphs: bool, rounds: int, result: Result) -> None:
    try:
        graft, baselines = case.build(device, dtype)
        if not graft:
            raise RuntimeError("no graft implementation serves this case here")
        runners, outputs = {}, {}
        for label, fn in {**graft, **baselines}.items():
            try:
                run, inner, mode, out = prepare(fn, device, use_graphs)
                runners[label] = (run, inner)
                outputs[label] = out
                result.timings[label] = {"mode": mode, "inner": inner, "samples_s": []}
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not lose the case
                result.timings[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        modes = {result.timings[label]["mode"] for label in runners}
        if len(modes) > 1:
            # A graph replay against eager calls would compare launch overheads, not kernels:
            # when one implementation cannot be captured, every one is timed eagerly.
            why = sorted(m for m in modes if m != "cuda_graph")[0]
            result.note = f"all timed eagerly: {why.replace('eager (', '').rstrip(')')}"
            for label in list(runners):
                try:
                    run, inner, _, _ = prepare(graft.get(label) or baselines[label], device, False)
                    runners[label] = (run, inner)
                    result.timings[label] = {"mode": "eager", "inner": inner, "samples_s": []}
                except Exception as exc:  # noqa: BLE001 - as above
                    del runners[label]
                    result.timings[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        # interleaved: every implementation once per round
        timing.device_rounds(runners, rounds, device, into={label: result.timings[label]["samples_s"] for label in runners})
        for label in runners:
            samples = result.timings[label]["samples_s"]
            result.timings[label]["median_s"] = timing.median(samples)
            if result.roofline:  # baselines too: how close the library gets to the limit
                result.roofline["fraction"][label] = result.roofline["ideal_s"] / result.timings[label]["median_s"]
        timed_base = [b for b in baselines if b in runners]
        for g in graft:
            if g not in runners:
                continue
            for b in timed_base:
                result.ratios[f"{g} vs {b}"] = result.timings[b]["median_s"] / result.timings[g]["median_s"]
            if timed_base and case.compare_values:
                result.value_check[g] = _max_rel_diff(outputs[g], outputs[timed_base[0]])
        if not any(g in runners for g in graft):
            result.status, result.note = "error", "every graft implementation failed"
    except Exception as exc:  # noqa: BLE001 - record and go on
        result.status, result.note = "error", f"{type(exc).__name__}: {str(exc)[:500]}"


# --------------------------------------------------------------------------- reports


def environment(device) -> dict:
    """Where a run happened: Python, torch, Triton, the GPU (name, SMs, memory, capability,
    CUDA/HIP), and graft's commit (``+dirty`` when the tree differs from it: a GPU machine
    gets a copy of the working tree, not always of its history)."""
    import torch

    env: dict = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                 "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   cuda=torch.version.cuda, hip=torch.version.hip)
    here = os.path.dirname(__file__)
    try:
        def git(*args):
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here, timeout=5).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        env["graft_commit"] = (commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
                               if commit else None)
    except Exception:  # noqa: BLE001 - not a checkout
        env["graft_commit"] = None
    return env


STATUSES = ("ok", "error", "skipped", "pending", "killed")


def summary(results: list) -> dict:
    """Per family: cases per status, the geometric-mean ratio per baseline (over graft-vs-baseline
    pairs) and, with a roofline, the geometric-mean fraction of the limit per label."""
    out: dict = {}
    fractions: dict = {}
    for r in results:
        fam = out.setdefault(r.family, {**{s: 0 for s in STATUSES}, "geomean_ratio": {}})
        fam[r.status] += 1
        for pair, ratio in r.ratios.items():
            fam["geomean_ratio"].setdefault(pair.split(" vs ")[1], []).append(ratio)
        for label, frac in (r.roofline or {}).get("fraction", {}).items():
            fractions.setdefault(r.family, {}).setdefault(label, []).append(frac)
    for name, fam in out.items():
        fam["geomean_ratio"] = {b: _geomean(v) for b, v in fam["geomean_ratio"].items()}
        if name in fractions:
            fam["geomean_fraction_of_limit"] = {k: _geomean(v) for k, v in fractions[name].items()}
    return out


def _geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _write_atomic(path: str, text: str) -> None:
    """Write then rename: a run killed while writing leaves the previous complete file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_reports(results: list, env: dict, out_dir: str, tag: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    summ = summary(results)
    payload = {"environment": env, "summary": summ, "results": [vars(r) for r in results],
               "how_to_read": "ratio = baseline median / graft median for one call (> 1: graft faster); "
                              "times are per call, medians over interleaved rounds; absolute times are "
                              "device-specific; roofline.fraction = ideal time on the target (bytes at peak "
                              "bandwidth or FLOPs at peak MMA rate, the larger) / measured time; status "
                              "pending = not reached when the report was written (a killed run)"}
    json_path = os.path.join(out_dir, f"kernels-{tag}.json")
    _write_atomic(json_path, json.dumps(payload, indent=1, default=str))
    html_path = os.path.join(out_dir, f"kernels-{tag}.html")
    _write_atomic(html_path, render_html(results, env, summ))
    return json_path, html_path


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def _fmt_s(s) -> str:
    return "-" if s is None else f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def render_html(results: list, env: dict, summ: dict) -> str:
    esc = html.escape
    rows = []
    for r in results:
        timings = "<br>".join(
            f"{esc(label)}: {esc(t['error']) if 'error' in t else _fmt_s(t.get('median_s'))}"
            + ("" if t.get("mode", "cuda_graph") == "cuda_graph" or "error" in t else f" <i>({esc(t['mode'])})</i>")
            for label, t in r.timings.items())
        ratios = "<br>".join(
            f"<span style='color:{'#070' if v >= 1 else '#b00'}'>{esc(p)}: <b>{v:.2f}x</b></span>"
            for p, v in r.ratios.items())
        best = min((t["median_s"] for label, t in r.timings.items() if label.startswith("graft") and "median_s" in t),
                   default=None)
        rate = ""
        if best:
            rate = f"{r.flops / best / 1e12:.1f} TFLOP/s" if r.flops else ""
            rate += f"<br>{r.bytes / best / 1e9:.0f} GB/s" if r.bytes else ""
        roof = r.roofline or {}
        if roof:
            rate += (f"<br>ideal on {esc(roof['target'])}: {_fmt_s(roof['ideal_s'])} ({roof['bound']}-bound)<br>"
                     + "<br>".join(f"{esc(k)}: {_pct(v)} of limit" for k, v in roof["fraction"].items()))
        checks = "<br>".join(f"{esc(k)}: {v:.1e}" for k, v in r.value_check.items() if v is not None)
        rows.append(f"<tr class='{r.status}'><td>{esc(r.family)}</td><td>{esc(r.name)}</td><td>{esc(r.status)}"
                    f"{'<br>' + esc(r.note) if r.note else ''}</td><td>{timings}</td><td>{ratios}</td>"
                    f"<td>{rate}</td><td>{checks}</td></tr>")
    summ_rows = "".join(
        f"<tr><td>{esc(f)}</td><td>{'/'.join(str(s[k]) for k in STATUSES)}</td><td>"
        + "<br>".join(f"vs {esc(b)}: <b>{v:.2f}x</b>" for b, v in s["geomean_ratio"].items()) + "</td></tr>"
        for f, s in summ.items())
    env_rows = "".join(f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>" for k, v in env.items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>graft kernel benchmark</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin-bottom:1.5em}}
td,th{{border:1px solid #ccc;padding:3px 6px;vertical-align:top;font-size:13px}}tr.error{{background:#fee}}
tr.skipped{{background:#eee;color:#777}}</style></head><body>
<h1>graft kernel benchmark</h1>
<p>Ratio = baseline median / graft median per call, both measured in this run (interleaved rounds,
CUDA graphs unless noted); &gt; 1 means graft is faster. Absolute times are device-specific.</p>
<h2>Environment</h2><table>{env_rows}</table>
<h2>Summary (geometric mean of ratios; cases per status)</h2>
<table><tr><th>family</th><th>{'/'.join(STATUSES)}</th><th>ratio</th></tr>{summ_rows}</table>
<h2>Cases</h2><table><tr><th>family</th><th>case</th><th>status</th><th>median per call</th><th>ratio</th>
<th>graft rate; roofline</th><th>max rel. diff vs baseline</th></tr>{''.join(rows)}</table></body></html>
"""


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda (default when a GPU is visible) or cpu")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated subset of {', '.join(FAMILIES)}")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                        help="activation / output dtype")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the script's logic, not speed")
    parser.add_argument("--backends", default=None,
                        help="graft backends to time (default: every one but the torch reference)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds the cases may take: a case starts only when it is expected to end within "
                             "them (its family's longest case so far); the rest are recorded as skipped")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per case")
    parser.add_argument("--no-graphs", action="store_true", help="time eagerly instead of replaying CUDA graphs")
    parser.add_argument("--match", default=None, help="only cases whose family/name contains this")
    parser.add_argument("--out", default="benchmarks", help="directory for kernels-<tag>.json/.html")
    parser.add_argument("--tag", default=None, help="file name tag (default: the device's name)")
    parser.add_argument("--target", default=None, choices=(*ROOFLINES, "none"),
                        help="roofline to report each case against (default: from the GPU's name; none on "
                             "the CPU or an unlisted GPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the cases in run order (tier, roofline) and exit: nothing is built or timed")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished cases (ok, error, killed) of the report already in --out for this "
                             "tag and run the rest (what ci/gpu_bench.sh does after a lost device context)")
    parser.add_argument("--case-timeout-s", type=float, default=120.0,
                        help=f"a case still running after this many seconds is recorded as killed and the process "
                             f"exits with {EXIT_RESUME} so that a --resume run goes on without it (a hung kernel)")


def roofline_target(gpu_name: str | None) -> str | None:
    """The :data:`ROOFLINES` entry for a device name, None for devices without one."""
    name = (gpu_name or "").lower()
    if "h200" in name:
        return "h200"
    if "mi300x" in name:
        return "mi300x"
    return None


class _Stopped(BaseException):
    """SIGTERM / SIGINT during the run (BaseException: a case's ``except Exception`` must not
    swallow it)."""


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    import signal

    raise _Stopped(signal.Signals(signum).name)


def restore_finished(results: list, path: str, env: dict) -> int:
    """Put the finished results of the report at ``path`` (same plan: matched by family and
    name) into ``results``; returns how many. No report: nothing kept."""
    try:
        with open(path) as f:
            old = json.load(f)
    except FileNotFoundError:
        return 0
    env["resumed"] = int(old.get("environment", {}).get("resumed", 0)) + 1
    names = {f.name for f in fields(Result)}
    finished = {(d["family"], d["name"]): d for d in old.get("results", []) if d.get("status") in FINISHED}
    kept = 0
    for i, r in enumerate(results):
        d = finished.get((r.family, r.name))
        if d is not None:
            results[i] = Result(**{k: v for k, v in d.items() if k in names})
            kept += 1
    return kept


def _on_hung_case(r: Result, results: list, env: dict, args, tag: str) -> None:
    """Watchdog (another thread): the case is still running after ``--case-timeout-s``;
    record it as killed and end the process (a hung kernel cannot be interrupted)."""
    r.status = "killed"
    r.note = (f"still running after --case-timeout-s {args.case_timeout_s:.0f}s (a hung kernel?): "
              f"the rest run in a new process (--resume)")
    for _ in range(3):  # the main thread may be changing the result as it is written
        try:
            write_reports(results, env, args.out, tag)
            break
        except RuntimeError:
            time.sleep(0.05)
    print(f"case {r.family}/{r.name} {r.note}; exiting with {EXIT_RESUME}", flush=True)
    os._exit(EXIT_RESUME)


def _progress(i: int, total: int, elapsed: float, r: Result) -> str:
    ratios = ", ".join(f"{p} {v:.2f}x" for p, v in r.ratios.items()) or r.note[:120]
    roof = r.roofline or {}
    best = max((v for k, v in roof.get("fraction", {}).items() if k.startswith("graft")), default=None)
    limit = f"; ideal {_fmt_s(roof['ideal_s'])}, graft at {_pct(best)} of it" if best is not None else ""
    diffs = [v for v in r.value_check.values() if v is not None]
    diff = f"; max rel diff vs baseline {max(diffs):.1e}" if diffs else ""
    return f"[{i}/{total} {elapsed:5.0f}s] {r.status:5} {r.family}/{r.name}: {ratios}{limit}{diff}"


def run(args) -> int:
    """Run the benchmark ``args`` describe (the parsed command line), value checks off."""
    from graft import config

    # Value checks are device syncs: off for the run, and the setting restored afterwards
    # (a test or a notebook calls main() in-process; the next code there must not inherit it).
    with config.override(GRAFT_CHECK_VALUES="0"):
        return _run(args)


def _run(args) -> int:
    import signal

    import torch

    from graft import settings
    from graft.errors import GraftInputError

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise GraftInputError(f"unknown families {unknown}; expected a subset of {', '.join(FAMILIES)}")
    if args.rounds < 1:
        raise GraftInputError(f"--rounds {args.rounds}: needs at least 1")
    backends = None if args.backends is None else {b.strip() for b in args.backends.split(",") if b.strip()}
    cases = all_cases(families, args.quick, backends)
    if args.match:
        cases = [c for c in cases if args.match in f"{c.family}/{c.name}"]
    if args.dry_run:
        target = None if args.target in (None, "none") else args.target
        for i, case in enumerate(cases, 1):
            roof = ideal_time(case, target)
            ideal = f"  ideal {_fmt_s(roof['ideal_s'])} on {target} ({roof['bound']}-bound)" if roof else ""
            print(f"{i:4} tier {case.tier} {case.family}/{case.name}{ideal}")
        return 0

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError):
        raise GraftInputError(f"--device {args.device!r} is not a device; use cpu or cuda (cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise GraftInputError(f"--device {args.device!r}: bench-kernels times on cpu or cuda (ROCm GPUs are cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GraftInputError("--device cuda but torch sees no GPU")
    dtype = getattr(torch, args.dtype)
    env = environment(device)
    target = (None if args.target == "none" else args.target if args.target
              else roofline_target(env.get("gpu")) if device.type == "cuda" else None)
    env.update(dtype=args.dtype, quick=args.quick, budget_s=args.budget_s, rounds=args.rounds,
               graphs=not args.no_graphs and device.type == "cuda", check_values=settings.raw("GRAFT_CHECK_VALUES"),
               roofline=dict(ROOFLINES[target], target=target) if target else None)
    tag = args.tag or ("cpu-quick" if device.type == "cpu" else
                       "".join(ch if ch.isalnum() else "-" for ch in env.get("gpu", "gpu").lower()).strip("-"))
    print(f"graft kernel benchmark: {len(cases)} cases on {env.get('gpu', device)}, budget {args.budget_s:.0f}s, "
          f"roofline {target or 'none'}", flush=True)
    # The whole plan is in the report from the start: a run killed at any point shows what it
    # measured, what it was in the middle of and what it never reached.
    results = [new_result(case, target, "pending") for case in cases]
    if args.resume:
        kept = restore_finished(results, os.path.join(args.out, f"kernels-{tag}.json"), env)
        print(f"resuming: {kept} finished case(s) kept from the report, {len(results) - kept} to run", flush=True)
    write_reports(results, env, args.out, tag)
    longest: dict = {}  # family -> its longest case so far (seconds): whether the next one fits
    start = time.perf_counter()
    main_thread = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    current = None
    try:
        for i, (case, r) in enumerate(zip(cases, results), 1):
            if r.status in FINISHED:  # kept by --resume
                continue
            elapsed = time.perf_counter() - start
            expected = longest.get(case.family, max(longest.values(), default=0.0))
            if elapsed + expected > args.budget_s:
                r.status = "skipped"
                r.note = (f"time budget of {args.budget_s:.0f}s: {elapsed:.0f}s spent, a {case.family} case "
                          f"takes up to {expected:.0f}s")
                continue
            current = r
            watchdog = threading.Timer(args.case_timeout_s, _on_hung_case, (r, results, env, args, tag))
            watchdog.daemon = True
            watchdog.start()
            try:
                run_case(case, device, dtype, not args.no_graphs, args.rounds, target, result=r)
            finally:
                watchdog.cancel()
            current = None
            longest[case.family] = max(longest.get(case.family, 0.0), r.seconds)
            lost = context_lost(device)
            if lost:
                r.status = "error"
                r.note = (f"{r.note + '; ' if r.note else ''}the device context was lost in this case ({lost}): "
                          f"the rest run in a new process (--resume)")
            write_reports(results, env, args.out, tag)  # after every case: a killed run still leaves its results
            print(_progress(i, len(cases), elapsed, r), flush=True)
            if lost:
                print(f"device context lost in {case.family}/{case.name}: exiting with {EXIT_RESUME} "
                      f"so that a --resume run goes on", flush=True)
                return EXIT_RESUME
    except _Stopped as stop:
        for sig in previous:  # a second signal (timeout and a process-group kill) must not cut the report short
            signal.signal(sig, signal.SIG_IGN)
        if current is not None:
            current.status, current.note = "killed", f"stopped mid-case by {stop} (the outer timeout?)"
        env["stopped_by"] = str(stop)
        env["wall_s"] = round(time.perf_counter() - start, 1)
        json_path, _ = write_reports(results, env, args.out, tag)
        print(f"stopped by {stop}: {sum(r.status in ('ok', 'error') for r in results)} case(s) finished, "
              f"report in {json_path}", flush=True)
        return 128 + getattr(signal, str(stop)).value
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    skipped = sum(r.status == "skipped" for r in results)
    env["wall_s"] = round(time.perf_counter() - start, 1)
    if skipped:
        print(f"{skipped} case(s) skipped: time budget of {args.budget_s:.0f}s spent", flush=True)
    json_path, html_path = write_reports(results, env, args.out, tag)
    print(f"wrote {json_path} and {html_path}", flush=True)
    for fam, s in summary(results).items():
        means = ", ".join(f"vs {b} {v:.2f}x" for b, v in s["geomean_ratio"].items())
        limits = ", ".join(f"{k} {_pct(v)}" for k, v in s.get("geomean_fraction_of_limit", {}).items())
        print(f"  {fam}: {s['ok']} ok, {s['error']} error, {s['skipped']} skipped; geomean {means}"
              + (f"; of the {target} limit: {limits}" if limits else ""), flush=True)
    return 0 if any(r.status == "ok" for r in results) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft.tools.bench.kernels", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
