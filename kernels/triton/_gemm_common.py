"""Pieces shared by the Triton GEMM kernels: tile order, epilogue activations, tile tables.

The dot precision policy is graft.kernels.triton._dot's, as for every kernel family."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program, walking bands of GROUP_M row tiles column by
    column, so programs running together share column tiles of the weight and row tiles of x
    in L2 instead of sweeping all of x for each column tile."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_band = GROUP_M * tiles_n
    band = pid // per_band
    band_start = band * GROUP_M
    band_rows = tl.minimum(tiles_m - band_start, GROUP_M)
    within = pid - band * per_band
    return band_start + within % band_rows, within // band_rows


@triton.jit
def activate(y, ACTIVATION: tl.constexpr):
    """Epilogue activation on fp32 values (names as in graft.ops.gemm.ACTIVATIONS)."""
    if ACTIVATION == "relu":
        y = tl.maximum(y, 0.0)
    elif ACTIVATION == "gelu":
        # tanh approximation; tanh(u) = 2 * sigmoid(2u) - 1 keeps to ops every backend has.
        inner = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACTIVATION == "gelu_erf":
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACTIVATION == "silu":
        y = y * tl.sigmoid(y)
    return y


def pick_tiles(tables: dict, m: int, device) -> dict:
    """Tile config for an ``m``-row problem: the ``"small_m"`` table for decode-like M."""
    from graft.kernels.triton._autotune import tile_config

    small = tables.get("small_m")
    if small is not None and m <= small["default"]["BLOCK_M"]:
        return tile_config(small, device)
    return tile_config(tables["large_m"], device)
