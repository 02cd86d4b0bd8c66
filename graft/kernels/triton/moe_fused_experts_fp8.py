"""Triton kernels for ``moe.fused_experts_fp8``: DeepSeek-V3-style fp8 experts.

The pipeline of :mod:`graft.kernels.triton.moe_fused_experts` (align, GEMM 1 with SiLU-and-mul,
weighted GEMM 2 per slot, ordered combine; grouped tile order; no host sync) with fp8
operands and block scales:

* activations are quantized per token per 128 features by one kernel launch each
  (``_quant_groups_kernel``, the same numbers as :func:`graft.quant.quantize_fp8_per_token_group`,
  which took eight torch ops): ``hidden`` before GEMM 1, the SiLU-and-mul rows (rounded to
  hidden's dtype) before GEMM 2. Not in GEMM 1's epilogue: a 128-feature group spans two of
  its gate/up tiles, whose amax would need a second pass;
* each K step is one 128-group (BLOCK_K divides 128): the fp8 MMA of the step goes into a
  fresh fp32 tile that is added to the accumulator times ``x_scale[row, g] *
  w_scale[e, col // 128, g]``, so every partial product is scaled exactly once.

Interpreted, fp8 tiles are widened to fp32 before the dot (as graft.kernels.triton.gemm_fp8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import custom_op_name, define_op
from graft.kernels.triton._aot import GENERATION, per_target, split_tiles, variant
from graft.kernels.triton._autotune import tile_config
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton.moe_align_block_size import align_block_size_launch
from graft.kernels.triton.moe_fused_experts import (
    COMBINE_BLOCK_H,
    SMALL_ROWS_PER_EXPERT,
    _combine_kernel,
    _grouped_tile,
    expert_tile,
    gate_up_ptrs,
    store_silu_and_mul,
    store_weighted,
)
from graft.kernels.triton.moe_fused_experts import DOWN_VALUES as _DOWN_VALUES
from graft.kernels.triton.moe_fused_experts import GATE_UP_VALUES as _GATE_UP_VALUES
from graft.kernels.triton.moe_fused_experts import TILES as _fused_tiles
from graft.kernels.triton.moe_fused_experts import slot_dtype
from graft.kernels.triton.moe_tiles import distinct_tiles, generation_of, shape_tile
from graft.platform import device_info, fp8_flavour_reason, triton_interpret
from graft.quant import FP8_BLOCK, fp8_max

OP = "moe.fused_experts_fp8"
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

def fp8_tile(tile: dict, generation: str) -> dict:
    """A bf16 tile as the fp8 kernels take it: BLOCK_K one 128-group (the scale block) on a GPU."""
    return dict(tile) if generation == "interpreter" else dict(tile, BLOCK_K=FP8_BLOCK)


# moe_fused_experts's tiles with BLOCK_K one 128-group (the scale block): 1-byte operands fit twice
# moe_fused_experts's K per stage in the same memory. The interpreter's tiles stay as they are.
TILES = {arch: {size: fp8_tile(cfg, arch) for size, cfg in sizes.items()} for arch, sizes in _fused_tiles.items()}


@triton.jit
def _gate_up_fp8_kernel(
    x_ptr, xs_ptr, w13_ptr, ws_ptr, act_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_slots, top_k, hidden_size, inter, num_m_blocks, num_n_tiles,
    stride_xt, stride_xh, stride_xst, stride_xsg, stride_we, stride_wn, stride_wh,
    stride_se, stride_sn, stride_sg, stride_as, stride_ai,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _grouped_tile(num_m_blocks, num_n_tiles, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    slot, row_ok, expert, cols, col_ok = expert_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_slots, inter,
                                                     BLOCK_M, BLOCK_N)
    token, x_rows, gate_cols, up_cols = gate_up_ptrs(x_ptr, w13_ptr, slot, top_k, expert, cols, inter, stride_xt,
                                                     stride_we, stride_wn)
    xs_rows = xs_ptr + token * stride_xst
    s_base = ws_ptr + expert * stride_se
    gate_scales = s_base + (cols // 128) * stride_sn  # 128: the scale block
    up_scales = s_base + ((cols + inter) // 128) * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        group = k0 // 128
        x = tl.load(x_rows + ks[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_cols + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        x_scale = tl.load(xs_rows + group * stride_xsg, mask=row_ok, other=0.0)[:, None]
        g_scale = tl.load(gate_scales + group * stride_sg, mask=col_ok, other=0.0)[None, :]
        u_scale = tl.load(up_scales + group * stride_sg, mask=col_ok, other=0.0)[None, :]
        acc_gate += tl.dot(x, w_gate, out_dtype=tl.float32) * (x_scale * g_scale)
        acc_up += tl.dot(x, w_up, out_dtype=tl.float32) * (x_scale * u_scale)
    store_silu_and_mul(acc_gate, acc_up, act_ptr, slot, cols, row_ok, col_ok, stride_as, stride_ai)


@triton.jit
def _down_fp8_kernel(
    a_ptr, as_ptr, w2_ptr, ws_ptr, slot_out_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_slots, top_k, hidden_size, inter, num_m_blocks, num_n_tiles,
    stride_as, stride_ai, stride_ass, stride_asg, stride_we, stride_wh, stride_wi,
    stride_se, stride_sh, stride_sg, stride_os, stride_oh, stride_rt, stride_rk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _grouped_tile(num_m_blocks, num_n_tiles, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    slot, row_ok, expert, cols, col_ok = expert_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_slots, hidden_size,
                                                     BLOCK_M, BLOCK_N)
    slot64 = slot.to(tl.int64)
    a_rows = a_ptr + slot64[:, None] * stride_as
    as_rows = as_ptr + slot64 * stride_ass
    w_cols = w2_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wh
    s_cols = ws_ptr + expert * stride_se + (cols // 128) * stride_sh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        group = k0 // 128
        a = tl.load(a_rows + ks[None, :] * stride_ai, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        a_scale = tl.load(as_rows + group * stride_asg, mask=row_ok, other=0.0)[:, None]
        w_scale = tl.load(s_cols + group * stride_sg, mask=col_ok, other=0.0)[None, :]
        acc += tl.dot(a, w, out_dtype=tl.float32) * (a_scale * w_scale)
    store_weighted(acc, slot_out_ptr, weights_ptr, slot64, cols, row_ok, col_ok, top_k, stride_rt, stride_rk,
                   stride_os, stride_oh)


@triton.jit
def _quant_groups_kernel(
    x_ptr, q_ptr, s_ptr, cols, num_groups, stride_xm, stride_xk, stride_qm, stride_sm,
    FP8_MAX: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """BLOCK_G groups of one row: scale = amax / FP8_MAX (1 where amax is 0 or a group holds
    a NaN, as torch.where(amax > 0, ...) decides for a NaN amax), q = clamp(x / scale) in fp8.
    IEEE division (div_rn): Triton's ``/`` on fp32 is the approximate one on GPUs."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    k = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = k < cols
    x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.where((amax > 0) & ~has_nan, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))  # (NaN stays NaN, as in torch.clamp)
    tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < num_groups)


QUANT_GROUPS_PER_PROGRAM = 8  # 8 x 128 features a program: 56 groups of a 7168 hidden in 7 programs


def quantize_act_launch(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple:
    """``x [M, K]`` (any strides) -> ``(q [M, K] fp8, scale [M, ceil(K / 128)] fp32)``, contiguous."""
    rows, cols = x.shape
    num_groups = triton.cdiv(cols, FP8_BLOCK)
    # Interpreted, the kernel writes the clamped fp32 values and torch rounds them to fp8: the
    # interpreter's own fp32 -> fp8e4nv conversion is wrong near the top of a binade (124.3 -> 64).
    interpreted = triton_interpret()
    q = torch.empty((rows, cols), dtype=torch.float32 if interpreted else fp8_dtype, device=x.device)
    scale = torch.empty((rows, num_groups), dtype=torch.float32, device=x.device)
    if q.numel():
        block_g = min(QUANT_GROUPS_PER_PROGRAM, triton.next_power_of_2(num_groups))
        _quant_groups_kernel[(rows, triton.cdiv(num_groups, block_g))](
            x, q, scale, cols, num_groups, x.stride(0), x.stride(1), q.stride(0), scale.stride(0),
            FP8_MAX=fp8_max(fp8_dtype), GROUP=FP8_BLOCK, BLOCK_G=block_g,
        )
    return (q.to(fp8_dtype) if interpreted else q), scale


def launch_config(num_slots: int, num_experts: int, inter: int, device) -> dict:
    """moe_fused_experts's choice (the row for this layer shape, else the generic row), fp8's BLOCK_K."""
    generation = generation_of(device)
    tile = shape_tile(generation, num_experts, inter, num_slots)
    if tile is not None:
        return fp8_tile(tile, generation)
    table = tile_config(TILES, device)
    return dict(table["small"] if num_slots < SMALL_ROWS_PER_EXPERT * num_experts else table["large"])


def _fused_experts_fp8(
    hidden: torch.Tensor, w13_q: torch.Tensor, w2_q: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
) -> torch.Tensor:
    num_tokens, hidden_size = hidden.shape
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    num_experts, inter = w13_q.shape[0], w13_q.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    cfg = launch_config(num_slots, num_experts, inter, hidden.device)
    block_m, block_n, block_k, group_m = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    flags = dict(UPCAST=triton_interpret(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    with on_device(hidden.device):
        sorted_ids, expert_ids, post_pad = align_block_size_launch(topk_ids, block_m, num_experts)
        max_blocks = expert_ids.numel()
        x_q, x_s = quantize_act_launch(hidden, w13_q.dtype)
        act = torch.empty((num_slots, inter), dtype=hidden.dtype, device=hidden.device)
        gate_n = block_n // 2
        n_tiles = triton.cdiv(inter, gate_n)
        _gate_up_fp8_kernel[(max_blocks * n_tiles,)](
            x_q, x_s, w13_q, w13_scale, act, sorted_ids, expert_ids, post_pad,
            num_slots, top_k, hidden_size, inter, max_blocks, n_tiles,
            x_q.stride(0), x_q.stride(1), x_s.stride(0), x_s.stride(1),
            w13_q.stride(0), w13_q.stride(1), w13_q.stride(2),
            w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2), act.stride(0), act.stride(1),
            BLOCK_M=block_m, BLOCK_N=gate_n, BLOCK_K=block_k, GROUP_M=group_m, **flags,
        )  # fmt: skip
        a_q, a_s = quantize_act_launch(act, w2_q.dtype)
        slot_out = torch.empty((num_slots, hidden_size), dtype=slot_dtype(hidden.dtype), device=hidden.device)
        n_tiles = triton.cdiv(hidden_size, block_n)
        _down_fp8_kernel[(max_blocks * n_tiles,)](
            a_q, a_s, w2_q, w2_scale, slot_out, topk_weights, sorted_ids, expert_ids, post_pad,
            num_slots, top_k, hidden_size, inter, max_blocks, n_tiles,
            a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1),
            w2_q.stride(0), w2_q.stride(1), w2_q.stride(2), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
            slot_out.stride(0), slot_out.stride(1), topk_weights.stride(0), topk_weights.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, **flags,
        )  # fmt: skip
        block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(hidden_size))
        _combine_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
            slot_out, out, topk_ids, hidden_size, top_k, w13_q.shape[0], out.stride(0), out.stride(1),
            topk_ids.stride(0), topk_ids.stride(1), BLOCK_H=block_h,
        )
    return out


def _fused_experts_fp8_fake(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation):
    return hidden.new_empty(hidden.shape)


fused_experts_fp8_triton = define_op(custom_op_name(OP, "triton"), _fused_experts_fp8, fake=_fused_experts_fp8_fake)


def _call(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    return fused_experts_fp8_triton(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation)


def check(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    if w13_q.device.type == "cuda":  # the interpreter runs both flavours exactly
        return fp8_flavour_reason(w13_q.dtype, device_info(w13_q.device).arch)
    return None


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, _call, custom_op=fused_experts_fp8_triton, dtypes=DTYPES, check=check, check_scalars=(),
        description="fp8 block-scaled grouped expert GEMMs (DeepSeek-V3 style), grouped tile order, ordered combine",
    ))


# DeepSeek-V3 (see moe_fused_experts.GATE_UP_VALUES) with fp8 weights and 128x128 block
# scales: activation scales [T, 56] and [slots, 16], weight scales [E, 32, 56] and [E, 56, 16].
GATE_UP_FP8_VALUES = dict(_GATE_UP_VALUES, stride_xst=56, stride_xsg=1, stride_se=32 * 56, stride_sn=56, stride_sg=1)
DOWN_FP8_VALUES = dict(_DOWN_VALUES, stride_ass=16, stride_asg=1, stride_se=56 * 16, stride_sh=16, stride_sg=1)


def _aot_variants():
    """Per target: both GEMMs for the "large" and "small" tiles, bf16 activations; fp8 e4m3
    is fp8e4nv on sm_90 and the fnuz fp8e4b8 on gfx942."""
    fp8_type = {"sm_90": "*fp8e4nv", "gfx942": "*fp8e4b8"}
    fp8_max = {"sm_90": 448.0, "gfx942": 240.0}
    routing = dict(sorted_ptr="*i32", expert_ids_ptr="*i32", post_pad_ptr="*i32")
    for target, table in per_target(TILES):
        fp8 = fp8_type[target]
        # hidden (7168 = 56 groups) quantized before GEMM 1
        yield variant(_quant_groups_kernel, dict(FP8_MAX=fp8_max[target], GROUP=128, BLOCK_G=QUANT_GROUPS_PER_PROGRAM),
                      pointer="*bf16", targets=(target,), q_ptr=fp8, s_ptr="*fp32",
                      values=dict(cols=7168, num_groups=56, stride_xm=7168, stride_xk=1, stride_qm=7168, stride_sm=56))
        shaped = [fp8_tile(t, GENERATION[target]) for t in distinct_tiles(GENERATION[target])]
        for tile in [table["large"], table["small"]] + [t for t in shaped if t not in table.values()]:
            blocks, options = split_tiles(tile)
            flags = dict(UPCAST=False, BLOCK_M=blocks["BLOCK_M"], BLOCK_K=blocks["BLOCK_K"], GROUP_M=blocks["GROUP_M"])
            yield variant(_gate_up_fp8_kernel, dict(flags, BLOCK_N=blocks["BLOCK_N"] // 2), pointer="*bf16",
                          options=options, targets=(target,), values=GATE_UP_FP8_VALUES, x_ptr=fp8, w13_ptr=fp8, xs_ptr="*fp32", ws_ptr="*fp32",
                          **routing)
            yield variant(_down_fp8_kernel, dict(flags, BLOCK_N=blocks["BLOCK_N"]), pointer="*bf16", options=options,
                          targets=(target,), values=DOWN_FP8_VALUES, a_ptr=fp8, w2_ptr=fp8, as_ptr="*fp32", ws_ptr="*fp32",
                          slot_out_ptr="*bf16", weights_ptr="*fp32", **routing)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
