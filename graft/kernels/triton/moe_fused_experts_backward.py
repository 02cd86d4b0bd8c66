"""Backward of the Triton ``moe.fused_experts``: grouped GEMMs over the same expert-aligned
token blocks as the forward.

Per slot ``s`` (token ``t = s // top_k``, expert ``e``, routing weight ``r_s``), with
``[g; u] = x_t @ w13[e].T``, ``a = silu(g) * u`` and ``out_t = sum_s r_s * a @ w2[e].T``:

* ``ga_s = dout_t @ w2[e]`` (grouped row GEMM), ``d r_s = ga_s . a_s``,
* ``[dg; du] = silu_and_mul backward of r_s * ga_s`` (the Triton activation backward),
* ``dx_t = sum_s [dg; du]_s @ w13[e]`` (grouped row GEMM per slot, then the k slots summed
  in fixed order),
* ``dw2[e] = sum_{s in e} (r_s * dout_t)^T a_s`` and ``dw13[e] = sum_{s in e} [dg; du]_s^T x_t``
  (grouped weight-gradient GEMMs: one program per (expert, output tile) walks that expert's
  blocks, so no atomics and deterministic sums).

``[g; u]`` is recomputed (the forward keeps no intermediate); intermediates are fp32, rounded
to the input dtype only where they become a GEMM operand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._common import on_device
from graft.kernels.triton._dot import dot_acc, dot_flags
from graft.kernels.triton.fused_silu_and_mul import silu_and_mul_bwd_op, silu_and_mul_op
from graft.kernels.triton.moe_align_block_size import align_block_size_launch
from graft.kernels.triton.moe_fused_experts import _block_rows, fused_experts_triton

# ALIGN: rows per aligned block (also the K step of the weight-gradient GEMM).
# Rows per generation in tiles/<generation>.json ("moe_fused_experts_backward"), loaded once.
TILES = tile_table("moe_fused_experts_backward")


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_slots, a_div, K, N, num_n_tiles,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """c[s, :] = a[s // a_div, :] @ b[e(s)] (b[e] read as [K, N] through strides), fp32 accumulation."""
    pid = tl.program_id(0)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    slot, row_ok, expert = _block_rows(pid_m, sorted_ptr, expert_ids_ptr, num_slots, BLOCK_M)
    slot64 = slot.to(tl.int64)
    a_rows = a_ptr + (slot64 // a_div)[:, None] * stride_am
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_cols = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot_acc(a, b, acc, UPCAST, PRECISION)
    tl.store(c_ptr + slot64[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    l_ptr, r_ptr, d_ptr, scale_ptr, sorted_ptr, block_start_ptr, block_end_ptr,
    num_slots, l_div, r_div, top_k, M, N, num_n_tiles,
    stride_lm, stride_lc, stride_rm, stride_rc, stride_de, stride_dm, stride_dn, stride_st, stride_sk,
    HAS_SCALE: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """d[e] = sum over e's slots s of (scale_s * l[s // l_div])^T r[s // r_div]: one [BLOCK_M, BLOCK_N] tile."""
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    ms = (pid // num_n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (pid % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for blk in range(tl.load(block_start_ptr + e), tl.load(block_end_ptr + e)):
        slot = tl.load(sorted_ptr + blk * ALIGN + tl.arange(0, ALIGN))
        ok = slot < num_slots
        slot64 = slot.to(tl.int64)
        l_t = tl.load(l_ptr + (slot64 // l_div)[None, :] * stride_lm + ms[:, None] * stride_lc,
                      mask=m_ok[:, None] & ok[None, :], other=0.0)  # [BLOCK_M, ALIGN]
        if HAS_SCALE:
            s = tl.load(scale_ptr + (slot64 // top_k) * stride_st + (slot64 % top_k) * stride_sk, mask=ok, other=0.0)
            l_t = (l_t.to(tl.float32) * s.to(tl.float32)[None, :]).to(l_ptr.dtype.element_ty)
        r = tl.load(r_ptr + (slot64 // r_div)[:, None] * stride_rm + ns[None, :] * stride_rc,
                    mask=ok[:, None] & n_ok[None, :], other=0.0)  # [ALIGN, BLOCK_N]
        acc = dot_acc(l_t, r, acc, UPCAST, PRECISION)
    tl.store(d_ptr + e * stride_de + ms[:, None] * stride_dm + ns[None, :] * stride_dn,
             acc.to(d_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class _Groups:
    """The aligned layout of one call: sorted slots, per-block expert, per-expert block range."""

    def __init__(self, topk_ids, num_experts, align):
        self.sorted, self.expert_ids, self.post_pad = align_block_size_launch(topk_ids, align, num_experts)
        counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)[:num_experts]
        blocks = (counts + align - 1) // align  # on the device: no host sync
        self.block_end = torch.cumsum(blocks, 0).to(torch.int32)
        self.block_start = (self.block_end - blocks).to(torch.int32)
        self.num_slots = topk_ids.numel()
        self.top_k = topk_ids.shape[1]
        self.align = align


def _rows(g: _Groups, a, a_div, b, b_strides, K, N, out_dtype, cfg):
    """Grouped row GEMM (see _grouped_rows_kernel); b_strides = (expert, k, n)."""
    c = torch.empty((g.num_slots, N), dtype=out_dtype, device=a.device)
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    _grouped_rows_kernel[(g.expert_ids.numel() * n_tiles,)](
        a, b, c, g.sorted, g.expert_ids, g.post_pad, g.num_slots, a_div, K, N, n_tiles,
        a.stride(0), a.stride(1), *b_strides, c.stride(0), c.stride(1),
        BLOCK_M=g.align, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], **dot_flags(a.dtype, a.device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return c


def _wgrad(g: _Groups, left, l_div, right, r_div, out, scale, cfg):
    """out[e] = sum_{s in e} (scale_s left[s // l_div])^T right[s // r_div] (see _grouped_wgrad_kernel)."""
    num_experts, m, n = out.shape
    n_tiles = triton.cdiv(n, cfg["WG_N"])
    _grouped_wgrad_kernel[(triton.cdiv(m, cfg["WG_M"]) * n_tiles, num_experts)](
        left, right, out, scale if scale is not None else left, g.sorted, g.block_start, g.block_end,
        g.num_slots, l_div, r_div, g.top_k, m, n, n_tiles,
        left.stride(0), left.stride(1), right.stride(0), right.stride(1), *out.stride(),
        scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0,
        HAS_SCALE=scale is not None, ALIGN=g.align, BLOCK_M=cfg["WG_M"], BLOCK_N=cfg["WG_N"],
        **dot_flags(left.dtype, left.device), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _fused_experts_bwd(
    dout: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    dtype = hidden.dtype
    if num_tokens == 0:
        return (torch.zeros_like(hidden), torch.zeros_like(w13), torch.zeros_like(w2), torch.zeros_like(topk_weights))
    cfg = tile_config(TILES, hidden.device)
    dout = dout.contiguous()
    with on_device(hidden):
        g = _Groups(topk_ids, num_experts, cfg["ALIGN"])
        k = g.top_k
        # [g; u] per slot (fp32), its activation, and dout @ w2[e] per slot.
        gate_up = _rows(g, hidden, k, w13, (w13.stride(0), w13.stride(2), w13.stride(1)), hidden_size, 2 * inter,
                        torch.float32, cfg)
        act = silu_and_mul_op(gate_up)
        ga = _rows(g, dout, k, w2, (w2.stride(0), w2.stride(1), w2.stride(2)), hidden_size, inter, torch.float32, cfg)
        weights = topk_weights.reshape(-1, 1).float()
        d_weights = (ga * act).sum(-1).reshape(topk_weights.shape).to(topk_weights.dtype)
        dgu = silu_and_mul_bwd_op(ga * weights, gate_up).to(dtype)
        dx_slot = _rows(g, dgu, 1, w13, (w13.stride(0), w13.stride(1), w13.stride(2)), 2 * inter, hidden_size,
                        torch.float32, cfg)
        dx = dx_slot.view(num_tokens, k, hidden_size).sum(1).to(dtype)
        dw2 = _wgrad(g, dout, k, act.to(dtype), 1, torch.empty_like(w2), topk_weights, cfg)
        dw13 = _wgrad(g, dgu, 1, hidden, k, torch.empty_like(w13), None, cfg)
    return dx, dw13, dw2, d_weights


def _fused_experts_bwd_fake(
    dout: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(hidden), torch.empty_like(w13), torch.empty_like(w2), torch.empty_like(topk_weights))


fused_experts_bwd_op = define_op("moe_fused_experts_backward_triton", _fused_experts_bwd, fake=_fused_experts_bwd_fake)


def _setup(ctx, inputs, output):
    hidden, w13, w2, topk_weights, topk_ids, activation = inputs
    ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids)


def _backward(ctx, dout):
    dx, dw13, dw2, dw = fused_experts_bwd_op(dout, *ctx.saved_tensors)
    return dx, dw13, dw2, dw, None, None


register_backward(fused_experts_triton, _backward, _setup)


def _aot_variants():
    for target, cfg in per_target(TILES):
        flags = dict(UPCAST=False, PRECISION="ieee")
        opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        yield variant(_grouped_rows_kernel, dict(BLOCK_M=cfg["ALIGN"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                                 **flags), pointer="*bf16", options=opts, targets=(target,),
                      values=dict(stride_ak=1, stride_bn=1, stride_cn=1),  # dx and the down GEMM's grad
                      sorted_ptr="*i32", expert_ids_ptr="*i32", post_pad_ptr="*i32", c_ptr="*fp32")
        yield variant(_grouped_wgrad_kernel, dict(HAS_SCALE=True, ALIGN=cfg["ALIGN"], BLOCK_M=cfg["WG_M"],
                                                  BLOCK_N=cfg["WG_N"], **flags), pointer="*bf16", options=opts,
                      targets=(target,), values=dict(top_k=8, stride_lc=1, stride_rc=1, stride_dn=1, stride_sk=1),
                      scale_ptr="*fp32", sorted_ptr="*i32", block_start_ptr="*i32",
                      block_end_ptr="*i32")


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
