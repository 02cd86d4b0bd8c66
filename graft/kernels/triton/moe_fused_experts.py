"""Triton kernels for ``moe.fused_experts``: grouped expert GEMMs over aligned token blocks.

Pipeline (four launches, no host synchronisation, so it is CUDA-graph safe):

1. align: ``moe.align_block_size``'s kernels group the T*k (token, slot) pairs by expert,
   padded to BLOCK_M, so every M-block of rows belongs to a single expert.
2. ``_gate_up_kernel``: per (M-block, N-tile), ``gate`` and ``up`` tiles of
   ``x @ w13[e].T`` in two fp32 accumulators; the epilogue applies ``silu(gate) * up``
   (SiLU-and-mul fused into GEMM 1, no [T*k, 2I] buffer) and stores [T*k, I] rows
   indexed by flattened slot, in the activation dtype.
3. ``_down_kernel``: ``act @ w2[e].T`` per slot row, multiplied by the slot's routing
   weight, stored in fp32 per slot ([T*k, H]).
4. ``_combine_kernel``: out[t] = sum over j = 0..k-1 of the slot rows, in slot order, in
   fp32. A fixed-order reduction instead of atomic adds: results are bit-reproducible
   run to run.

Blocks past ``num_tokens_post_padded`` (the grid is sized from the static upper bound)
exit at once; padding rows (sentinel ids) are masked out of loads and stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import custom_op_name, define_op
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._aot import GENERATION, per_target, split_tiles, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.kernels.triton._dot import dot_acc, dot_flags
from graft.platform import device_info, is_rocm, triton_interpret
from graft.kernels.triton.moe_align_block_size import align_block_size_launch
from graft.kernels.triton.moe_tiles import distinct_tiles, generation_of, shape_tile

OP = "moe.fused_experts"
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

# "small": few rows per expert (decode), where a tall M tile would be mostly padding;
# "large": prefill. BLOCK_N is the output tile of GEMM 2; GEMM 1 computes BLOCK_N // 2
# gate columns and BLOCK_N // 2 up columns, the same accumulator footprint.
# Rows per generation in tiles/<generation>.json ("moe_fused_experts"), loaded once.
# interpreter: it costs per tile op, not per FLOP: few programs, small M padding.
# GROUP_M 2 there so the tests walk the grouped order's bands and their ragged last band.
TILES = tile_table("moe_fused_experts")
# GROUP_M: grouped tile order (see _grouped_tile). Prefill gives an expert many M blocks;
# walking GROUP_M of them per weight column tile keeps that tile in L2 instead of
# re-reading the expert's weights once per M block. Decode (one block per expert) gains
# nothing from it: GROUP_M 1 is plain row-major order, N tiles fastest.
SMALL_ROWS_PER_EXPERT = 32  # below this average, use the "small" tiles
COMBINE_BLOCK_H = 1024


@triton.jit
def _grouped_tile(num_m_blocks, num_n_tiles, GROUP_M: tl.constexpr):
    """(M block, N tile) of this program: bands of GROUP_M M blocks, walked N tile by N tile,
    M fastest inside a band. Aligned M blocks are sorted by expert, so a band is mostly
    one expert's blocks and they read the same weight tile together."""
    pid = tl.program_id(0)
    per_band = GROUP_M * num_n_tiles
    band = pid // per_band
    first = band * GROUP_M
    rows = tl.minimum(num_m_blocks - first, GROUP_M)
    within = pid - band * per_band
    return first + within % rows, within // rows


@triton.jit
def _block_rows(pid_m, sorted_ptr, expert_ids_ptr, num_slots, BLOCK_M: tl.constexpr):
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return slot, slot < num_slots, expert


@triton.jit
def expert_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_slots, n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The prologue of both expert GEMMs (bf16 and fp8): M block pid_m's slots, their
    expert, and N tile pid_n's columns below ``n``: ``(slot, row_ok, expert, cols, col_ok)``."""
    slot, row_ok, expert = _block_rows(pid_m, sorted_ptr, expert_ids_ptr, num_slots, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return slot, row_ok, expert, cols, cols < n


@triton.jit
def gate_up_ptrs(x_ptr, w13_ptr, slot, top_k, expert, cols, inter, stride_xt, stride_we, stride_wn):
    """GEMM 1's operand bases: the token rows of x, the gate and the up columns of w13
    (gate rows [0, inter), up rows [inter, 2 * inter)); returns ``(token, x_rows, gate, up)``."""
    token = (slot // top_k).to(tl.int64)
    w_base = w13_ptr + expert * stride_we
    gate = w_base + cols[None, :].to(tl.int64) * stride_wn
    up = w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn
    return token, x_ptr + token[:, None] * stride_xt, gate, up


@triton.jit
def store_silu_and_mul(acc_gate, acc_up, act_ptr, slot, cols, row_ok, col_ok, stride_as, stride_ai):
    """GEMM 1's epilogue: SiLU(gate) * up, one row per slot, in act's dtype."""
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = act_ptr + slot[:, None].to(tl.int64) * stride_as + cols[None, :] * stride_ai
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def store_weighted(acc, slot_out_ptr, weights_ptr, slot64, cols, row_ok, col_ok, top_k,
                   stride_rt, stride_rk, stride_os, stride_oh):  # fmt: skip
    """GEMM 2's epilogue: each slot's row times its routing weight, into its own slot row
    (the combine sums a token's slots in a fixed order)."""
    route_w = tl.load(weights_ptr + (slot64 // top_k) * stride_rt + (slot64 % top_k) * stride_rk, mask=row_ok, other=0.0)
    acc = acc * route_w.to(tl.float32)[:, None]
    out = slot_out_ptr + slot64[:, None] * stride_os + cols[None, :] * stride_oh
    tl.store(out, acc.to(slot_out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_slots, top_k, hidden_size, inter, num_m_blocks, num_n_tiles,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_as, stride_ai,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,  # see graft.kernels.triton._dot
):
    pid_m, pid_n = _grouped_tile(num_m_blocks, num_n_tiles, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    slot, row_ok, expert, cols, col_ok = expert_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_slots, inter,
                                                     BLOCK_M, BLOCK_N)
    _, x_rows, gate_cols, up_cols = gate_up_ptrs(x_ptr, w13_ptr, slot, top_k, expert, cols, inter, stride_xt,
                                                 stride_we, stride_wn)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        x = tl.load(x_rows + ks[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_cols + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        acc_gate = dot_acc(x, w_gate, acc_gate, UPCAST, PRECISION)
        acc_up = dot_acc(x, w_up, acc_up, UPCAST, PRECISION)
    store_silu_and_mul(acc_gate, acc_up, act_ptr, slot, cols, row_ok, col_ok, stride_as, stride_ai)


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, slot_out_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    num_slots, top_k, hidden_size, inter, num_m_blocks, num_n_tiles,
    stride_as, stride_ai, stride_we, stride_wh, stride_wi, stride_os, stride_oh, stride_rt, stride_rk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,  # see graft.kernels.triton._dot
    ACT_F32: tl.constexpr = False,  # fp32 activations (fp16 inputs): w is widened to match
):
    pid_m, pid_n = _grouped_tile(num_m_blocks, num_n_tiles, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    slot, row_ok, expert, cols, col_ok = expert_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_slots, hidden_size,
                                                     BLOCK_M, BLOCK_N)
    slot64 = slot.to(tl.int64)
    a_rows = act_ptr + slot64[:, None] * stride_as
    w_cols = w2_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_rows + ks[None, :] * stride_ai, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if ACT_F32:
            w = w.to(tl.float32)
        acc = dot_acc(a, w, acc, UPCAST, PRECISION)
    store_weighted(acc, slot_out_ptr, weights_ptr, slot64, cols, row_ok, col_ok, top_k, stride_rt, stride_rk,
                   stride_os, stride_oh)


@triton.jit
def _combine_kernel(
    slot_out_ptr, out_ptr, ids_ptr, hidden_size, top_k, num_experts, stride_ot, stride_oh, stride_it, stride_ik,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(top_k):  # fixed slot order: deterministic, no atomics
        # A skipped id (-1: another rank's expert; out of range) has no slot row: it adds nothing.
        expert = tl.full([BLOCK_H], 0, tl.int32) + tl.load(ids_ptr + token * stride_it + j * stride_ik)
        used = (expert >= 0) & (expert < num_experts)
        acc += tl.load(slot_out_ptr + (token * top_k + j) * hidden_size + cols, mask=ok & used, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=ok)


def slot_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-slot expert outputs (weighted, summed per token in fp32 by the combine): bf16
    for bf16 activations (half the bytes of the slot round trip, one rounding per slot as
    vLLM's fused_moe); fp32 otherwise (fp16's range could overflow a slot the sum stays within)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def launch_config(num_slots: int, num_experts: int, inter: int, device, dtype: torch.dtype) -> dict:
    """The tile of a launch: the row listed for this layer shape (moe_tiles), else the
    architecture's generic "small" (decode) or "large" (prefill) row."""
    cfg = shape_tile(generation_of(device), num_experts, inter, num_slots)
    if cfg is None:
        table = tile_config(TILES, device)
        cfg = dict(table["small"] if num_slots < SMALL_ROWS_PER_EXPERT * num_experts else table["large"])
    return _fit_gpu_tiles(cfg, dtype) if torch.device(device).type == "cuda" else cfg


def _fit_gpu_tiles(cfg: dict, dtype: torch.dtype) -> dict:
    cfg = dict(cfg)
    if dtype == torch.float32:
        # 4-byte tiles: halve K and cap the pipeline depth so the staged tiles still fit
        # in shared memory (228 KB on Hopper, 64 KB LDS on CDNA3).
        cfg["BLOCK_K"] = max(32, cfg["BLOCK_K"] // 2)
        cfg["num_stages"] = min(cfg["num_stages"], 3)
    return cfg


def tf32_or_ieee(device) -> str:
    """GEMM 2's precision for fp32 activations of fp16 inputs: TF32 where the GPU has it."""
    if triton_interpret() or (is_rocm() and device_info(device).arch != "gfx942"):
        return "ieee"
    return "tf32"


def _fused_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
) -> torch.Tensor:
    num_tokens, hidden_size = hidden.shape
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    cfg = launch_config(num_tokens * topk_ids.shape[1], w13.shape[0], w13.shape[1] // 2, hidden.device, hidden.dtype)
    with on_device(hidden.device):
        return _launch(hidden, w13, w2, topk_weights, topk_ids, out, cfg)


def _launch(hidden, w13, w2, topk_weights, topk_ids, out, cfg):
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    device = hidden.device
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_ids, expert_ids, post_pad = align_block_size_launch(topk_ids, block_m, num_experts)
    max_blocks = expert_ids.numel()
    # fp16 activations overflow (silu(g) * u past 65504) where the fp32 reference stays finite:
    # keep them in fp32 and run GEMM 2 as TF32 (fp16's mantissa, fp32's range).
    act_f32 = hidden.dtype == torch.float16
    act = torch.empty((num_slots, inter), dtype=torch.float32 if act_f32 else hidden.dtype, device=device)
    slot_out = torch.empty((num_slots, hidden_size), dtype=slot_dtype(hidden.dtype), device=device)
    flags = dict(
        **dot_flags(hidden.dtype, device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    gate_n = block_n // 2
    n_tiles = triton.cdiv(inter, gate_n)
    _gate_up_kernel[(max_blocks * n_tiles,)](
        hidden, w13, act, sorted_ids, expert_ids, post_pad,
        num_slots, top_k, hidden_size, inter, max_blocks, n_tiles,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), act.stride(1),
        BLOCK_M=block_m, BLOCK_N=gate_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"], **flags,
    )
    n_tiles = triton.cdiv(hidden_size, block_n)
    _down_kernel[(max_blocks * n_tiles,)](
        act, w2, slot_out, topk_weights, sorted_ids, expert_ids, post_pad,
        num_slots, top_k, hidden_size, inter, max_blocks, n_tiles,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        slot_out.stride(0), slot_out.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"], ACT_F32=act_f32,
        **(dict(flags, PRECISION=tf32_or_ieee(device)) if act_f32 else flags),
    )
    block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(hidden_size))
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        slot_out, out, topk_ids, hidden_size, top_k, num_experts, out.stride(0), out.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), BLOCK_H=block_h,
    )
    return out


def _fused_experts_fake(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


fused_experts_triton = define_op(custom_op_name(OP, "triton"), _fused_experts, fake=_fused_experts_fake)


def _call(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids, activation)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, _call, custom_op=fused_experts_triton, dtypes=DTYPES,
        description="aligned grouped GEMMs, SiLU-and-mul fused into GEMM 1, weighted GEMM 2, ordered combine",
    ))


# DeepSeek-V3's MoE as a launch sees it (256 experts, top-8, hidden 7168, intermediate 2048,
# 1024 tokens): contiguous hidden states [T, H], w13 [E, 2I, H], w2 [E, H, I], slot buffers
# [slots, I] and [slots, H], routing [T, 8]. Unit strides become JIT constants; 8 gets no
# divisibility hint, as at that launch.
DEEPSEEK_V3 = dict(top_k=8, hidden_size=7168, inter=2048, num_slots=8192)
GATE_UP_VALUES = dict(DEEPSEEK_V3, stride_xt=7168, stride_xh=1, stride_we=2 * 2048 * 7168, stride_wn=7168,
                      stride_wh=1, stride_as=2048, stride_ai=1)
DOWN_VALUES = dict(DEEPSEEK_V3, stride_as=2048, stride_ai=1, stride_we=7168 * 2048, stride_wh=2048, stride_wi=1,
                   stride_os=7168, stride_oh=1, stride_rt=8, stride_rk=1)
COMBINE_VALUES = dict(hidden_size=7168, top_k=8, num_experts=256, stride_ot=7168, stride_oh=1, stride_it=8,
                      stride_ik=1)


def _aot_variants():
    """Per target: both GEMMs for the "large" and "small" tiles and each dtype, and the combine."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    routing = dict(sorted_ptr="*i32", expert_ids_ptr="*i32", post_pad_ptr="*i32")
    for target, table in per_target(TILES):
        # The generic rows in every dtype; each per-shape row (moe_tiles) in bf16, the dtype
        # those layers run in.
        launches = [(table[size], name) for size, name in (("large", "bf16"), ("small", "fp16"), ("large", "fp32"),
                                                           ("small", "bf16"))]
        launches += [(tile, "bf16") for tile in distinct_tiles(GENERATION[target]) if tile not in table.values()]
        for tile, name in launches:
            blocks, options = split_tiles(_fit_gpu_tiles(tile, dtypes[name]))
            flags = dict(UPCAST=False, PRECISION="ieee", BLOCK_M=blocks["BLOCK_M"], BLOCK_K=blocks["BLOCK_K"],
                         GROUP_M=blocks["GROUP_M"])
            act = {"act_ptr": "*fp32"} if name == "fp16" else {}
            yield variant(_gate_up_kernel, dict(flags, BLOCK_N=blocks["BLOCK_N"] // 2), pointer=f"*{name}",
                          options=options, targets=(target,), values=GATE_UP_VALUES, **routing, **act)
            down = dict(flags, BLOCK_N=blocks["BLOCK_N"])
            if name == "fp16":  # fp32 activations, TF32 GEMM 2 (see _launch)
                yield variant(_down_kernel, dict(down, ACT_F32=True, PRECISION="tf32"), pointer="*fp16",
                              options=options, targets=(target,), values=DOWN_VALUES, act_ptr="*fp32",
                              slot_out_ptr="*fp32", weights_ptr="*fp32", **routing)
            else:
                yield variant(_down_kernel, down, pointer=f"*{name}", options=options, targets=(target,),
                              values=DOWN_VALUES, slot_out_ptr=f"*{'bf16' if name == 'bf16' else 'fp32'}",
                          weights_ptr="*fp32", **routing)
    for name, block_h in (("bf16", COMBINE_BLOCK_H), ("fp32", 64)):
        yield variant(_combine_kernel, dict(BLOCK_H=block_h), pointer=f"*{name}", slot_out_ptr=f"*{name}", ids_ptr="*i32",
                      values=COMBINE_VALUES)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
