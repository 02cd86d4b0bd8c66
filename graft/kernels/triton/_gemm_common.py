"""Pieces shared by the Triton GEMM kernels (linear, W8A8, W4A16, fp8): tile order, the
prologue (this program's tile and K split, the int64 operand pointers and their K step),
epilogue activations and store, the one tile table (per architecture generation and M
range), split-K sizing and its deterministic reduce. Each kernel keeps only its own loads,
dequantisation and scaling.

Design (why the pieces look the way they do):

* **M buckets.** Decode-like M is memory bound on the weight: thin row tiles and long K
  steps keep many weight loads in flight. Prefill-like M is compute bound: wide tiles with
  deep pipelines. One table per architecture generation lists ``(max_m, config)`` rows.
* **K step in bytes.** A row's ``K_BYTES`` is the K step in bytes of the A operand, so one
  table serves fp32 (BLOCK_K = K_BYTES / 4), fp16/bf16 (/2) and int8/fp8 (/1) and the
  staged tiles take the same shared memory whatever the dtype. :func:`fit_shared` then
  trims stages (and K) against the target's limit; the AOT check verifies the result.
* **Split-K.** At small M the (M, N) tile grid has fewer programs than the GPU has SMs
  (N=4096 with 64-wide tiles: 64 programs on 132 SMs). :func:`split_k` splits K across
  programs until about two waves are in flight; each split writes its fp32 partial tile
  to a workspace ``[SPLIT_K, M, N]`` and :func:`splitk_reduce` sums the splits in a
  fixed order, then applies bias and activation: deterministic, no atomics.
* **Grouped order.** :func:`tile_coords` walks bands of GROUP_M row tiles column by
  column so concurrently running programs share weight tiles in L2.

The dot precision policy is graft.kernels.triton._dot's, as for every kernel generation.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graft.kernels.triton._autotune import bounded_rows, tile_table
from graft.platform import device_info

# Per-generation limits: shared memory per block (bytes) and SM/CU count for a device we
# cannot query (AOT checks, "what if" planning). A live GPU's SM count is queried.
SHARED_LIMIT = {"hopper": 232_448, "cdna3": 65_536, "blackwell": 232_448, "ampere": 166_912, "default": 101_376}
SM_COUNT = {"hopper": 132, "cdna3": 304, "default": 80}

_T = dict  # a tile config row, for readability

# (max_m or None, config). BLOCK_K comes from K_BYTES unless a row names BLOCK_K itself.
# Rows per generation in tiles/<generation>.json ("gemm"), loaded once:
# * hopper's prefill row (max_m None) is wgmma-sized: 128x256 with 3 stages is 144 KiB at 2-byte operands;
# * CDNA3: 64 KiB LDS, and the stream pipeliner keeps num_stages - 1 tiles in LDS;
# * the interpreter runs programs one by one in numpy: few, mid-sized tiles are fastest.
TILES = bounded_rows(tile_table("gemm"))

# Rows a tile sweep on the GPU measured faster for one kernel kind than the shared row it
# replaces (key: that row's max_m; None is the last, prefill row). H200, Triton 3.6,
# benchmarks/tile-sweep-nvidia-h200.json, at M=4096, N=28672, K=4096:
# * linear (bf16): 256x128 tiles 1.20x the shared 128x256 row (0.71x -> 0.85x cuBLAS);
# * fp8_block: the shared 128x256 row holds two 128x256 fp32 tiles (the accumulator and the
#   scaled block product) at the 255-register cap and serialises its wgmmas; 64x128 with 4
#   warps ran 2.26x faster (0.22x -> 0.49x of row-wise _scaled_mm).
# The same sweep found the shared rows best for W4A16 at large M and for bf16 at M<=16 and
# M<=128; W8A8 and per-tensor fp8 were not swept and keep the shared rows.
# Rows per generation in tiles/<generation>.json ("gemm_kinds"), loaded once.
KIND_TILES: dict[str, dict[str, dict[int | None, dict]]] = {
    generation: {kind: dict(rows) for kind, rows in bounded_rows(kinds).items()}
    for generation, kinds in tile_table("gemm_kinds").items()}

# Hopper's TMA GEMM (gemm_linear's persistent kernel, :func:`tma_plan`): at prefill M, 16-bit
# operands, a plan without split-K. The copy engine loads A and B tiles by descriptor (zero
# fill past M, N and K: no masks or address arithmetic in the K loop), one program per SM
# walks the output tiles, and the tile loop is flattened into the K loop, so the next tile's
# loads are in flight during this tile's epilogue. 128x256 tiles of 64 K, 3 stages: 144 KiB
# staged plus the 64 KiB output tile the TMA store reads from, of the 227 KiB.
# Rows per generation in tiles/<generation>.json ("gemm_tma"), loaded once.
TMA_TILES = tile_table("gemm_tma")
TMA_MIN_M = 129  # the prefill bucket: at fewer rows the pointer rows (thin tiles, split-K) fill the GPU
# The TMA kernel's warp-specialised form (gemm_linear._linear_tma_kernel, WARP_SPECIALIZE): the
# tile Triton 3.6 specialises on sm_90 (4 warps: 3 warp groups, 168 registers, 112 KiB of shared
# memory, no spills). Compiled and checked ahead of time, timed against TMA_TILES' row by the
# tile sweep; not the default until a GPU measures it faster.
WARP_SPECIALIZED_TMA_ROW = _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=3,
                              WARP_SPECIALIZE=True)

MIN_K_STEPS_PER_SPLIT = 4  # below this the prologue/epilogue of a split outweighs its loop
MAX_SPLIT_K = 16
WAVES = 2  # split until about this many programs per SM are in flight
_MIN_BLOCK_K = 16  # the smallest tl.dot K


def generation_of(device) -> str:
    """Tile-table generation for ``device``: the interpreter's on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    generation = device_info(device).generation
    return generation if generation in TILES else "default"


@functools.lru_cache(maxsize=None)
def _live_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 1  # the interpreter: programs run one by one, splitting never helps
    return _live_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def stage_bytes(cfg: dict, a_bytes: float, b_bytes: float) -> int:
    """Shared memory one pipeline stage takes: an A tile and a B tile."""
    return int(cfg["BLOCK_K"] * (cfg["BLOCK_M"] * a_bytes + cfg["BLOCK_N"] * b_bytes))


def buffered_stages(cfg: dict, generation: str) -> int:
    """Stages held in shared memory: all of them on NVIDIA; AMD's stream pipeliner stages
    one tile through registers, so it keeps num_stages - 1 (at least one) in LDS."""
    stages = cfg["num_stages"]
    return max(1, stages - 1) if generation.startswith("cdna") else stages


def fit_shared(cfg: dict, generation: str, a_bytes: float, b_bytes: float, epilogue_bytes: int = 8192) -> dict:
    """Fewer stages (down to 2), then a shorter K step, until the staged tiles fit the
    generation's shared-memory limit with ``epilogue_bytes`` left for the epilogue (8 KiB for
    its layout conversion; a TMA store stages the whole output tile)."""
    if generation == "interpreter":
        return cfg
    limit = SHARED_LIMIT.get(generation, SHARED_LIMIT["default"]) - epilogue_bytes
    cfg = dict(cfg)
    while buffered_stages(cfg, generation) * stage_bytes(cfg, a_bytes, b_bytes) > limit:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > _MIN_BLOCK_K:
            cfg["BLOCK_K"] //= 2
        else:
            break
    return cfg


def base_config(generation: str, m: int, a_bytes: float, b_bytes: float | None = None, kind: str | None = None) -> dict:
    """The table row for ``m`` rows on ``generation`` (``kind``'s own row where
    :data:`KIND_TILES` has one), with BLOCK_K resolved and fitted."""
    for max_m, row in TILES[generation]:
        if max_m is None or m <= max_m:
            break
    own: dict = KIND_TILES.get(generation, {}).get(kind, {}) if kind is not None else {}
    cfg = with_block_k(own.get(max_m, row), a_bytes)
    return fit_shared(cfg, generation, a_bytes, a_bytes if b_bytes is None else b_bytes)


def with_block_k(row: dict, a_bytes: float) -> dict:
    """A copy of a table row with its K step in elements: BLOCK_K from K_BYTES unless it names BLOCK_K."""
    cfg = dict(row)
    k_bytes = cfg.pop("K_BYTES", None)
    if k_bytes is not None:
        cfg["BLOCK_K"] = max(_MIN_BLOCK_K, int(k_bytes // a_bytes))
    return cfg


def split_k(m: int, n: int, k: int, cfg: dict, sms: int, max_split: int = MAX_SPLIT_K) -> tuple[int, int]:
    """``(splits, K per split)`` for an M x N x K problem with tiles ``cfg`` on ``sms`` SMs.

    One split when the tile grid already fills ``WAVES`` waves; else as many splits as fill
    them, each keeping at least MIN_K_STEPS_PER_SPLIT K steps. K per split is a multiple of
    BLOCK_K, and no split is empty.
    """
    block_k = cfg["BLOCK_K"]
    steps = triton.cdiv(k, block_k)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    splits = min(max_split, (WAVES * sms) // max(tiles, 1), steps // MIN_K_STEPS_PER_SPLIT)
    if splits <= 1:
        return 1, k
    per_split = triton.cdiv(steps, splits)
    return triton.cdiv(steps, per_split), per_split * block_k


@functools.lru_cache(maxsize=4096)
def _plan(generation: str, sms: int, m: int, n: int, k: int, a_bytes: float, b_bytes: float, k_multiple_of: int,
          allow_split: bool, kind: str | None = None) -> dict:
    cfg = base_config(generation, m, a_bytes, b_bytes, kind)
    while k_multiple_of and k_multiple_of % cfg["BLOCK_K"] and cfg["BLOCK_K"] > _MIN_BLOCK_K:
        cfg["BLOCK_K"] //= 2  # one K step must stay inside one quantisation group
    cfg["SPLIT_K"], cfg["K_PER_SPLIT"] = split_k(m, n, k, cfg, sms) if allow_split else (1, k)
    return cfg


def gemm_plan(m: int, n: int, k: int, device, a_bytes: float, b_bytes: float | None = None, *,
              k_multiple_of: int = 0, split: bool = True, split_k: int | None = None, generation: str | None = None,
              sms: int | None = None, kind: str | None = None) -> dict:
    """Launch plan for an M x N x K GEMM on ``device``: tile constexprs, launch options,
    ``SPLIT_K`` and ``K_PER_SPLIT``. ``k_multiple_of``: BLOCK_K must divide it (group size);
    ``kind``: the kernel kind, for its own measured rows (:data:`KIND_TILES`).
    ``split_k`` forces a split count (tests, benchmarks); ``generation``/``sms`` plan for
    hardware other than ``device`` (tests, AOT). Cached."""
    generation = generation or generation_of(device)
    sms = sms if sms is not None else sm_count(device)
    b = a_bytes if b_bytes is None else b_bytes
    cfg = dict(_plan(generation, sms, m, n, k, a_bytes, b, k_multiple_of, split, kind))
    if split_k is not None and split_k != cfg["SPLIT_K"]:
        steps = triton.cdiv(k, cfg["BLOCK_K"])
        per_split = triton.cdiv(steps, max(1, min(int(split_k), steps)))
        cfg["SPLIT_K"], cfg["K_PER_SPLIT"] = triton.cdiv(steps, per_split) if k else 1, per_split * cfg["BLOCK_K"]
    # Every K step of every split lies inside K: the loop then masks loads by M and N only.
    cfg["EVEN_K"] = k % cfg["BLOCK_K"] == 0 and cfg["SPLIT_K"] * cfg["K_PER_SPLIT"] == k
    return cfg


def tma_plan(m: int, n: int, k: int, device, a_bytes: int, *, generation: str | None = None,
             sms: int | None = None, force: bool = False) -> dict | None:
    """Launch plan of the persistent TMA kernel (``TMA: True``, ``NUM_PROGRAMS``: one program
    per SM, at most one per output tile), or None where it does not serve: no TMA row for the
    generation, fewer than TMA_MIN_M rows, operands other than 16-bit, or a tile grid too
    small to fill the SMs (split-K does better there). ``force``: a plan whatever the shape,
    from the generation's prefill row where it has no TMA row (tests, the interpreter)."""
    generation = generation or generation_of(device)
    sms = sms if sms is not None else sm_count(device)
    row = TMA_TILES.get(generation)
    if not force and (row is None or m < TMA_MIN_M or a_bytes != 2):
        return None
    cfg = with_block_k(row if row is not None else TILES[generation][-1][1], a_bytes)
    cfg = fit_shared(cfg, generation, a_bytes, a_bytes, epilogue_bytes=cfg["BLOCK_M"] * cfg["BLOCK_N"] * a_bytes)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if not force and tiles < sms:
        return None
    cfg.update(TMA=True, NUM_PROGRAMS=max(1, min(sms, tiles)), SPLIT_K=1, K_PER_SPLIT=k)
    cfg.setdefault("WARP_SPECIALIZE", False)
    return cfg


def launch_options(cfg: dict) -> dict:
    return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def tile_constexprs(cfg: dict) -> dict:
    return {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}


def splitk_workspace(plan: dict, m: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """fp32 partial tiles of every split, ``[SPLIT_K, M, N]`` (from torch's caching allocator:
    no host sync, CUDA-graph safe)."""
    return torch.empty((plan["SPLIT_K"], m, n), dtype=torch.float32, device=like.device)


# --------------------------------------------------------------------------- device code


@triton.jit
def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program (one output tile per program)."""
    return grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile ``pid``, walking bands of GROUP_M row tiles column
    by column, so programs running together share column tiles of the weight and row tiles of
    x in L2 instead of sweeping all of x for each column tile."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_band = GROUP_M * tiles_n
    band = pid // per_band
    band_start = band * GROUP_M
    band_rows = tl.minimum(tiles_m - band_start, GROUP_M)
    within = pid - band * per_band
    return band_start + within % band_rows, within // band_rows


@triton.jit
def split_tile(M, N, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile and K split, the prologue every GEMM kernel starts from:
    ``(k_start, rows, cols, row_ok, col_ok)`` (grid: tiles along axis 0, K splits along 1)."""
    tile_m, tile_n = tile_coords(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(1) * K_PER_SPLIT, rows, cols, rows < M, cols < N


@triton.jit
def a_tile_ptrs(x_ptr, rows, k_start, stride_m, stride_k, BLOCK_K: tl.constexpr):
    """Pointers to the split's first ``[rows, BLOCK_K]`` tile of A, and the step to the next.
    int64 offsets: M * stride (and K * stride for a transposed operand) can pass 2^31."""
    ks = k_start + tl.arange(0, BLOCK_K)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_m + ks.to(tl.int64)[None, :] * stride_k
    return ptrs, tl.cast(stride_k, tl.int64) * BLOCK_K


@triton.jit
def b_tile_ptrs(w_ptr, cols, k_start, stride_n, stride_k, BLOCK_K: tl.constexpr):
    """The same for the ``[BLOCK_K, cols]`` tiles of B (a weight [N, K] through its strides)."""
    ks = k_start + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_n + ks.to(tl.int64)[:, None] * stride_k
    return ptrs, tl.cast(stride_k, tl.int64) * BLOCK_K


@triton.jit
def load_tiles(x_ptrs, w_ptrs, row_ok, col_ok, k_ok, ZERO: tl.constexpr, EVEN_K: tl.constexpr = False):
    """One K step's A and B tiles; what lies past M, N or K loads as ZERO (0 for integer
    operands, 0.0 for float ones: the interpreter casts neither across) and adds nothing
    (the last split's steps past K load nothing at all). EVEN_K (the plan's: every step lies
    inside K): no K mask, so the masks are the same every step (no per-step compare)."""
    if EVEN_K:
        a = tl.load(x_ptrs, mask=row_ok[:, None], other=ZERO)
        b = tl.load(w_ptrs, mask=col_ok[None, :], other=ZERO)
    else:
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=ZERO)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=ZERO)
    return a, b


@triton.jit
def activate(y, ACTIVATION: tl.constexpr):
    """Epilogue activation on fp32 values (names as in graft.ops.gemm.ACTIVATIONS)."""
    if ACTIVATION == "relu":
        y = tl.where(y < 0.0, 0.0, y)  # keeps NaN as torch.relu does (maximum(NaN, 0) may give 0)
    elif ACTIVATION == "gelu":
        # tanh approximation; tanh(u) = 2 * sigmoid(2u) - 1 keeps to ops every backend has.
        inner = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACTIVATION == "gelu_erf":
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACTIVATION == "silu":
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def finish_tile(acc, bias_ptr, cols, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """The epilogue on a finished fp32 tile: + bias (of columns ``cols``), then the activation."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return activate(acc, ACTIVATION)


@triton.jit
def store_tile(acc, y_ptr, bias_ptr, rows, cols, M, N, stride_ym, stride_yn,
               HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr, ACCUMULATE: tl.constexpr):
    """Write a program's fp32 tile: finished (bias, activation, one rounding; with ACCUMULATE
    added to what y holds: y += act(acc + bias), e.g. a gradient summed over chunks in fp32)
    when K is not split; else raw into split ``program_id(1)``'s slab of the [SPLIT_K, M, N]
    workspace."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT_K == 1:
        acc = finish_tile(acc, bias_ptr, cols, N, HAS_BIAS, ACTIVATION)
        ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols.to(tl.int64)[None, :] * stride_yn
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        slab = tl.program_id(1).to(tl.int64) * M * N
        ptrs = y_ptr + slab + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """y[m, n-block] = act(sum over splits in order 0..SPLIT_K-1 + bias) (ACCUMULATE: added to
    y): deterministic."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    acc = activate(acc, ACTIVATION)
    y_ptrs = y_ptr + row * stride_ym + cols.to(tl.int64) * stride_yn
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK_N = 1024


def splitk_reduce(ws: torch.Tensor, bias, y: torch.Tensor, activation: str = "none", accumulate: bool = False
                  ) -> torch.Tensor:
    """Finish a split-K GEMM: ``y = act(ws.sum(0) + bias)`` (``accumulate``: ``y +=``) in a fixed order."""
    splits, m, n = ws.shape
    block_n = min(REDUCE_BLOCK_N, triton.next_power_of_2(n))
    _splitk_reduce_kernel[(m, triton.cdiv(n, block_n))](
        ws, bias if bias is not None else ws, y, m, n, y.stride(0), y.stride(1),
        SPLIT_K=splits, HAS_BIAS=bias is not None, ACTIVATION=activation, BLOCK_N=block_n, ACCUMULATE=accumulate,
        num_warps=4 if block_n >= 512 else 1,
    )  # fmt: skip
    return y


def reduce_aot_variants():
    """AOT variants of the split-K reduce (declared by gemm_linear, the first user)."""
    from graft.kernels.triton._aot import variant

    for pointer, split, act, accumulate in (("*bf16", 4, "silu", False), ("*fp16", 16, "none", False),
                                            ("*fp32", 2, "gelu", False), ("*fp32", 8, "none", True)):
        yield variant(_splitk_reduce_kernel, dict(SPLIT_K=split, HAS_BIAS=True, ACTIVATION=act, BLOCK_N=REDUCE_BLOCK_N,
                                                  ACCUMULATE=accumulate),
                      pointer=pointer, ws_ptr="*fp32", options={"num_warps": 4}, values=dict(stride_yn=1))
