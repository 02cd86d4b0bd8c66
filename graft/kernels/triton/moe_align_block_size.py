"""Triton kernels for ``moe.align_block_size``: group (token, slot) pairs by expert.

Four launches, none of which reads a value back to the host (so the op is CUDA-graph
safe and output sizes depend only on input shapes):

1. ``_count_kernel`` (one program per chunk of BLOCK_N flattened slots): per-expert counts
   of the chunk, from a one-hot [BLOCK_N, experts] tile.
2. ``_scan_kernel`` (one program per group of SCAN_E experts): turns the chunk counts into
   each chunk's exclusive per-expert offset (in place) and each expert's total, SCAN_C
   chunks per step (a cumulative sum down a [SCAN_C, SCAN_E] tile), so the serial part is
   num_chunks / SCAN_C steps instead of num_chunks.
3. ``_blocks_kernel`` (one program per BLOCK_B blocks): pads every expert's total to a
   multiple of block_size and writes the expert of each of its blocks; program 0 also
   writes each expert's start and the padded total.
4. ``_scatter_kernel`` (one program per chunk): slot i goes to
   ``start[e] + chunk_offset[c, e] + rank of i among the chunk's slots of expert e``;
   the rank is a cumulative sum over the one-hot tile, so the order within an expert
   is the flattened index order (stable), exactly as the reference.

Expert ids outside [0, num_experts) (-1 marks an expert on another rank under expert
parallelism) match no expert: they are neither counted nor stored, whatever the value
checks are set to, as in the reference. sorted_token_ids is pre-filled with the sentinel
T*k, so padding needs no writes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import custom_op_name, define_op
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.ops.moe import aligned_sizes

OP = "moe.align_block_size"

# elems: one-hot tile size (slots x padded experts) per program; blocks: expert_ids
# entries per program of the blocks kernel; scan: elements (chunks x experts) per scan step.
# Rows per generation in tiles/<generation>.json ("moe_align_block_size"), loaded once.
TILES = tile_table("moe_align_block_size")
SCAN_E_MAX = 64  # experts per scan program: more programs for wide routers


@triton.jit
def _chunk_one_hot(ids_ptr, chunk, num_slots, num_experts, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=ok, other=-1)
    # Only ids in [0, num_experts) take part: -1 (another rank's expert) and out-of-range
    # values match no column, so nothing is counted or stored for them.
    valid = ok & (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, -1)
    one_hot = (expert[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return offs, valid, expert, one_hot


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_slots, num_experts, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    _, _, _, one_hot = _chunk_one_hot(ids_ptr, chunk, num_slots, num_experts, BLOCK_N, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(one_hot, axis=0))


@triton.jit
def _scan_kernel(
    counts_ptr, totals_ptr, num_chunks,
    BLOCK_E: tl.constexpr, SCAN_E: tl.constexpr, SCAN_C: tl.constexpr,
):
    experts = tl.program_id(0) * SCAN_E + tl.arange(0, SCAN_E)
    rows = tl.arange(0, SCAN_C)
    carry = tl.zeros([SCAN_E], dtype=tl.int32)
    for first in range(0, num_chunks, SCAN_C):
        chunks = first + rows
        ptrs = counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :]
        ok = (chunks < num_chunks)[:, None]
        count = tl.load(ptrs, mask=ok, other=0)
        inclusive = tl.cumsum(count, axis=0)
        tl.store(ptrs, carry[None, :] + inclusive - count, mask=ok)  # now: the chunk's offset per expert
        carry += tl.sum(count, axis=0)
    tl.store(totals_ptr + experts, carry)


@triton.jit
def _blocks_kernel(
    totals_ptr, starts_ptr, expert_ids_ptr, post_pad_ptr, num_experts, max_blocks, block_size,
    BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    total = tl.load(totals_ptr + experts)
    padded = (total + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(starts_ptr + experts, ends - padded)
        tl.store(post_pad_ptr, tl.sum(padded, axis=0))
    # Block b belongs to the first expert whose end (in blocks) is past b, i.e. to expert
    # #{e : end_e <= b}; empty experts share their neighbour's end and own no block.
    ends_in_blocks = ends // block_size
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    owner = tl.sum((ends_in_blocks[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
    owner = tl.where(owner < num_experts, owner, -1)
    tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)


@triton.jit
def _scatter_kernel(
    ids_ptr, counts_ptr, starts_ptr, sorted_ptr, num_slots, num_experts,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs, valid, expert, one_hot = _chunk_one_hot(ids_ptr, chunk, num_slots, num_experts, BLOCK_N, BLOCK_E)
    rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
    expert = tl.where(valid, expert, 0)
    base = tl.load(starts_ptr + expert) + tl.load(counts_ptr + chunk * BLOCK_E + expert)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)


# _blocks_kernel compares BLOCK_B blocks with BLOCK_E expert ends in one [BLOCK_B, BLOCK_E]
# tile: past this many elements (256 x 256) it spills on gfx942 (44 VGPRs at 512 experts, 136
# at 1024 with BLOCK_B = 256), so wide routers take fewer blocks per program.
BLOCKS_TILE_ELEMS = 256 * 256


def blocks_per_program(block_e: int, cfg: dict) -> int:
    return max(16, min(cfg["blocks"], BLOCKS_TILE_ELEMS // block_e))


def _block_n(num_experts: int, device) -> tuple[int, int, dict]:
    cfg = tile_config(TILES, device)
    block_e = triton.next_power_of_2(max(num_experts, 2))
    block_n = max(16, triton.next_power_of_2(max(1, cfg["elems"] // block_e)))
    return block_n, block_e, cfg


def scan_tiles(block_e: int, cfg: dict) -> tuple[int, int]:
    """(SCAN_E, SCAN_C): experts per scan program and chunks per scan step."""
    scan_e = min(block_e, SCAN_E_MAX)
    return scan_e, max(1, cfg["scan"] // scan_e)


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
    totals = torch.empty((block_e,), dtype=torch.int32, device=device)
    starts = torch.empty((block_e,), dtype=torch.int32, device=device)
    warps = cfg["num_warps"]
    if num_chunks:
        _count_kernel[(num_chunks,)](flat, counts, num_slots, num_experts, BLOCK_N=block_n, BLOCK_E=block_e,
                                     num_warps=warps)
    scan_e, scan_c = scan_tiles(block_e, cfg)
    _scan_kernel[(block_e // scan_e,)](counts, totals, num_chunks, BLOCK_E=block_e, SCAN_E=scan_e, SCAN_C=scan_c,
                                       num_warps=warps)
    block_b = blocks_per_program(block_e, cfg)
    _blocks_kernel[(triton.cdiv(max_blocks, block_b),)](
        totals, starts, expert_ids, post_pad, num_experts, max_blocks, block_size,
        BLOCK_E=block_e, BLOCK_B=block_b, num_warps=warps,
    )
    if num_chunks:
        _scatter_kernel[(num_chunks,)](
            flat, counts, starts, sorted_ids, num_slots, num_experts, BLOCK_N=block_n, BLOCK_E=block_e,
            num_warps=warps,
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
        description="chunked one-hot count, parallel per-expert scan, stable scatter; invalid ids skipped",
    ))


def _aot_variants():
    """Per target: the four kernels for every padded expert count from 2 to 1024 (tiles as at launch)."""
    for target, cfg in per_target(TILES):
        options = {"num_warps": cfg["num_warps"]}
        for block_e in (64, 2, 4, 8, 16, 32, 128, 256, 512, 1024):
            block_n = max(16, triton.next_power_of_2(cfg["elems"] // block_e))
            scan_e, scan_c = scan_tiles(block_e, cfg)
            for kernel in (_count_kernel, _scatter_kernel):
                yield variant(kernel, dict(BLOCK_N=block_n, BLOCK_E=block_e), pointer="*i32", options=options,
                              targets=(target,))
            yield variant(_scan_kernel, dict(BLOCK_E=block_e, SCAN_E=scan_e, SCAN_C=scan_c), pointer="*i32",
                          options=options, targets=(target,))
            yield variant(_blocks_kernel, dict(BLOCK_E=block_e, BLOCK_B=blocks_per_program(block_e, cfg)), pointer="*i32",
                          options=options, targets=(target,))


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
