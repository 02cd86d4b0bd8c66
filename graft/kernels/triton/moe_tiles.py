"""Tiles of the fused-MoE GEMMs per layer shape: (experts, intermediate size) and rows per expert.

One "small" (decode) and one "large" (prefill) tile per architecture serve every MoE layer
badly somewhere: the grid of a fused-MoE GEMM is (M blocks, N tiles), one or more M blocks per
expert that received tokens, so the shape of the layer decides how many programs there are and
how often each expert's weights are read again. vLLM keys fused_moe's tiles by (E, N, device)
with a row per batch size; graft does the same, per architecture generation:
``SHAPES[generation][(num_experts, inter)]`` is a tuple of ``(max rows per expert, tile)`` rows,
and the first row whose bound the layer's average rows per expert (slots / experts) does not
exceed serves (``None``: no bound). A shape not listed takes the op's generic "small"/"large"
rows. ``inter`` is the intermediate size one rank holds (a tensor-parallel shard).

Why these rows (Hopper: 132 SMs, 227 KiB shared memory; CDNA3: 304 CUs, 64 KiB LDS):

- Many narrow experts at decode (DeepSeek-V3: 256 experts, top-8; Qwen3-MoE: 128, top-8): an
  expert gets one or two rows, so a 16-row M block is mostly padding and the work is reading
  weights. A narrow shard (intermediate 256 under TP8: GEMM 1 has 512 columns) leaves 4 N tiles
  of 128 per block: BLOCK_N 64 doubles the programs that stream weights, and BLOCK_K 128-256
  keeps each weight load wide.
- Few wide experts (Mixtral: 8 experts, intermediate 14336 or its TP2/TP4 shard): from tens of
  rows per expert on, each M block re-reads the expert's whole weight matrix; BLOCK_M 32 then
  64 then 128 (8 warps) halves those re-reads at each step while the grid still fills the GPU
  (intermediate 14336: 224 N tiles of GEMM 1 per M block).
- Every row stays within the target's shared memory with its pipeline depth (the AOT check,
  tests/test_triton_aot.py, compiles each row for sm_90 and gfx942 and fails on a spill).

No GPU has timed these rows yet: they follow from the grid and memory arithmetic above, as
the generic rows did. A GPU run's tile sweep (graft.tools.bench.tile_sweep) is what should replace
them; a vendor plugin may add rows for its devices with :func:`add_shape_tiles`.
"""
from __future__ import annotations

import torch

from graft.errors import GraftInputError
from graft.kernels.triton._autotune import bounded_rows, shape_key, tile_table
from graft.platform import device_info

# Rows per generation in tiles/<generation>.json ("moe_shapes": "<experts>x<inter>" -> rows),
# loaded once. Two row patterns, by the layer's class:
# * many narrow experts (DeepSeek-V3 / Qwen3-MoE class: about 1 row per expert at decode, 4-32
#   at small batches): bounds 4, 32, 128, none: decode, small, mid, large tiles;
#   256x2048 DeepSeek-V3 (EP), 256x256 DeepSeek-V3 (TP8), 128x768 Qwen3-30B-A3B;
# * few wide experts (Mixtral class: 8 wide experts, a quarter of the tokens each, top-2):
#   bounds 16, 64, 256, none: decode, mid, large, huge tiles;
#   8x14336 Mixtral 8x7B (TP1), 8x7168 (TP2), 8x3584 (TP4, hopper only: its huge row is the large one).
SHAPES: dict = {generation: {shape_key(name): rows for name, rows in bounded_rows(shapes).items()}
                for generation, shapes in tile_table("moe_shapes").items()}

_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def add_shape_tiles(generation: str, num_experts: int, inter: int, rows) -> None:
    """Add (or replace) the rows of one layer shape on one architecture generation (a vendor
    plugin's measured tiles). ``rows``: ``(max rows per expert or None, tile)`` pairs, bounds
    ascending, the last one None; each tile names every key of ``_KEYS`` with powers of two
    (BLOCK_M at least 16: the smallest tl.dot)."""
    rows = tuple((bound, dict(tile)) for bound, tile in rows)
    problems = []
    if not rows or rows[-1][0] is not None:
        problems.append("the last row must have no bound (None): every row count needs a tile")
    bounds = [b for b, _ in rows[:-1]]
    if any(not isinstance(b, int) or b < 1 for b in bounds) or bounds != sorted(set(bounds)):
        problems.append(f"bounds {bounds} must be positive ints, strictly ascending")
    for _, tile in rows:
        missing = [k for k in _KEYS if k not in tile]
        odd = [f"{k}={tile[k]}" for k in _KEYS if k in tile and (not isinstance(tile[k], int) or tile[k] < 1
                                                                  or tile[k] & (tile[k] - 1))]
        if missing or odd or tile.get("BLOCK_M", 16) < 16:
            problems.append(f"tile {tile}: " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"not powers of two: {odd}"] if odd else [])
                + (["BLOCK_M below 16"] if tile.get("BLOCK_M", 16) < 16 else [])))
    if problems:
        raise GraftInputError(f"MoE tiles for {generation} ({num_experts} experts, intermediate {inter}): "
                              + "; ".join(problems))
    SHAPES.setdefault(generation, {})[(int(num_experts), int(inter))] = rows


def generation_of(device) -> str:
    """The tile-table generation of ``device``: the interpreter's rows off the GPU."""
    device = torch.device(device)
    return device_info(device).generation if device.type == "cuda" else "interpreter"


def shape_tile(generation: str, num_experts: int, inter: int, num_slots: int) -> dict | None:
    """The tile listed for this layer shape and row count, or None (the generic rows serve)."""
    rows = SHAPES.get(generation, {}).get((num_experts, inter))
    if rows is None:
        return None
    per_expert = num_slots / max(num_experts, 1)
    for bound, tile in rows:
        if bound is None or per_expert <= bound:
            return dict(tile)
    return None  # pragma: no cover - add_shape_tiles requires an unbounded last row


def distinct_tiles(generation: str) -> list[dict]:
    """Every distinct tile the shape rows of ``generation`` can launch (the AOT check compiles each)."""
    seen: list[dict] = []
    for rows in SHAPES.get(generation, {}).values():
        for _, tile in rows:
            if tile not in seen:
                seen.append(dict(tile))
    return seen
