"""Triton W4A16 GEMM (``gemm.w4a16``): GPTQ or AWQ 4-bit weights dequantized in the kernel.

Each K step loads every int32 word of a BLOCK_K x BLOCK_N tile of 4-bit codes exactly once
(``[BLOCK_K/8, BLOCK_N]`` words for GPTQ, packed along K; ``[BLOCK_K, BLOCK_N/8]`` for AWQ,
packed along N), pulls the 8 nibbles out with one broadcast shift in registers and reshapes
to the ``[BLOCK_K, BLOCK_N]`` code tile (layouts in :mod:`graft.quant`). The codes become
floats without int-to-float conversions (a magic-number bit trick, :func:`_codes_as`). The
group's zero points and scales are folded into that tile, ``w = (q - zero) * scale`` in the
activation dtype, before the MMA, so the MMA accumulates the finished product in fp32 (no per-step
rescaling of the accumulator). BLOCK_K divides group_size, so one K step never straddles
two groups and scale/zero are one row vector per step; that needs group_size to be a
multiple of 16 (the smallest tl.dot K): other group sizes fall back. Tiles and split-K come
from the shared GEMM plan (graft.kernels.triton._gemm_common): at decode sizes the
(M, N) grid is far below the SM count, and K splits fill the GPU, reduced in fixed order.

graft's own ``gptq_interleaved`` layout (GPTQ's words with their nibbles reordered once per
block of 128 K rows, :func:`graft.quant.interleave_gptq`) skips the reshape: one shift of a
block's 16 word rows is already a [16, BLOCK_N] tile of consecutive K rows, multiplied against
a [BLOCK_M, 16] slice of x (:func:`_interleaved_steps`). Compiled under Triton 3.6 it stages
8x fewer shared-memory stores per step and takes 40-50 % fewer registers and less shared
memory at decode tiles, but synchronises more often (one operand staging per 16-row slice);
which layout is faster is for a GPU run to say (the benchmark has both).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._aot import GENERATION, TARGETS, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._dot import dot_acc, dot_flags
from graft.quant import INTERLEAVE_K
from graft.kernels.triton._gemm_common import (
    SM_COUNT,
    a_tile_ptrs,
    gemm_plan,
    launch_options,
    split_tile,
    splitk_reduce,
    splitk_workspace,
    store_tile,
    tile_constexprs,
    tile_coords,
)

_MIN_DOT_K = 16


@triton.jit
def _codes_as(q, like):
    """4-bit codes (int32, 0..15) as ``m + q`` in like's float dtype, without an int-to-float
    conversion (I2F runs at a quarter of the FP rate on Hopper, once per weight element): the
    code ORed into the mantissa of a power of two m whose ulp is 1 (fp16 1024 = 0x6400, bf16
    128 = 0x4300, fp32 2^23 = 0x4B000000) and the bits reinterpreted, as Marlin's dequant does."""
    if like.dtype == tl.float16:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    elif like.dtype == tl.bfloat16:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, y_ptr,
    M, N, K, GROUP_SIZE, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_ym, stride_yn,
    AWQ: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot flags: see graft.kernels.triton._dot
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
):  # fmt: skip
    k_start, rows, cols, row_ok, col_ok = split_tile(M, N, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
    if INTERLEAVED:
        _interleaved_steps(x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, y_ptr, k_start, rows, cols, row_ok, col_ok,
                           M, N, K, GROUP_SIZE, K_PER_SPLIT, stride_xm, stride_xk, stride_qk, stride_qn,
                           stride_sg, stride_sn, stride_zg, stride_zn, stride_ym, stride_yn,
                           HAS_ZEROS, HAS_BIAS, SPLIT_K, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        return
    ks = tl.arange(0, BLOCK_K)
    nibble = tl.arange(0, 8)
    # AWQ puts column j of a pack of 8 in nibble (j // 2) + 4 * (j % 2); GPTQ in nibble j.
    awq_shift = ((nibble // 2) + 4 * (nibble % 2)) * 4
    x_ptrs, x_step = a_tile_ptrs(x_ptr, rows, k_start, stride_xm, stride_xk, BLOCK_K)
    if AWQ:  # qweight [K, N/8]: BLOCK_K rows of BLOCK_N/8 words
        tile_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)[1]  # (split_tile's own: computed once)
        wcols = tile_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        wcol_ok = wcols < tl.cdiv(N, 8)
        q_ptrs = qw_ptr + (k_start + ks).to(tl.int64)[:, None] * stride_qk + wcols[None, :] * stride_qn
        q_step = tl.cast(stride_qk, tl.int64) * BLOCK_K
    else:  # GPTQ qweight [K/8, N]: BLOCK_K/8 rows of BLOCK_N words
        wks = tl.arange(0, BLOCK_K // 8)
        q_ptrs = qw_ptr + (k_start // 8 + wks).to(tl.int64)[:, None] * stride_qk + cols.to(tl.int64)[None, :] * stride_qn
        q_step = tl.cast(stride_qk, tl.int64) * (BLOCK_K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Trip count from arguments only (Triton 3.6's interpreter cannot range over program_id
    # values); the last split's steps past K load nothing (masked) and add zero.
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_start + kk
        k_ok = ks < K - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # interpreted bf16: build the dequantized tile in fp32 too, never in bf16
            a = a.to(tl.float32)
        # Each word is loaded once; its 8 codes come out by one broadcast shift.
        if AWQ:
            words = tl.load(q_ptrs, mask=k_ok[:, None] & wcol_ok[None, :], other=0)
            q = tl.reshape((words[:, :, None] >> awq_shift[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        else:
            words = tl.load(q_ptrs, mask=(wks < (K - k0) // 8)[:, None] & col_ok[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> (nibble * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        # BLOCK_K divides GROUP_SIZE: the whole step is one group. A step past K (last split)
        # reads no scale: its tile is exactly 0. (k0 broadcast to a vector first: the
        # interpreter rejects a scalar-vector mask.)
        live = col_ok & ((cols * 0 + k0) < K)
        zero, scale = _group_zero_scale(s_ptr, qz_ptr, k0 // GROUP_SIZE, cols, live, stride_sg, stride_sn, stride_zg,
                                        stride_zn, AWQ, HAS_ZEROS)
        # Scales and zeros folded into the tile: the MMA sees the dequantized weight. The codes
        # become floats by a bit trick, not an int-to-float conversion per element (see
        # _codes_as); (m + q) - (m + zero) is q - zero exactly, so the tile is as before.
        w = (_codes_as(q, a) - _codes_as(zero, a)[None, :]) * scale.to(a.dtype)[None, :]
        acc = dot_acc(a, w, acc, UPCAST, PRECISION)
        x_ptrs += x_step
        q_ptrs += q_step
    store_tile(acc, y_ptr, bias_ptr, rows, cols, M, N, stride_ym, stride_yn, HAS_BIAS, "none", SPLIT_K, False)


@triton.jit
def _group_zero_scale(s_ptr, qz_ptr, group, cols, live, stride_sg, stride_sn, stride_zg, stride_zn,
                      AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """One group's zero-point codes and scales of columns ``cols``: qzeros pack 8 columns a
    word, AWQ's column j in nibble (j // 2) + 4 * (j % 2), GPTQ's (AutoGPTQ v1) in nibble j with
    the zero stored minus one; without zeros the symmetric 8. Columns not ``live`` read nothing
    (scale 0: a step past K adds exactly 0)."""
    scale = tl.load(s_ptr + group * stride_sg + cols * stride_sn, mask=live, other=0.0)
    if HAS_ZEROS:
        lane = cols % 8
        if AWQ:
            shift = ((lane // 2) + 4 * (lane % 2)) * 4
        else:
            shift = lane * 4
        zp = tl.load(qz_ptr + group * stride_zg + (cols // 8) * stride_zn, mask=live, other=0)
        zero = (zp >> shift) & 0xF
        if not AWQ:
            zero += 1
    else:
        zero = tl.full(cols.shape, 8, dtype=tl.int32)
    return zero, scale


@triton.jit
def _interleaved_steps(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, y_ptr, k_start, rows, cols, row_ok, col_ok,
    M, N, K, GROUP_SIZE, K_PER_SPLIT, stride_xm, stride_xk, stride_qk, stride_qn,
    stride_sg, stride_sn, stride_zg, stride_zn, stride_ym, stride_yn,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The K loop on the ``gptq_interleaved`` layout (graft.quant.interleave_gptq): in each block
    of 128 K rows, nibble j of word row r holds K row 16j + r, so one shift of the block's 16
    word rows is a [16, BLOCK_N] code tile of 16 consecutive K rows, the K of one MMA, in the
    layout the words were loaded in: BLOCK_K / 16 dots per step against [BLOCK_M, 16] slices
    of x, and no [BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N] reshape (a layout conversion
    through shared memory) per step. BLOCK_K is 16..128 and divides 128; a step of fewer than
    128 rows takes its nibbles out of the words its block shares with the next steps."""
    PER_BLOCK: tl.constexpr = 128 // 8  # word rows per interleaved block (graft.quant.INTERLEAVE_K / 8)
    r16 = tl.arange(0, 16)
    wrows = tl.arange(0, PER_BLOCK)
    x_ptrs = a_tile_ptrs(x_ptr, rows, k_start, stride_xm, stride_xk, 16)[0]
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_start + kk
        live = col_ok & ((cols * 0 + k0) < K)  # a step past K (last split) reads nothing and adds 0
        q_ptrs = qw_ptr + ((k0 // 128) * PER_BLOCK + wrows).to(tl.int64)[:, None] * stride_qk \
            + cols.to(tl.int64)[None, :] * stride_qn
        words = tl.load(q_ptrs, mask=live[None, :], other=0)
        first = (k0 % 128) // 16  # the step's first 16-row slice within its block
        zero, scale = _group_zero_scale(s_ptr, qz_ptr, k0 // GROUP_SIZE, cols, live, stride_sg, stride_sn,
                                        stride_zg, stride_zn, False, HAS_ZEROS)
        for j in tl.static_range(BLOCK_K // 16):
            a = tl.load(x_ptrs + (j * 16) * stride_xk, mask=row_ok[:, None] & (r16 < K - k0 - 16 * j)[None, :],
                        other=0.0)
            if UPCAST:  # interpreted bf16: the dequantized tile in fp32 too, never in bf16
                a = a.to(tl.float32)
            q = (words >> ((first + j) * 4)) & 0xF
            w = (_codes_as(q, a) - _codes_as(zero, a)[None, :]) * scale.to(a.dtype)[None, :]
            acc = dot_acc(a, w, acc, UPCAST, PRECISION)
        x_ptrs += x_step
    store_tile(acc, y_ptr, bias_ptr, rows, cols, M, N, stride_ym, stride_yn, HAS_BIAS, "none", SPLIT_K, False)


def plan(m: int, n: int, k: int, dtype: torch.dtype, device, group_size: int, split_k: Optional[int] = None,
         interleaved: bool = False, **what_if) -> dict:
    """The shared GEMM plan with BLOCK_K dividing the group (per channel: any; K is then one
    group, so a split must not start mid-pack either: BLOCK_K stays a multiple of 16).
    B stages as packed words (0.5 B per code) plus the dequantized tile the MMA reads.
    ``interleaved`` (the gptq_interleaved layout): BLOCK_K also divides its block of 128 rows."""
    size = dtype.itemsize
    group = 0 if group_size == -1 else group_size
    if interleaved:
        group = math.gcd(group, INTERLEAVE_K) if group else INTERLEAVE_K
    return gemm_plan(m, n, k, device, size, size + 0.5, k_multiple_of=group, split_k=split_k, **what_if)


def _w4a16_2d(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    group_size: int,
    format: str,
) -> torch.Tensor:
    m, k = x.shape
    awq = format == "awq"
    n = qweight.shape[1] * 8 if awq else qweight.shape[1]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    interleaved = format == "gptq_interleaved"
    cfg = plan(m, n, k, x.dtype, x.device, group_size, interleaved=interleaved)
    splits = cfg["SPLIT_K"]
    target = splitk_workspace(cfg, m, n, x) if splits > 1 else y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    with on_device(x):
        _w4a16_kernel[grid](
            x, qweight, scales, zeros, bias if bias is not None else y, target,
            m, n, k, k if group_size == -1 else group_size, cfg["K_PER_SPLIT"],
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
            scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1), y.stride(0), y.stride(1),
            AWQ=awq,
            HAS_ZEROS=qzeros is not None,
            HAS_BIAS=bias is not None,
            SPLIT_K=splits,
            INTERLEAVED=interleaved,
            **dot_flags(x.dtype, x.device), **tile_constexprs(cfg), **launch_options(cfg),
        )  # fmt: skip
        if splits > 1:
            splitk_reduce(target, bias, y)
    return y


def _w4a16_2d_fake(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    group_size: int,
    format: str,
) -> torch.Tensor:
    n = qweight.shape[1] * 8 if format == "awq" else qweight.shape[1]
    return x.new_empty((x.shape[0], n))


w4a16_op = define_op("gemm_w4a16_triton", _w4a16_2d, fake=_w4a16_2d_fake)


def w4a16(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    """``gemm.w4a16`` on Triton: any leading dims of x are folded into M."""
    y = w4a16_op(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), qweight, scales, qzeros, bias, group_size, format)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def check(x, qweight, scales, qzeros=None, bias=None, group_size=128, format="gptq"):
    if group_size != -1 and group_size % _MIN_DOT_K:
        return f"group_size {group_size} is not a multiple of {_MIN_DOT_K} (one K step must stay in one group)"
    return None


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "gemm.w4a16", w4a16, custom_op=w4a16_op, check=check, check_scalars=("group_size",),
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton GEMM with GPTQ/AWQ int4 dequantized in the kernel, group-wise scales and zeros",
    ))


# GPTQ/AWQ checkpoints as loaded: packed qweight [K/8, N] (AWQ [K, N/8]), scales and zeros
# [groups, N(/8)], all row-major; contiguous activations and output.
UNIT_STRIDES = dict(stride_xk=1, stride_qn=1, stride_sn=1, stride_zn=1, stride_yn=1)


def _aot_variants():
    """Every M bucket's plan per target (N=K=4096, group 128; the split and unsplit store),
    GPTQ, AWQ and GPTQ interleaved, with and without zeros, for each activation dtype."""
    packed = dict(qw_ptr="*i32", qz_ptr="*i32")
    # (activation dtype, format, zeros)
    cases = (("fp16", "awq", True), ("fp16", "gptq", True), ("bf16", "gptq", False), ("fp32", "awq", True),
             ("fp16", "gptq_interleaved", True), ("bf16", "gptq_interleaved", False))
    sizes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for target in TARGETS:
        generation = GENERATION[target]
        for name, fmt, zeros in cases:
            plans = {}
            interleaved = fmt == "gptq_interleaved"
            for m in (1, 32, 64, 128, 4096):
                cfg = plan(m, 4096, 4096, sizes[name], "cuda", 128, interleaved=interleaved, generation=generation,
                           sms=SM_COUNT[generation])
                cfg["SPLIT_K"] = min(cfg["SPLIT_K"], 2)  # only switches the store path
                plans.setdefault(tuple(sorted((k, v) for k, v in cfg.items() if k != "K_PER_SPLIT")), cfg)
            for cfg in plans.values():
                flags = dict(AWQ=fmt == "awq", HAS_ZEROS=zeros, HAS_BIAS=True, SPLIT_K=cfg["SPLIT_K"], UPCAST=False,
                             PRECISION="ieee", **tile_constexprs(cfg))
                if interleaved:
                    flags["INTERLEAVED"] = True
                yield variant(_w4a16_kernel, flags, pointer=f"*{name}", options=launch_options(cfg),
                              targets=(target,), values=UNIT_STRIDES, **packed)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
