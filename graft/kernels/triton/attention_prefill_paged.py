"""Triton prefill attention reading keys/values through a paged cache's block table.

The prefill kernel's structure (attention_prefill.py): grid (query tiles of the longest
sequence, batch, query heads), an online softmax over BLOCK_N key tiles, causal tiles
stopping at their last row's horizon, unmasked tiles left of the diagonal. Keys are not a
packed tensor but tokens ``0 .. seq_len - 1`` of the sequence's block-table row, addressed
as the paged decode kernel does (attention_decode_paged.py): token ``j`` lives in block
``table[j // block_size]`` at slot ``j % block_size``, so any block size works, and a table
entry outside ``[0, num_blocks)`` is never dereferenced (its tokens take no part in the
softmax). vLLM's chunked prefill and prefix caching then need no gather of the cached
context into a contiguous K/V. Forward only (an inference path): no backward is registered.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._attention_common import (
    LOG2E,
    NEG_BIG,
    head_dim_block,
    head_dim_reason,
    resolve_scale,
    seq_bounds,
)
from graft.kernels.triton._aot import per_target, split_tiles, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._dot import dot_f32, dot_flags
from graft.kernels.triton.attention_prefill import TILES, _fit_gpu_tiles, _i64, _tiles, zero_unwritten_rows

OP = "attention.prefill_paged"


@triton.jit
def _paged_tile(
    q, acc, m_i, l_i, k_base, v_base, table, start_n, rows, seqlen_k, shift, qk_scale,
    block_size, num_blocks, stride_btb, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, d_ok,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over context tokens [start_n, start_n + BLOCK_N).

    MASKED=False: every token is inside the context and left of every row's causal
    horizon; only invalid block-table entries (and the head-dim padding) are masked."""
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED:
        col_ok = cols < seqlen_k
        block = tl.load(table + (cols // block_size) * stride_btb, mask=col_ok, other=0).to(tl.int64)
        block_ok = (block >= 0) & (block < num_blocks)
        tok_ok = block_ok & col_ok
    else:
        block = tl.load(table + (cols // block_size) * stride_btb).to(tl.int64)
        block_ok = (block >= 0) & (block < num_blocks)
        tok_ok = block_ok
    block = tl.where(block_ok, block, 0)
    slot = (cols % block_size).to(tl.int64)
    k_t = tl.load(k_base + block[None, :] * stride_kb + slot[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                  mask=tok_ok[None, :] & d_ok[:, None], other=0.0)
    # Scaled in fp32: folding the scale into a 16-bit q would add a rounding step.
    scores = dot_f32(q, k_t, UPCAST, PRECISION) * qk_scale
    visible = tok_ok[None, :]
    if MASKED and CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + shift)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + block[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, UPCAST, PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_paged_kernel(
    Q, KCache, VCache, BlockTables, CuSeqlensQ, SeqLens, Out, total_q,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    qk_scale,  # softmax_scale * log2(e)
    head_dim,
    block_size,
    num_blocks,  # physical blocks in the caches: table entries outside [0, num_blocks) are skipped
    max_blocks,  # block-table columns: seq_len is clamped to max_blocks * block_size
    GROUP: tl.constexpr,  # query heads per kv head
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # 64-bit strides: every index * stride is computed in int64 (a block id times the
    # block stride passes 2^31 elements on caches of a few GB).
    stride_qt, stride_qh, stride_qd = _i64(stride_qt), _i64(stride_qh), _i64(stride_qd)
    stride_kb, stride_kt, stride_kh, stride_kd = _i64(stride_kb), _i64(stride_kt), _i64(stride_kh), _i64(stride_kd)
    stride_vb, stride_vt, stride_vh, stride_vd = _i64(stride_vb), _i64(stride_vt), _i64(stride_vh), _i64(stride_vd)
    stride_ot, stride_oh, stride_od = _i64(stride_ot), _i64(stride_oh), _i64(stride_od)
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, seq, total_q)
    first_row = tile * BLOCK_M
    if first_row >= seqlen_q:
        return
    # Bounds-safe on any values (checks off, CUDA graphs): the length is clamped to the
    # table's capacity, so no table read passes the row.
    seqlen_k = tl.minimum(tl.maximum(tl.load(SeqLens + seq), 0), max_blocks * block_size).to(tl.int64)
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen_q
    d_ok = offs_d < head_dim
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    shift = seqlen_k - seqlen_q  # the queries are the context's last seqlen_q tokens
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(seqlen_k, first_row + BLOCK_M + shift), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, first_row + 1 + shift), 0)
    else:
        kv_end = seqlen_k
        full_end = seqlen_k
    full_end = (full_end // BLOCK_N) * BLOCK_N

    table = BlockTables + seq.to(tl.int64) * stride_bts
    k_base = KCache + kv_head * stride_kh
    v_base = VCache + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            q, acc, m_i, l_i, k_base, v_base, table, start_n, rows, seqlen_k, shift, qk_scale,
            block_size, num_blocks, stride_btb, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, d_ok,
            False, CAUSAL, BLOCK_N, BLOCK_D, UPCAST, PRECISION,
        )
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _paged_tile(
            q, acc, m_i, l_i, k_base, v_base, table, start_n, rows, seqlen_k, shift, qk_scale,
            block_size, num_blocks, stride_btb, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, d_ok,
            True, CAUSAL, BLOCK_N, BLOCK_D, UPCAST, PRECISION,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key: acc is 0, output 0
    o_ptrs = Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _prefill_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    causal: bool,
    softmax_scale: float,
) -> torch.Tensor:
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    # Empty: zero_unwritten_rows zeroes the rows the kernel does not write (as attention.prefill).
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        return out.zero_()
    block_d = head_dim_block(head_dim)
    cfg = _tiles(q.device, block_d, q.dtype)
    # An overstated max_seqlen_q must not size an enormous grid: no sequence has more rows than q.
    grid = (triton.cdiv(min(max_seqlen_q, total_q), cfg["BLOCK_M"]), batch, num_heads)
    zero_unwritten_rows(out, cu_seqlens_q, grid[0] * cfg["BLOCK_M"])
    with on_device(q):
        _prefill_paged_kernel[grid](
            q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out, total_q,
            *q.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
            softmax_scale * LOG2E,
            head_dim,
            block_size,
            key_cache.shape[0],
            block_tables.shape[1],
            GROUP=num_heads // num_kv_heads,
            CAUSAL=causal,
            BLOCK_D=block_d,
            **dot_flags(q.dtype, q.device),
            **cfg,
        )
    return out


def _prefill_paged_fake(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    causal: bool,
    softmax_scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


prefill_paged_op = define_op("attention_prefill_paged_triton", _prefill_paged, fake=_prefill_paged_fake)


def prefill_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, causal=False,
                  softmax_scale=None):
    """The op's signature on top of the custom op (which needs a concrete float scale)."""
    scale = resolve_scale(softmax_scale, q.shape[-1])
    # cu_seqlens_q and seq_lens are read with unit stride (block_tables with its strides).
    return prefill_paged_op(q, key_cache, value_cache, block_tables, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
                            int(max_seqlen_q),
                            bool(causal), scale)


def check(q, key_cache, value_cache, block_tables, cu_seqlens_q, *args, **kwargs):
    batch, num_heads = cu_seqlens_q.shape[0] - 1, q.shape[1]
    if batch > 65535 or num_heads > 65535:  # grid axes 1 and 2 of a CUDA launch
        return f"batch {batch} / num_heads {num_heads} exceed the 65535 launch-grid limit"
    return head_dim_reason(q.shape[-1])


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, prefill_paged, custom_op=prefill_paged_op, check=check, check_scalars=(),
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton prefill attention over a paged KV cache (block table read in the kernel, causal "
                    "bottom-right, GQA; forward only)",
    ))


UNIT_STRIDES = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_btb=1)  # contiguous rows: JIT constants
ODD_STRIDES_SPILL = ("odd strides (the unaligned specialisation, which no model's contiguous queries or paged KV cache "
                     "launches) load element by element and spill on gfx942; aligned launches have 0 spills")


def _aot_variants():
    """Per target: fp16/bf16/fp32, causal or not, head dims 64/128/256, GQA group 4."""
    types = dict(BlockTables="*i32", CuSeqlensQ="*i32", SeqLens="*i32", qk_scale="fp32")
    for target, base in per_target(TILES):
        for name, dtype, causal, block_d in (("fp16", torch.float16, True, 128), ("bf16", torch.bfloat16, False, 128),
                                             ("fp32", torch.float32, True, 64), ("bf16", torch.bfloat16, True, 256),
                                             ("fp32", torch.float32, False, 256)):
            blocks, options = split_tiles(_fit_gpu_tiles(base, block_d, dtype))
            flags = dict(GROUP=4, CAUSAL=causal, BLOCK_D=block_d, UPCAST=False, PRECISION="ieee", **blocks)
            yield variant(_prefill_paged_kernel, flags, pointer=f"*{name}", options=options, targets=(target,),
                          values=UNIT_STRIDES, accept_spills={"gfx942 unaligned": ODD_STRIDES_SPILL}, **types)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
