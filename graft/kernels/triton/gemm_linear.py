"""Triton dense GEMM (``gemm.linear``): ``act(x @ weight.T + bias)``, and the reusable
launcher :func:`matmul` (``act(a @ b + bias)`` for any strides) that backward passes use.

Each program computes a BLOCK_M x BLOCK_N tile of y with fp32 accumulation over its K
range, reading ``weight [N, K]`` in place as the transposed operand (no copy). Tiles,
pipeline depth and split-K come from :func:`graft.kernels.triton._gemm_common.gemm_plan`
per M range and architecture (see there for why). Unsplit, the epilogue applies bias and
activation to the fp32 accumulator before the single rounding; split, the splits' fp32
partials are summed in a fixed order by the reduce kernel, which then does the same.
Ragged M, N and K edges are masked (out-of-range loads read 0).

On Hopper at prefill M (:func:`graft.kernels.triton._gemm_common.tma_plan`) a second kernel
serves: persistent, one program per SM, its tiles loaded and stored by TMA descriptors
(:func:`_linear_tma_kernel`). It needs what a descriptor needs (16-byte aligned bases and row
strides, unit column strides: an activation [M, K] and an nn.Linear weight [N, K] as they
are); any other layout, ``accumulate`` or a forced split count takes the pointer kernel.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._aot import GENERATION, TARGETS, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton import _gemm_common
from graft.kernels.triton._dot import dot_acc, dot_flags
from graft.kernels.triton._gemm_common import (
    SM_COUNT,
    a_tile_ptrs,
    b_tile_ptrs,
    finish_tile,
    gemm_plan,
    grouped_tile,
    launch_options,
    load_tiles,
    reduce_aot_variants,
    split_tile,
    splitk_reduce,
    splitk_workspace,
    store_tile,
    tile_constexprs,
    tma_plan,
)

_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_log = logging.getLogger(__name__)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot flags: see graft.kernels.triton._dot
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,  # the plan's: every K step of every split inside K (no K mask)
):  # fmt: skip
    """y = x[M, K] @ w[K, N] (w through its strides: weight [N, K] is read as w = weight.T);
    ACCUMULATE: y += (in y's dtype, fp32 for a gradient summed over chunks)."""
    k_start, rows, cols, row_ok, col_ok = split_tile(M, N, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs, step_x = a_tile_ptrs(x_ptr, rows, k_start, stride_xm, stride_xk, BLOCK_K)
    w_ptrs, step_w = b_tile_ptrs(w_ptr, cols, k_start, stride_wn, stride_wk, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Trip count from arguments only (Triton 3.6's interpreter cannot range over program_id
    # values); the last split's steps past K load nothing (masked) and add zero.
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_start + kk
        k_ok = ks < K - k0
        a, b = load_tiles(x_ptrs, w_ptrs, row_ok, col_ok, k_ok, 0.0, EVEN_K)
        acc = dot_acc(a, b, acc, UPCAST, PRECISION)
        x_ptrs += step_x
        w_ptrs += step_w
    store_tile(acc, y_ptr, bias_ptr, rows, cols, M, N, stride_ym, stride_yn, HAS_BIAS, ACTIVATION, SPLIT_K,
               ACCUMULATE)


@triton.jit
def _linear_tma_kernel(
    x_desc, w_desc, y, bias_ptr,
    M, N, K, NUM_PROGRAMS, stride_ym,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """y = act(x @ weight.T + bias), persistent: program p computes output tiles p,
    p + NUM_PROGRAMS, ... in grouped order. x [M, K] and weight [N, K] are TMA descriptors
    (blocks [BLOCK_M, BLOCK_K], [BLOCK_N, BLOCK_K]): loads past M, N or K are zero-filled by
    the copy engine, so the K loop has no masks.

    Without WARP_SPECIALIZE, y [M, N] is a descriptor too (block [BLOCK_M, BLOCK_N]: stores
    past M, N are clipped), and ``flatten`` merges the tile loop into the K loop for the
    software pipeliner: the next tile's first loads are issued during this tile's epilogue.
    With it, Triton splits the loop into a producer warp group issuing the TMA loads and
    consumer warp groups running the MMAs and the epilogue (on sm_90 under Triton 3.6: 4
    warps become 3 warp groups, 384 threads, registers moved by ``setmaxnreg``). Its pass
    fails on a descriptor store there ("tensor descriptor block and tensor types must
    match"), and at 8 warps it leaves the loop as it is, so this form stores through the
    pointer ``y`` (row stride ``stride_ym``, unit column stride), masked, and runs 4 warps."""
    first = tl.program_id(0)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(first, tiles, NUM_PROGRAMS, flatten=not WARP_SPECIALIZE, warp_specialize=WARP_SPECIALIZE):
        tile_m, tile_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = tile_m * BLOCK_M
        off_n = tile_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_steps):
            a = x_desc.load([off_m, kk * BLOCK_K])
            b = w_desc.load([off_n, kk * BLOCK_K])
            acc = dot_acc(a, b.T, acc, UPCAST, PRECISION)
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = finish_tile(acc, bias_ptr, cols, N, HAS_BIAS, ACTIVATION)
        if WARP_SPECIALIZE:
            rows = off_m + tl.arange(0, BLOCK_M)
            out = y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
            tl.store(out, acc.to(y.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))
        else:
            y.store([off_m, off_n], acc.to(y.dtype))


def plan(m: int, n: int, k: int, dtype: torch.dtype, device, split_k: Optional[int] = None, tma: bool = True,
         **what_if) -> dict:
    """Launch plan (tiles, stages, SPLIT_K, K_PER_SPLIT); ``split_k`` forces a split count;
    ``tma``: the persistent TMA kernel's plan (``TMA: True``) where it serves this shape."""
    size = dtype.itemsize
    # the device's generation and SM count once, for both plans (a per-call path)
    what_if["generation"] = what_if.get("generation") or _gemm_common.generation_of(device)
    what_if["sms"] = what_if["sms"] if what_if.get("sms") is not None else _gemm_common.sm_count(device)
    # the measured rows of kind "linear" are for 16-bit operands (the sweep's bf16)
    cfg = gemm_plan(m, n, k, device, size, split_k=split_k, kind="linear" if size == 2 else None, **what_if)
    if tma and split_k is None and cfg["SPLIT_K"] == 1:
        return tma_plan(m, n, k, device, size, **what_if) or cfg
    return cfg


def tma_layout_problem(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> Optional[str]:
    """Why ``a [M, K]``, ``b [K, N]`` (read as the weight ``b.T [N, K]``) and ``y [M, N]`` do not
    fit TMA descriptors, or None. A descriptor needs a unit last stride and a 16-byte aligned
    base and row stride (the copy engine addresses rows in 16-byte units)."""
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype or y.dtype != a.dtype:
        return f"operands and output must be one of fp16/bf16, got {a.dtype}, {b.dtype}, {y.dtype}"
    for name, t in (("a", a), ("b.T", b.t()), ("out", y)):
        size = t.element_size()
        if t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16:
            return (f"{name} has strides {tuple(t.stride())} and base at {t.data_ptr() % 16} bytes past 16-byte "
                    f"alignment: needs a unit last stride and a row stride of a multiple of {16 // size} elements")
    return None


_tma_failed: dict = {}  # (dtype, device type) -> why the TMA kernel could not be launched there


def _launch_tma(cfg: dict, a, b, bias, y, activation: str) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    m, k = a.shape
    n = b.shape[1]
    ws = cfg.get("WARP_SPECIALIZE", False)
    _linear_tma_kernel[(cfg["NUM_PROGRAMS"],)](
        TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk]),
        TensorDescriptor(b.t(), [n, k], [b.stride(1), 1], [bn, bk]),
        y if ws else TensorDescriptor(y, [m, n], [y.stride(0), 1], [bm, bn]),
        bias if bias is not None else y, m, n, k, cfg["NUM_PROGRAMS"], y.stride(0),
        HAS_BIAS=bias is not None, ACTIVATION=activation, WARP_SPECIALIZE=ws,
        **dot_flags(a.dtype, a.device), **tile_constexprs(cfg), **launch_options(cfg),
    )  # fmt: skip


def matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, activation: str = "none",
           out: Optional[torch.Tensor] = None, split_k: Optional[int] = None, accumulate: bool = False,
           tma: Optional[bool] = None) -> torch.Tensor:
    """``act(a @ b + bias)`` for 2-D ``a [M, K]``, ``b [K, N]`` of one float dtype and any
    strides (pass ``w.t()`` for a weight [N, K], ``dy.t()`` for dW: no copies), fp32
    accumulation, into ``out`` (any strides, a's dtype or fp32) or a new [M, N] tensor;
    ``accumulate``: added to what ``out`` holds (``out +=``, one rounding to out's dtype:
    a gradient summed over chunks in an fp32 ``out`` without a temporary).

    A plain launcher, not a custom op: call it inside a torch.library op (gemm.linear's,
    or a backward's). ``split_k`` forces the split count (default: :func:`plan`'s choice).
    ``tma``: None, the persistent TMA kernel where the plan picks it and the layout fits
    descriptors; True forces it (ValueError where the layout or arguments do not fit); False
    never. Where its compilation or launch fails, the pointer kernel serves from then on, the
    reason logged once.
    """
    m, k = a.shape
    n = b.shape[1]
    if accumulate and out is None:
        raise ValueError("matmul(accumulate=True) adds to `out`: pass the tensor to add to")
    y = out if out is not None else torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    if k == 0:  # an empty sum: the epilogue of zeros
        from graft.ops.gemm import apply_activation

        zero = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        epilogue = apply_activation(zero + (bias.float() if bias is not None else 0), activation)
        return y.add_(epilogue.to(y.dtype)) if accumulate else y.copy_(epilogue)
    if tma:
        problem = ("it cannot accumulate" if accumulate else "it does not split K" if split_k is not None
                   else tma_layout_problem(a, b, y))
        if problem:
            raise ValueError(f"matmul(tma=True): the TMA kernel cannot serve this call: {problem}")
        forced = tma_plan(m, n, k, a.device, a.element_size(), force=True)
        assert forced is not None  # force=True always gives a plan
        cfg = forced
    else:
        cfg = plan(m, n, k, a.dtype, a.device, split_k, tma=tma is None and not accumulate)
    if cfg.get("TMA"):
        key = (a.dtype, a.device.type)
        if tma or (key not in _tma_failed and tma_layout_problem(a, b, y) is None):
            try:
                with on_device(a):
                    _launch_tma(cfg, a, b, bias, y, activation)
                return y
            except Exception as exc:  # a compiler or driver without TMA support: the pointer kernel serves
                if tma:
                    raise
                _tma_failed[key] = f"{type(exc).__name__}: {exc}"
                _log.warning("graft: the TMA GEMM kernel failed on %s %s (%s); the pointer kernel serves from now on",
                             a.device, a.dtype, _tma_failed[key])
        cfg = plan(m, n, k, a.dtype, a.device, split_k, tma=False)
    splits = cfg["SPLIT_K"]
    target = splitk_workspace(cfg, m, n, a) if splits > 1 else y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    with on_device(a):
        _linear_kernel[grid](
            a, b, bias if bias is not None else y, target,
            m, n, k, cfg["K_PER_SPLIT"],
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
            HAS_BIAS=bias is not None, ACTIVATION=activation, SPLIT_K=splits, ACCUMULATE=accumulate,
            EVEN_K=cfg["EVEN_K"], **dot_flags(a.dtype, a.device), **tile_constexprs(cfg), **launch_options(cfg),
        )  # fmt: skip
        if splits > 1:
            splitk_reduce(target, bias, y, activation, accumulate)
    return y


def _linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    return matmul(x, weight.t(), bias, activation)


def _linear_2d_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


linear_op = define_op("gemm_linear_triton", _linear_2d, fake=_linear_2d_fake)


def linear(x, weight, bias=None, activation="none"):
    """``gemm.linear`` on Triton: any leading dims of x are folded into M."""
    k, n = x.shape[-1], weight.shape[0]
    y = linear_op(x.reshape(math.prod(x.shape[:-1]), k), weight, bias, activation)
    return y.reshape(*x.shape[:-1], n)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "gemm.linear", linear, custom_op=linear_op, dtypes=_FLOAT_DTYPES,
        description="Triton tiled GEMM, fp32 accumulation, split-K at small M, bias + activation fused",
    ))


# Model shapes the plans are checked on (Llama-3-8B, 70B/TP8 and 70B projections), per M bucket.
AOT_SHAPES = ((4096, 4096), (28672, 4096), (8192, 1024), (10240, 8192), (57344, 8192), (8192, 28672))
AOT_MS = (1, 16, 32, 64, 128, 4096)


def aot_plans(target: str, dtype: torch.dtype):
    """The distinct (tile constexprs, SPLIT_K > 1, options) the dispatcher launches on
    ``target`` for ``dtype`` over AOT_SHAPES x AOT_MS."""
    generation = GENERATION[target]
    seen: dict = {}
    for tma in (False, True):  # the pointer kernel also serves where TMA would: layouts descriptors cannot take
        for m in AOT_MS:
            for n, k in AOT_SHAPES:
                cfg = plan(m, n, k, dtype, "cuda", tma=tma, generation=generation, sms=SM_COUNT[generation])
                key = (tuple(tile_constexprs(cfg).items()), cfg["SPLIT_K"] > 1, tuple(launch_options(cfg).items()),
                       cfg.get("TMA", False), cfg.get("EVEN_K"))
                seen.setdefault(key, cfg)
    return list(seen.values())


# A launch on a model's activations and nn.Linear weight (read as weight.T): K contiguous in
# both operands, N in the output; the JIT makes those unit strides constants (vector loads).
UNIT_STRIDES = dict(stride_xk=1, stride_wk=1, stride_yn=1)


def _aot_variants():
    """Every plan per target and dtype (the first: bf16, the quick one); bf16 with every
    activation on the prefill tile; fp32 with TF32 and IEEE; the TMA kernel on the plans that
    pick it (sm_90, prefill M, 16-bit), with descriptors of its blocks."""
    from graft.ops.gemm import ACTIVATIONS

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for target in TARGETS:
        for dtype, name in names.items():
            plans = aot_plans(target, dtype)
            tma_plans = [cfg for cfg in plans if cfg.get("TMA")]
            plans = [cfg for cfg in plans if not cfg.get("TMA")]
            if dtype == torch.float16:
                plans = plans[-1:]  # the same resources as bf16: one plan checks the dtype compiles
            for i, cfg in enumerate(plans):
                last = i == len(plans) - 1
                acts = ACTIVATIONS if (dtype == torch.bfloat16 and last) else ("gelu",)
                # TF32 stages fp32 tiles in shared memory (the worst case); IEEE once per target.
                if dtype != torch.float32:
                    precisions = ("ieee",)
                else:
                    precisions = ("tf32", "ieee") if last else ("tf32",)
                for act in acts:
                    for precision in precisions:
                        split = 2 if cfg["SPLIT_K"] > 1 else 1  # SPLIT_K only switches the store path
                        flags = dict(HAS_BIAS=True, ACTIVATION=act, SPLIT_K=split, UPCAST=False, PRECISION=precision,
                                     EVEN_K=cfg["EVEN_K"], **tile_constexprs(cfg))
                        yield variant(_linear_kernel, flags, pointer=f"*{name}", options=launch_options(cfg),
                                      targets=(target,), values=UNIT_STRIDES)
            if tma_plans and dtype == torch.bfloat16:  # the warp-specialised form the tile sweep times
                ws_row = _gemm_common.with_block_k(_gemm_common.WARP_SPECIALIZED_TMA_ROW, 2)
                tma_plans.append(dict(tma_plans[0], **ws_row))
            for cfg in tma_plans:  # after the pointer plans: the first variant is the quick one
                bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
                ws = cfg.get("WARP_SPECIALIZE", False)
                descriptors = dict(x_desc=(bm, bk), w_desc=(bn, bk))
                types = {"y": f"*{name}"} if ws else {}  # the warp-specialised form stores through a pointer
                if not ws:
                    descriptors["y"] = (bm, bn)
                for act in ("none", "silu"):
                    flags = dict(HAS_BIAS=act != "none", ACTIVATION=act, UPCAST=False, PRECISION="ieee",
                                 WARP_SPECIALIZE=ws, **tile_constexprs(cfg))
                    yield variant(_linear_tma_kernel, flags, pointer=f"*{name}", options=launch_options(cfg),
                                  targets=(target,), descriptors=descriptors, values=dict(stride_ym=4096), **types)
        # The fused linear cross-entropy's dW (Llama-3: vocabulary 128256, hidden 4096, chunks of
        # 2048 tokens): logits.T [V, C] (M contiguous) @ x [C, H], added to an fp32 dW.
        cfg = plan(128256, 4096, 2048, torch.bfloat16, "cuda", tma=False, generation=GENERATION[target],
                   sms=SM_COUNT[GENERATION[target]])
        flags = dict(HAS_BIAS=False, ACTIVATION="none", SPLIT_K=2 if cfg["SPLIT_K"] > 1 else 1, UPCAST=False,
                     PRECISION="ieee", ACCUMULATE=True, EVEN_K=cfg["EVEN_K"], **tile_constexprs(cfg))
        yield variant(_linear_kernel, flags, pointer="*bf16", options=launch_options(cfg), targets=(target,),
                      values=dict(stride_xm=1, stride_wn=1, stride_yn=1), y_ptr="*fp32")
    yield from reduce_aot_variants()


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
