"""Triton W4A16 GEMM (``gemm.w4a16``): GPTQ or AWQ 4-bit weights dequantized in the kernel.

Each K step loads the int32 words holding a BLOCK_K x BLOCK_N tile of 4-bit codes, pulls
the nibbles out (layouts in :mod:`graft.quant`), subtracts the group's zero points and
feeds ``q - zero`` (small integers, exact in fp16/bf16) to tl.dot; the group's scale is
applied to the dot's fp32 result. BLOCK_K is chosen to divide group_size, so one K step
never straddles two groups and the scale is one row vector per step. That needs
group_size to be a multiple of 16 (the smallest tl.dot K); other group sizes fall back.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._aot import per_target, split_tiles, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._dot import dot_f32, dot_flags
from graft.kernels.triton._gemm_common import pick_tiles, tile_coords

TILES = {
    "large_m": {
        "hopper": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "cdna3": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
        "default": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
        "interpreter": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 1, "num_stages": 1},
    },
    # Decode: memory bound on the packed weight; wide K steps keep many loads in flight.
    "small_m": {
        "hopper": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
        "cdna3": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
        "default": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
        "interpreter": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 1, "num_stages": 1},
    },
}

_MIN_DOT_K = 16


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, y_ptr,
    M, N, K, GROUP_SIZE,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_ym, stride_yn,
    AWQ: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # dot flags: see graft.kernels.triton._dot
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    tile_m, tile_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # Column j of a pack of 8 sits in nibble j (GPTQ qzeros) or (j // 2) + 4 * (j % 2) (AWQ).
    lane = cols % 8
    if AWQ:
        col_shift = ((lane // 2) + 4 * (lane % 2)) * 4
    else:
        col_shift = lane * 4
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if AWQ:  # qweight [K, N/8], packed along N
            packed = tl.load(qw_ptr + kk[:, None] * stride_qk + (cols // 8)[None, :] * stride_qn, mask=w_mask, other=0)
            q = (packed >> col_shift[None, :]) & 0xF
        else:  # GPTQ qweight [K/8, N], packed along K
            packed = tl.load(qw_ptr + (kk // 8)[:, None] * stride_qk + cols[None, :] * stride_qn, mask=w_mask, other=0)
            q = (packed >> ((kk % 8) * 4)[:, None]) & 0xF
        group = k0 // GROUP_SIZE  # BLOCK_K divides GROUP_SIZE: the whole step is one group
        scale = tl.load(s_ptr + group * stride_sg + cols * stride_sn, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zp = tl.load(qz_ptr + group * stride_zg + (cols // 8) * stride_zn, mask=col_ok, other=0)
            zero = (zp >> col_shift) & 0xF
            if not AWQ:
                zero += 1  # GPTQ (AutoGPTQ v1) stores zero - 1
        else:
            zero = tl.full((BLOCK_N,), 8, dtype=tl.int32)
        if UPCAST:  # widen x first so the dequantized tile is built in fp32 too, never in interpreted bf16
            a = a.to(tl.float32)
        w = (q - zero[None, :]).to(a.dtype)  # small integers: exact in every float dtype
        # A non-finite scale must give what (q - zero) * scale gives the reference (0 * inf =
        # NaN), not dot * inf: fold such a column's scale into the tile; others stay outside.
        finite = tl.abs(scale) < float("inf")
        w = tl.where(finite[None, :], w, w.to(tl.float32) * scale[None, :]).to(a.dtype)
        acc += dot_f32(a, w, UPCAST, PRECISION) * tl.where(finite, scale, 1.0)[None, :]
        x_ptrs += BLOCK_K * stride_xk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block_k(configured: int, group_size: int) -> int:
    """Largest power of two <= configured that divides group_size (per channel: any)."""
    bk = configured
    while group_size != -1 and group_size % bk:
        bk //= 2
    return bk


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
    cfg = pick_tiles(TILES, m, x.device)
    bk = _block_k(cfg["BLOCK_K"], group_size)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    with on_device(x):
        _w4a16_kernel[grid](
            x, qweight, scales, zeros, bias if bias is not None else y, y,
            m, n, k, k if group_size == -1 else group_size,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
            scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1), y.stride(0), y.stride(1),
            AWQ=awq,
            HAS_ZEROS=qzeros is not None,
            HAS_BIAS=bias is not None,
            **dot_flags(x.dtype, x.device),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
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
        "gemm.w4a16", w4a16, custom_op=w4a16_op, check=check,
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton GEMM with GPTQ/AWQ int4 dequantized in the kernel, group-wise scales and zeros",
    ))


def _aot_variants():
    """Both tile tables per target; GPTQ and AWQ, with and without zeros, for each activation dtype."""
    packed = dict(qw_ptr="*i32", qz_ptr="*i32")
    for table in ("large_m", "small_m"):
        for target, cfg in per_target(TILES[table]):
            blocks, options = split_tiles(cfg)
            for dtype, awq, zeros in (("fp16", True, True), ("fp16", False, True), ("bf16", False, False),
                                      ("fp32", True, True)):
                flags = dict(AWQ=awq, HAS_ZEROS=zeros, HAS_BIAS=True, UPCAST=False, PRECISION="ieee", **blocks)
                yield variant(_w4a16_kernel, flags, pointer=f"*{dtype}", options=options, targets=(target,), **packed)


AOT_VARIANTS = list(_aot_variants())
