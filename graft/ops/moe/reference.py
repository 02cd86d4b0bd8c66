"""The torch definitions of the MoE ops (routing, block alignment, the expert MLPs in fp32; fp8 dequantised)."""
from __future__ import annotations

import torch

from graft.ops._validate import acc, acc_dtype
from graft.quant import dequantize_fp8, FP8_BLOCK, quantize_fp8_per_token_group


def aligned_sizes(num_slots: int, block_size: int, num_experts: int) -> tuple[int, int]:
    """(len(sorted_token_ids), len(expert_ids)): fixed upper bounds, so fake impls can state them."""
    max_padded = num_slots + num_experts * (block_size - 1)
    return max_padded, -(-max_padded // block_size)


def valid_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Which ids take part: the others (-1, or out of range with the value checks off) are skipped."""
    return (ids >= 0) & (ids < num_experts)


def topk_routing_reference(router_logits, top_k, renormalize=True, scoring="softmax"):
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    # Ties -> lowest expert id: a stable descending sort keeps equal scores in id order.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(scores, 1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), order.to(torch.int32).contiguous()


def align_block_size_reference(topk_ids, block_size, num_experts):
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    max_padded, max_blocks = aligned_sizes(num_slots, block_size, num_experts)
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=device)
    slots = torch.nonzero(valid_ids(flat, num_experts)).flatten()  # skipped ids are never placed
    experts = flat[slots]
    counts = torch.bincount(experts, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(experts, stable=True).indices  # stable: slots of one expert in index order
    if slots.numel():
        rank = torch.arange(slots.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[experts[order]]
        sorted_ids[starts[experts[order]] + rank] = slots[order].to(torch.int32)
    total = int(padded.sum())
    blocks = torch.arange(total // block_size, device=device)
    ends_in_blocks = torch.cumsum(padded, 0) // block_size
    expert_ids[: total // block_size] = torch.searchsorted(ends_in_blocks, blocks, right=True).to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=device)


def fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    """A plain loop over experts with fp32 accumulation: the semantics every backend matches."""
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, hidden_size, dtype=acc_dtype(hidden), device=hidden.device)
    weights = acc(topk_weights)
    ids = topk_ids.long()
    for expert in range(w13.shape[0]):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        x = acc(hidden[tokens])
        gate_up = x @ acc(w13[expert]).t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ acc(w2[expert]).t()
        out.index_add_(0, tokens, y * weights[tokens, slots].unsqueeze(1))
    return out.to(hidden.dtype)


def quantize_act(x: torch.Tensor, fp8_dtype) -> tuple:
    """Per token per 128 features, as both GEMMs' activations are quantized."""
    return quantize_fp8_per_token_group(x, FP8_BLOCK, fp8_dtype)


def fused_experts_fp8_reference(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    num_tokens, hidden_size = hidden.shape
    inter = w13_q.shape[1] // 2
    fmt = w13_q.dtype
    x = dequantize_fp8(*quantize_act(hidden, fmt), (1, FP8_BLOCK))
    w13 = dequantize_fp8(w13_q, w13_scale, (FP8_BLOCK, FP8_BLOCK))
    w2 = dequantize_fp8(w2_q, w2_scale, (FP8_BLOCK, FP8_BLOCK))
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    weights, ids = topk_weights.float(), topk_ids.long()
    for expert in range(w13_q.shape[0]):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[expert].t()
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        act = dequantize_fp8(*quantize_act(act, fmt), (1, FP8_BLOCK))
        out.index_add_(0, tokens, (act @ w2[expert].t()) * weights[tokens, slots].unsqueeze(1))
    return out.to(hidden.dtype)
