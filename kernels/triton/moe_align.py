"""Triton kernels for ``moe.align_block_size``: group (token, slot) pairs by expert.

Three launches, none of which reads a value back to the host (so the op is CUDA-graph
safe and output sizes depend only on input shapes):

1. ``_count_kernel`` (one program per chunk of BLOCK_N flattened slots): per-expert counts
   of the chunk, from a one-hot [BLOCK_N, experts] tile.
2. ``_scan_kernel`` (one program): turns the chunk counts into each chunk's exclusive
   per-expert offset (in place), pads every expert's total to a multiple of block_size,
   writes each expert's start, the padded total and the expert of every block.
3. ``_scatter_kernel`` (one program per chunk): slot i goes to
   ``start[e] + chunk_offset[c, e] + rank of i among the chunk's slots of expert e``;
   the rank is a cumulative sum over the one-hot tile, so the order within an expert
   is the flattened index order (stable), exactly as the reference.

sorted_token_ids is pre-filled with the sentinel T*k, so padding needs no writes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import custom_op_name, define_op
from graft.kernels.triton._autotune import tile_config
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.ops.moe import aligned_sizes

OP = "moe.align_block_size"

# elems: one-hot tile size (slots x padded experts) per program; blocks: expert_ids
# entries written per step of the scan program.
TILES = {
    "hopper": {"elems": 8192, "blocks": 256, "num_warps": 8},
    "cdna3": {"elems": 8192, "blocks": 256, "num_warps": 8},
    "default": {"elems": 8192, "blocks": 128, "num_warps": 4},
    "interpreter": {"elems": 16384, "blocks": 256, "num_warps": 1},
}


@triton.jit
def _chunk_one_hot(ids_ptr, chunk, num_slots, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=ok, other=-1)  # -1 matches no expert
    one_hot = (expert[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return offs, ok, expert, one_hot


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_slots, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    _, _, _, one_hot = _chunk_one_hot(ids_ptr, chunk, num_slots, BLOCK_N, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(one_hot, axis=0))


@triton.jit
def _scan_kernel(
    counts_ptr, starts_ptr, expert_ids_ptr, post_pad_ptr,
    num_chunks, num_experts, max_blocks, block_size,
    BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for chunk in range(num_chunks):
        count = tl.load(counts_ptr + chunk * BLOCK_E + experts)
        tl.store(counts_ptr + chunk * BLOCK_E + experts, total)  # now: this chunk's offset per expert
        total += count
    padded = (total + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + experts, ends - padded)
    tl.store(post_pad_ptr, tl.sum(padded, axis=0))
    # Block b belongs to the first expert whose end (in blocks) is past b, i.e. to expert
    # #{e : end_e <= b}; empty experts share their neighbour's end and own no block.
    ends_in_blocks = ends // block_size
    for first in range(0, max_blocks, BLOCK_B):
        blocks = first + tl.arange(0, BLOCK_B)
        owner = tl.sum((ends_in_blocks[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)


@triton.jit
def _scatter_kernel(
    ids_ptr, counts_ptr, starts_ptr, sorted_ptr, num_slots,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs, ok, expert, one_hot = _chunk_one_hot(ids_ptr, chunk, num_slots, BLOCK_N, BLOCK_E)
    rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
    expert = tl.where(ok, expert, 0)
    base = tl.load(starts_ptr + expert) + tl.load(counts_ptr + chunk * BLOCK_E + expert)
    tl.store(sorted_ptr + base + rank, offs, mask=ok)


def _block_n(num_experts: int, device) -> tuple[int, int, dict]:
    cfg = tile_config(TILES, device)
    block_e = triton.next_power_of_2(max(num_experts, 2))
    block_n = max(16, triton.next_power_of_2(max(1, cfg["elems"] // block_e)))
    return block_n, block_e, cfg


def align_block_size_launch(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """The kernels' entry point (also used directly by the fused-experts kernel)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_slots = flat.numel()
    max_padded, max_blocks = aligned_sizes(num_slots, block_size, num_experts)
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    post_pad = torch.empty((1,), dtype=torch.int32, device=device)
    block_n, block_e, cfg = _block_n(num_experts, device)
    num_chunks = triton.cdiv(num_slots, block_n)
    counts = torch.empty((max(num_chunks, 1), block_e), dtype=torch.int32, device=device)
    starts = torch.empty((block_e,), dtype=torch.int32, device=device)
    warps = cfg["num_warps"]
    if num_chunks:
        _count_kernel[(num_chunks,)](flat, counts, num_slots, BLOCK_N=block_n, BLOCK_E=block_e, num_warps=warps)
    _scan_kernel[(1,)](
        counts, starts, expert_ids, post_pad, num_chunks, num_experts, max_blocks, block_size,
        BLOCK_E=block_e, BLOCK_B=cfg["blocks"], num_warps=warps,
    )
    if num_chunks:
        _scatter_kernel[(num_chunks,)](
            flat, counts, starts, sorted_ids, num_slots, BLOCK_N=block_n, BLOCK_E=block_e, num_warps=warps,
        )
    return sorted_ids, expert_ids, post_pad


def _align(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with on_device(topk_ids.device):
        return align_block_size_launch(topk_ids, block_size, num_experts)


def _align_fake(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_padded, max_blocks = aligned_sizes(topk_ids.numel(), block_size, num_experts)
    return (
        topk_ids.new_empty((max_padded,), dtype=torch.int32),
        topk_ids.new_empty((max_blocks,), dtype=torch.int32),
        topk_ids.new_empty((1,), dtype=torch.int32),
    )


align_block_size_triton = define_op(custom_op_name(OP, "triton"), _align, fake=_align_fake)


def _call(topk_ids, block_size, num_experts):
    return align_block_size_triton(topk_ids, block_size, num_experts)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, _call, custom_op=align_block_size_triton, dtypes={torch.int32},
        description="chunked one-hot count, single-program scan, stable scatter",
    ))


def _aot_variants():
    """Per target: the three kernels for 8, 64 and 256 experts (tiles sized as at launch)."""
    for target, cfg in per_target(TILES):
        for experts in (64, 8, 256):
            block_e = triton.next_power_of_2(experts)
            block_n = max(16, triton.next_power_of_2(cfg["elems"] // block_e))
            options = {"num_warps": cfg["num_warps"]}
            for kernel in (_count_kernel, _scatter_kernel):
                yield variant(kernel, dict(BLOCK_N=block_n, BLOCK_E=block_e), pointer="*i32", options=options,
                              targets=(target,))
            yield variant(_scan_kernel, dict(BLOCK_E=block_e, BLOCK_B=cfg["blocks"]), pointer="*i32",
                          options=options, targets=(target,))


AOT_VARIANTS = list(_aot_variants())
