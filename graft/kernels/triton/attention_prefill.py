"""Triton flash-attention forward over packed variable-length sequences.

Grid: (query heads, batch, query tiles of the longest sequence). Each program owns
BLOCK_M query rows of one head of one sequence, streams that sequence's keys/values in
BLOCK_N tiles and keeps an online softmax (running max ``m``, running sum ``l``, fp32
accumulator) so the full score matrix never exists. Programs whose tile starts past
their sequence's end return at once (the grid is sized by ``max_seqlen_q``).

Programs start in grid order (heads fastest, tiles slowest), and a causal kernel numbers its
tiles from the last: the longest tiles (the last rows see the most keys) of every sequence and
head start first and the short ones fill the tail, instead of a wave of long tiles finishing
alone at the end.

Causal masks are bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q),
so a causal tile stops loading keys past its last row's horizon. Inputs may be strided
views (e.g. q/k/v sliced out of a fused qkv projection): every stride is passed in.
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
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._dot import dot_f32, dot_flags
from graft.kernels.triton._aot import per_target, split_tiles, variant
from graft.kernels.triton._common import on_device, triton_implementation

OP = "attention.prefill"

# BLOCK_M query rows x BLOCK_N keys per step, for head dims up to 128 in 16-bit types.
# Rows per generation in tiles/<generation>.json ("attention_prefill"), loaded once.
# cdna3 (gfx942): 4 waves of 128x64 took 332-343 VGPRs (one wave per SIMD: nothing hides a load's
# latency); 8 waves fitted to 2 per SIMD (waves_per_eu) take 229-242 and spill nothing
# (4 waves at waves_per_eu 2 spill 179-238). The AOT check holds every variant to 0 spills.
# interpreter: small tiles, fast, and short test sequences still span several tiles.
TILES = tile_table("attention_prefill")


@triton.jit
def _i64(x):
    """x as int64 (a runtime int or one the JIT specialised to the constant 1)."""
    return tl.cast(x, tl.int64)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_base, v_base, start_n, rows, seqlen_k, shift, qk_scale,
    stride_kt, stride_kd, stride_vt, stride_vd, d_ok,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N).

    MASKED=False is for tiles every row of the query tile fully sees (inside the
    sequence, left of the causal diagonal): no masks beyond the head-dim padding.
    """
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED:
        col_ok = cols < seqlen_k
        k_mask = col_ok[None, :] & d_ok[:, None]
        v_mask = col_ok[:, None] & d_ok[None, :]
    else:
        k_mask = d_ok[:, None]
        v_mask = d_ok[None, :]
    k_t = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None] * stride_kd, mask=k_mask, other=0.0)
    # Scaled in fp32: folding the scale into a 16-bit q would add a rounding step.
    scores = dot_f32(q, k_t, UPCAST, PRECISION) * qk_scale
    if MASKED:
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + shift)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, UPCAST, PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, total_q, total_k,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    qk_scale,  # softmax_scale * log2(e)
    head_dim,
    stride_lh,  # Lse is [heads, total_q] fp32, log2 domain
    GROUP: tl.constexpr,  # query heads per kv head
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    STORE_LSE: tl.constexpr = False,  # training: keep the log-sum-exp for the backward
):
    # 64-bit strides: every index * stride below is then computed in int64 (a row or head
    # offset passes 2^31 elements on long packed batches, e.g. ~350k tokens of a fused-QKV view).
    stride_qt, stride_qh, stride_qd = _i64(stride_qt), _i64(stride_qh), _i64(stride_qd)
    stride_kt, stride_kh, stride_kd = _i64(stride_kt), _i64(stride_kh), _i64(stride_kd)
    stride_vt, stride_vh, stride_vd = _i64(stride_vt), _i64(stride_vh), _i64(stride_vd)
    stride_ot, stride_oh, stride_od = _i64(stride_ot), _i64(stride_oh), _i64(stride_od)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    tile = tl.program_id(2)
    if CAUSAL:  # longest first (see the module docstring)
        tile = tl.num_programs(2) - 1 - tile
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, seq, total_q)
    first_row = tile * BLOCK_M
    if first_row >= seqlen_q:
        return
    k_start, seqlen_k = seq_bounds(CuSeqlensK, seq, total_k)
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen_q
    d_ok = offs_d < head_dim

    q_ptrs = Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    shift = seqlen_k - seqlen_q  # bottom-right alignment of the causal diagonal
    if CAUSAL:
        # Keys past the last row's horizon are invisible to the whole tile; keys up to the
        # first row's horizon are visible to all of it.
        kv_end = tl.maximum(tl.minimum(seqlen_k, first_row + BLOCK_M + shift), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, first_row + 1 + shift), 0)
    else:
        kv_end = seqlen_k
        full_end = seqlen_k
    full_end = (full_end // BLOCK_N) * BLOCK_N

    k_base = K + k_start * stride_kt + kv_head * stride_kh
    v_base = V + k_start * stride_vt + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Not warp-specialised: with tl.range(warp_specialize=True) here Triton 3.6 compiles the
    # same code for sm_90 (256 threads, 234 registers, no setmaxnreg; its pass splits simple
    # matmul loops fed by tensor descriptors, see gemm_linear._linear_tma_kernel).
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, start_n, rows, seqlen_k, shift, qk_scale,
            stride_kt, stride_kd, stride_vt, stride_vd, d_ok,
            False, CAUSAL, BLOCK_N, BLOCK_D, UPCAST, PRECISION,
        )
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, start_n, rows, seqlen_k, shift, qk_scale,
            stride_kt, stride_kd, stride_vt, stride_vd, d_ok,
            True, CAUSAL, BLOCK_N, BLOCK_D, UPCAST, PRECISION,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key: acc is 0, output 0
    out = acc / l_safe[:, None]
    o_ptrs = Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        # +inf for a row that sees no key: the backward's exp2(-inf - lse) is then 0, not NaN.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("inf"))
        tl.store(Lse + head * stride_lh + q_start + rows, lse, mask=row_ok)


@triton.jit
def _computed_rows(CuSeqlens, seqs, batch, total, span):
    """Rows [start, end) the forward's grid writes for each sequence of the vector ``seqs``:
    seq_bounds' clamped rows, cut to the ``span`` rows its tiles reach (an understated
    max_seqlen sizes a grid too short). Entries past ``batch`` are empty."""
    ok = seqs < batch
    start = tl.load(CuSeqlens + seqs, mask=ok, other=0).to(tl.int64)
    end = tl.load(CuSeqlens + seqs + 1, mask=ok, other=0).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.minimum(tl.maximum(end, start), total), start + span)
    return start, end


@triton.jit
def _zero_unwritten_kernel(
    Out, CuSeqlens, batch, total, span,
    stride_ot, stride_oh, stride_od,
    head_dim,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program per head: zero the rows of ``Out`` that no program of the forward writes.

    Valid cu_seqlens (from 0 to ``total``, non-decreasing, no sequence longer than ``span``)
    leave none: one pass over cu_seqlens finds that and the program ends. Values the checks
    would refuse (value checks off) can: rows before the first offset, after the last, or
    past an understated max_seqlen; they get the zeros the reference defines."""
    stride_ot, stride_oh, stride_od = _i64(stride_ot), _i64(stride_oh), _i64(stride_od)
    head = tl.program_id(0)
    first_start, first_end = _computed_rows(CuSeqlens, tl.arange(0, 1), batch, total, span)
    gaps = tl.sum((first_start != 0).to(tl.int32))
    for i in range(0, batch, BLOCK_B):
        seqs = i + tl.arange(0, BLOCK_B)
        starts, ends = _computed_rows(CuSeqlens, seqs, batch, total, span)
        following, following_ends = _computed_rows(CuSeqlens, seqs + 1, batch, total, span)
        following = tl.where(seqs + 1 < batch, following, total)
        gaps += tl.sum(((seqs < batch) & (ends != following)).to(tl.int32))
    if gaps > 0:
        offs_d = tl.arange(0, BLOCK_D)
        zeros = tl.zeros([ROWS, BLOCK_D], dtype=Out.dtype.element_ty)
        for row0 in range(0, total, ROWS):
            rows = row0 + tl.arange(0, ROWS).to(tl.int64)
            hits = tl.zeros([ROWS], dtype=tl.int32)
            for i in range(0, batch, BLOCK_B):
                starts, ends = _computed_rows(CuSeqlens, i + tl.arange(0, BLOCK_B), batch, total, span)
                inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])
                hits += tl.sum(inside.to(tl.int32), 1)
            unwritten = (hits == 0) & (rows < total)
            ptrs = Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
            tl.store(ptrs, zeros, mask=unwritten[:, None] & (offs_d < head_dim)[None, :])


# The zeroing pass: its rows per step and cu_seqlens entries per step.
ZERO_TILE = {"ROWS": 32, "BLOCK_B": 64, "num_warps": 4}


def zero_unwritten_rows(out: torch.Tensor, cu_seqlens_q: torch.Tensor, span: int) -> None:
    """Zero the rows of ``out`` ([total_q, heads, head_dim], allocated empty) that the forward
    over ``cu_seqlens_q`` with a grid of ``span`` rows per sequence does not write.

    This replaces a memset of the whole output by one launch that reads cu_seqlens (the same
    launch count as torch.zeros, without writing the output twice); kept out of the forward
    kernel, whose register allocation it would change (under Triton 3.9 it pushed the gfx942
    bf16 tile over 256 VGPRs)."""
    total_q, num_heads, head_dim = out.shape
    with on_device(out):
        _zero_unwritten_kernel[(num_heads,)](
            out, cu_seqlens_q, cu_seqlens_q.shape[0] - 1, total_q, span, *out.stride(), head_dim,
            BLOCK_D=head_dim_block(head_dim), ROWS=ZERO_TILE["ROWS"], BLOCK_B=ZERO_TILE["BLOCK_B"],
            num_warps=ZERO_TILE["num_warps"],
        )


def _tiles(device: torch.device, block_d: int, dtype: torch.dtype) -> dict:
    cfg = tile_config(TILES, device)
    return _fit_gpu_tiles(cfg, block_d, dtype) if device.type == "cuda" else cfg


def _fit_gpu_tiles(cfg: dict, block_d: int, dtype: torch.dtype) -> dict:
    """Keep the K/V tiles within shared memory for wide heads and 4-byte types."""
    cfg = dict(cfg)
    if block_d > 128:
        cfg["BLOCK_M"], cfg["BLOCK_N"] = min(cfg["BLOCK_M"], 64), min(cfg["BLOCK_N"], 32)
    if dtype == torch.float32:
        cfg["BLOCK_N"] = max(16, cfg["BLOCK_N"] // 2)
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    return cfg


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
) -> torch.Tensor:
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, None)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, lse):
    """Launch the forward; ``lse`` ([heads, total_q] fp32) is filled when given."""
    total_q, num_heads, head_dim = q.shape
    # Empty, not zeros: zero_unwritten_rows zeroes the rows the kernel does not write (none
    # for valid cu_seqlens) instead of a memset of the whole output before the kernel writes it.
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        if lse is not None:
            lse.fill_(float("inf"))
        return out.zero_()
    block_d = head_dim_block(head_dim)
    cfg = _tiles(q.device, block_d, q.dtype)
    # No sequence is longer than the packed rows (cu_seqlens are clamped to them): an
    # overstated max_seqlen_q must not size an enormous grid.
    grid = (num_heads, batch, triton.cdiv(min(max_seqlen_q, total_q), cfg["BLOCK_M"]))
    zero_unwritten_rows(out, cu_seqlens_q, grid[2] * cfg["BLOCK_M"])
    with on_device(q):
        _prefill_kernel[grid](
            q, k, v, out, lse if lse is not None else out, cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0],
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            softmax_scale * LOG2E,
            head_dim,
            total_q,
            GROUP=num_heads // k.shape[1],
            CAUSAL=causal,
            STORE_LSE=lse is not None,
            BLOCK_D=block_d,
            **dot_flags(q.dtype, q.device),
            **cfg,
        )
    return out


def _prefill_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


prefill_op = define_op("attention_prefill_triton", _prefill, fake=_prefill_fake)


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softmax_scale=None):
    """The op's signature on top of the custom op (which needs a concrete float scale).

    When a gradient is needed the forward that also returns the log-sum-exp runs (the
    backward needs it); inference keeps the forward that writes only the output."""
    from graft.kernels.triton.attention_prefill_backward import prefill_lse_op

    scale = resolve_scale(softmax_scale, q.shape[-1])
    # The kernel reads cu_seqlens with unit stride: a strided or expanded view would read other values.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return prefill_lse_op(*args)[0]
    return prefill_op(*args)


def check(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=0, *args, **kwargs):
    batch = cu_seqlens_q.shape[0] - 1
    if batch > 65535:  # grid axis 1 of a CUDA launch
        return f"batch {batch} exceeds the 65535 launch-grid limit"
    reason = head_dim_reason(q.shape[-1])
    if reason is None and q.device.type == "cuda":  # grid axis 2: query tiles
        tiles = triton.cdiv(min(int(max_seqlen_q), q.shape[0]), _tiles(q.device, head_dim_block(q.shape[-1]), q.dtype)["BLOCK_M"])
        if tiles > 65535:
            return f"max_seqlen_q {max_seqlen_q} needs {tiles} query tiles, over the 65535 launch-grid limit"
    return reason


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, prefill, custom_op=prefill_op, check=check, check_scalars=("max_seqlen_q",),
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton flash-attention forward (varlen, causal bottom-right, GQA)",
    ))


def _aot_variants():
    """Per target: fp16/bf16/fp32, causal or not, head dims 128/64/256, GQA group 4."""
    ints = dict(CuSeqlensQ="*i32", CuSeqlensK="*i32", qk_scale="fp32", Lse="*fp32")
    for target, base in per_target(TILES):
        for name, dtype, causal, block_d in (("fp16", torch.float16, True, 128), ("bf16", torch.bfloat16, False, 128),
                                             ("fp32", torch.float32, True, 64), ("bf16", torch.bfloat16, True, 256),
                                             ("fp32", torch.float32, False, 256), ("fp16", torch.float16, False, 64)):
            blocks, options = split_tiles(_fit_gpu_tiles(base, block_d, dtype))
            flags = dict(GROUP=4, CAUSAL=causal, BLOCK_D=block_d, UPCAST=False,
                         PRECISION="ieee", STORE_LSE=causal, **blocks)
            yield variant(_prefill_kernel, flags, pointer=f"*{name}", options=options, targets=(target,),
                          values=dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1), **ints)


def _zero_aot_variants():
    """The zeroing pass per target: 16-bit and fp32 outputs, head dims 128 and 256."""
    blocks, options = split_tiles(ZERO_TILE)
    for target in sorted({target for target, _ in per_target(TILES)}):
        for name, block_d in (("bf16", 128), ("fp32", 256)):
            yield variant(_zero_unwritten_kernel, dict(BLOCK_D=block_d, **blocks), pointer=f"*{name}", options=options,
                          targets=(target,), values=dict(stride_od=1), CuSeqlens="*i32")


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants()) + list(_zero_aot_variants())

from graft.kernels.triton import attention_prefill_backward  # noqa: E402,F401  registers the backward
