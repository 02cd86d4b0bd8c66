"""Triton kernel for ``moe.topk_routing``: fp32 softmax/sigmoid scores and top-k per token.

One program handles BLOCK_T tokens with all experts in one tile (experts padded to a
power of two), so the op is limited to ``num_experts <= MAX_EXPERTS``; larger router
widths fall back to the torch reference through the per-call check.

Top-k is k rounds of "take the row maximum, then knock it out". Ties pick the lowest
expert id (the min index among the maximal scores), the same rule as the reference's
stable descending sort; NaN scores rank highest, as there (never an invalid id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import custom_op_name, define_op
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._common import on_device, triton_implementation

OP = "moe.topk_routing"
MAX_EXPERTS = 1024

# Elements (tokens x padded experts) per program: bigger tiles amortize the launch on a
# GPU; the interpreter runs one numpy op per tile op, so fewer, larger tiles are faster too.
# Rows per generation in tiles/<generation>.json ("moe_topk_routing"), loaded once.
TILES = tile_table("moe_topk_routing")


@triton.jit
def _topk_routing_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    num_tokens, num_experts, stride_lt, stride_le,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :] * stride_le,
        mask=row_ok[:, None] & col_ok[None, :], other=0.0,
    ).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    # Ranking keys: a NaN score ranks above every number (torch.sort's order, the
    # reference's), so the picks stay real expert ids; padding experts can never win
    # (every real score is >= 0), taken ones are knocked down to -2.
    keys = tl.where(scores != scores, 2.0, scores)
    keys = tl.where(col_ok[None, :], keys, -1.0)

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in range(TOP_K):
        best = tl.max(keys, axis=1)
        best_id = tl.min(tl.where(keys == best[:, None], cols[None, :], BLOCK_E), axis=1)
        picked = cols[None, :] == best_id[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)  # the score itself (NaN stays NaN)
        top_w = tl.where(slots[None, :] == j, weight[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, best_id[:, None], top_i)
        keys = tl.where(picked, -2.0, keys)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]

    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    mask = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


def _launch_config(num_experts: int, device) -> tuple[int, int, int]:
    cfg = tile_config(TILES, device)
    block_e = triton.next_power_of_2(max(num_experts, 1))
    block_t = max(1, min(128, cfg["elems"] // block_e))
    return block_t, block_e, cfg["num_warps"]


def _topk_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    block_t, block_e, num_warps = _launch_config(num_experts, device)
    grid = (triton.cdiv(num_tokens, block_t),)
    with on_device(device):
        _topk_routing_kernel[grid](
            router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0), router_logits.stride(1),
            TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize, num_warps=num_warps,
        )
    return weights, ids


def _topk_routing_fake(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = router_logits.shape[0]
    return (
        router_logits.new_empty((num_tokens, top_k), dtype=torch.float32),
        router_logits.new_empty((num_tokens, top_k), dtype=torch.int32),
    )


topk_routing_triton = define_op(custom_op_name(OP, "triton"), _topk_routing, fake=_topk_routing_fake)


def _check(router_logits, top_k, renormalize=True, scoring="softmax"):
    if router_logits.shape[1] > MAX_EXPERTS:
        return f"{router_logits.shape[1]} experts > {MAX_EXPERTS} (one tile holds a token's scores)"
    return None


def _call(router_logits, top_k, renormalize=True, scoring="softmax"):
    return topk_routing_triton(router_logits, top_k, renormalize, scoring)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, _call, custom_op=topk_routing_triton, check=_check, check_scalars=(),
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="one-tile fp32 softmax/sigmoid + iterative top-k",
    ))


def _aot_variants():
    """Per target: softmax and sigmoid scoring, few and many experts, each logits dtype."""
    for target, cfg in per_target(TILES):
        for dtype, experts, top_k, sigmoid, renorm in (("bf16", 64, 8, False, True), ("fp32", 8, 2, True, False),
                                                       ("fp16", 256, 6, False, False), ("bf16", 1024, 1, True, True)):
            block_e = triton.next_power_of_2(experts)
            flags = dict(TOP_K=top_k, BLOCK_T=max(1, min(128, cfg["elems"] // block_e)), BLOCK_E=block_e,
                         BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=sigmoid, RENORMALIZE=renorm)
            yield variant(_topk_routing_kernel, flags, pointer=f"*{dtype}", options={"num_warps": cfg["num_warps"]},
                          targets=(target,), values=dict(stride_le=1), weights_ptr="*fp32", ids_ptr="*i32")


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
