"""Flash-attention-2 style backward of ``attention.prefill`` (Triton), and the forward
variant that keeps the log-sum-exp for it.

The forward saves only the output and the per-row log-sum-exp (``[heads, total_q]`` fp32,
log2 domain), never the score matrix. The backward recomputes each score tile from q and k:

* ``delta[i] = sum_d out[i] * dout[i]`` (per row and head),
* ``p = exp2(s * scale * log2e - lse)``, ``dp = dout @ v^T``, ``ds = p * (dp - delta)``,
* ``dv = p^T @ dout``, ``dk = scale * ds^T @ q``, ``dq = scale * ds @ k``.

Two kernels, no atomics: one program per (key tile, sequence, kv head) accumulates dk and dv
over every query tile *and every query head of its GQA group* (so dk/dv come out summed over
the group), one program per (query tile, sequence, head) accumulates dq. Causal masks are
bottom-right aligned as in the forward (query i sees key j <= i + seqlen_k - seqlen_q): a key
tile starts at the first query tile that can see it, a query tile stops at its horizon.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._aot import per_target, split_tiles, variant
from graft.kernels.triton._attention_common import LOG2E, head_dim_block, seq_bounds
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._common import on_device
from graft.kernels.triton._dot import dot_f32, dot_flags
from graft.kernels.triton.attention_prefill import _forward, prefill_op

# Rows per generation in tiles/<generation>.json ("attention_prefill_backward"), loaded once.
TILES = tile_table("attention_prefill_backward")


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, CuSeqlensQ, CuSeqlensK, total_q, total_k,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_dot, stride_doh, stride_dod,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_lh, qk_scale, sm_scale, head_dim,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    k_start, seqlen_k = seq_bounds(CuSeqlensK, seq, total_k)
    first_col = tile * BLOCK_N
    if first_col >= seqlen_k:
        return
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, seq, total_q)
    cols = first_col + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = cols < seqlen_k
    d_ok = offs_d < head_dim
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    shift = seqlen_k - seqlen_q
    m_begin = 0
    if CAUSAL:  # rows before first_col - shift see none of these keys
        m_begin = (tl.maximum(first_col - shift, 0) // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start_m in range(m_begin, seqlen_q, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < seqlen_q
            q_t = tl.load(Q + (q_start + rows)[None, :] * stride_qt + head * stride_qh + offs_d[:, None] * stride_qd,
                          mask=d_ok[:, None] & row_ok[None, :], other=0.0)  # [D, M]
            do = tl.load(DO + (q_start + rows)[:, None] * stride_dot + head * stride_doh + offs_d[None, :] * stride_dod,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
            lse = tl.load(Lse + head * stride_lh + q_start + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(Delta + head * stride_lh + q_start + rows, mask=row_ok, other=0.0)
            p_t = tl.exp2(dot_f32(k, q_t, UPCAST, PRECISION) * qk_scale - lse[None, :])  # [N, M]
            visible = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                visible = visible & (cols[:, None] <= rows[None, :] + shift)
            p_t = tl.where(visible, p_t, 0.0)
            dv += dot_f32(p_t.to(do.dtype), do, UPCAST, PRECISION)
            dp_t = dot_f32(v, tl.trans(do), UPCAST, PRECISION)  # [N, M]
            ds_t = p_t * (dp_t - delta[None, :])
            dk += dot_f32(ds_t.to(q_t.dtype), tl.trans(q_t), UPCAST, PRECISION)
    dk = dk * sm_scale
    tl.store(DK + (k_start + cols)[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + (k_start + cols)[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK, total_q, total_k,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh,
    stride_lh, qk_scale, sm_scale, head_dim,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
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
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    do = tl.load(DO + (q_start + rows)[:, None] * stride_dot + head * stride_doh + offs_d[None, :] * stride_dod,
                 mask=q_mask, other=0.0)
    lse = tl.load(Lse + head * stride_lh + q_start + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + head * stride_lh + q_start + rows, mask=row_ok, other=0.0)
    shift = seqlen_k - seqlen_q
    kv_end = seqlen_k
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(seqlen_k, first_row + BLOCK_M + shift), 0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seqlen_k
        kv_mask = d_ok[:, None] & col_ok[None, :]
        k_t = tl.load(K + (k_start + cols)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None] * stride_kd,
                      mask=kv_mask, other=0.0)  # [D, N]
        v_t = tl.load(V + (k_start + cols)[None, :] * stride_vt + kv_head * stride_vh + offs_d[:, None] * stride_vd,
                      mask=kv_mask, other=0.0)
        p = tl.exp2(dot_f32(q, k_t, UPCAST, PRECISION) * qk_scale - lse[:, None])  # [M, N]
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + shift)
        p = tl.where(visible, p, 0.0)
        dp = dot_f32(do, v_t, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dq += dot_f32(ds.to(k_t.dtype), tl.trans(k_t), UPCAST, PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + (q_start + rows)[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


def _bwd_tiles(device: torch.device, block_d: int, dtype: torch.dtype) -> dict:
    cfg = tile_config(TILES, device)
    if device.type == "cuda" and (block_d > 128 or dtype == torch.float32):
        cfg["BLOCK_M"], cfg["BLOCK_N"] = 32, 32  # dk, dv, k, v tiles stay within registers/shared memory
    return cfg


# ---------------------------------------------------------------------------- custom ops


def _prefill_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    out = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, softmax_scale, lse)
    return out, lse


def _prefill_lse_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _prefill_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    total_q, num_heads, head_dim = q.shape
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or k.shape[0] == 0 or batch == 0:
        return dq, dk, dv
    delta = (out.float() * dout.float()).sum(-1).t().contiguous()  # [heads, total_q]
    block_d = head_dim_block(head_dim)
    cfg = _bwd_tiles(q.device, block_d, q.dtype)
    common = dict(GROUP=num_heads // k.shape[1], CAUSAL=causal, BLOCK_D=block_d, **dot_flags(q.dtype, q.device), **cfg)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    with on_device(q):
        # grids bounded by the packed rows, as in the forward
        _dkdv_kernel[(triton.cdiv(min(max_seqlen_k, k.shape[0]), cfg["BLOCK_N"]), batch, k.shape[1])](
            q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], *strides,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            lse.stride(0), softmax_scale * LOG2E, softmax_scale, head_dim, **common,
        )
        _dq_kernel[(triton.cdiv(min(max_seqlen_q, total_q), cfg["BLOCK_M"]), batch, num_heads)](
            q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], *strides,
            dq.stride(0), dq.stride(1),
            lse.stride(0), softmax_scale * LOG2E, softmax_scale, head_dim, **common,
        )
    return dq, dk, dv


def _prefill_bwd_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


prefill_lse_op = define_op("attention_prefill_lse_triton", _prefill_lse, fake=_prefill_lse_fake)
prefill_bwd_op = define_op("attention_prefill_backward_triton", _prefill_bwd, fake=_prefill_bwd_fake)


def _setup_lse(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.params = (max_q, max_k, causal, scale)


def _backward_lse(ctx, dout, dlse):
    # lse is an auxiliary output (graft's prefill returns only out); its gradient is not propagated.
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = prefill_bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.params)
    return dq, dk, dv, None, None, None, None, None, None


def _setup_plain(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.params = (max_q, max_k, causal, scale)


def _backward_plain(ctx, dout):
    # The inference forward kept no log-sum-exp: recompute it (graft's prefill() calls the
    # LSE forward when gradients are needed, so only direct callers of this op pay this).
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    out, lse = prefill_lse_op(q.detach(), k.detach(), v.detach(), cu_q, cu_k, *ctx.params)
    dq, dk, dv = prefill_bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.params)
    return dq, dk, dv, None, None, None, None, None, None


register_backward(prefill_lse_op, _backward_lse, _setup_lse, name="attention.prefill (with LSE) on triton")
register_backward(prefill_op, _backward_plain, _setup_plain)


ODD_STRIDES_SPILL = ("odd strides (the unaligned specialisation, which no model's contiguous q/k/v or KV cache "
                     "launches) load element by element and spill on gfx942; aligned launches have 0 spills")


def _aot_variants():
    ints = dict(CuSeqlensQ="*i32", CuSeqlensK="*i32", qk_scale="fp32", sm_scale="fp32", Lse="*fp32", Delta="*fp32")
    for target, base in per_target(TILES):
        for name, dtype, causal, block_d in (("bf16", torch.bfloat16, True, 128), ("fp16", torch.float16, False, 64)):
            blocks, options = split_tiles(base)
            flags = dict(GROUP=4, CAUSAL=causal, BLOCK_D=block_d, UPCAST=False, PRECISION="ieee", **blocks)
            for kernel in (_dkdv_kernel, _dq_kernel):
                yield variant(kernel, flags, pointer=f"*{name}", options=options, targets=(target,),
                              values=dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_dod=1),
                              accept_spills={"gfx942 unaligned": ODD_STRIDES_SPILL}, **ints)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
