"""Triton paged-KV decode attention (one query token per sequence), with split-K.

Grid: (sequences, kv heads, splits). A program handles every query head of one GQA
group at once (the group's rows, padded to >= 16 for tl.dot, share each K/V tile), and
one contiguous slice of the sequence's context: split ``s`` of ``S`` covers tokens
``[s * chunk, (s + 1) * chunk)`` with ``chunk = ceil(seq_len / S)`` rounded up to whole
tiles. Tokens are gathered through the block table one tile of BLOCK_N at a time, so
any block size works and the caches may be strided views (vLLM 0.33 hands the kernel
``kv_cache.transpose(1, 2).split(head_dim, -1)``).

With one split the program normalises and writes the output directly. With several
(flash-decoding: long contexts and few sequences still fill the GPU), each split
writes its unnormalised accumulator and its running max/sum, and a second kernel
rescales the partials to a common max and combines them.

fp8 KV cache (``KV_FP8``): K/V tiles load as fp8 (half the bytes of bf16: decode is bound
by reading the cache) and widen to the query's dtype, which is exact for e4m3fn and e5m2
in fp16/bf16/fp32; the per-tensor scales are folded in once instead of per element:
``k_scale`` into the score scale, ``v_scale`` into the final accumulator (attention is
linear in V). The scales are read from device tensors (CUDA-graph safe).

Split count: the grid's split axis is sized on the host from the block-table capacity
(no device-to-host read of ``seq_lens``: CUDA graphs and no sync per step), and each
program derives the splits its sequence really uses from its own ``seq_len`` (at most
one per MIN_SPLIT_TOKENS tokens); unused split programs exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import functools
from typing import Optional

from graft.custom_ops import define_op
from graft.kernels.triton._attention_common import (
    LOG2E,
    NEG_BIG,
    head_dim_block,
    head_dim_reason,
    resolve_scale,
)
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._dot import dot_f32, dot_flags
from graft.kernels.triton._aot import per_target, split_tiles, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.platform import device_info, is_rocm, triton_interpret

OP = "attention.decode_paged"
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Rows per generation in tiles/<generation>.json ("attention_decode_paged"), loaded once.
TILES = tile_table("attention_decode_paged")

# Split heuristic: aim for this many programs per streaming multiprocessor / compute unit,
# never give a split fewer than MIN_SPLIT_TOKENS tokens, and cap the partial buffers.
PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64  # also the cap on a caller's num_splits (the combine holds all splits in one tile)


@triton.jit
def _decode_kernel(
    Q, KCache, VCache, BlockTables, SeqLens, Out, PartAcc, PartMax, PartSum, KScale, VScale,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    qk_scale,  # softmax_scale * log2(e)
    head_dim,
    block_size,
    num_blocks,  # physical blocks in the caches: table entries outside [0, num_blocks) are skipped
    max_blocks,  # block-table columns: seq_len is clamped to max_blocks * block_size
    num_splits,
    min_split,  # fewest tokens per split (1 when the caller forced num_splits)
    GROUP: tl.constexpr,  # query heads per kv head
    KV_FP8: tl.constexpr,  # fp8 caches: widen on load, scale by *KScale / *VScale
    SINGLE_PASS: tl.constexpr,  # num_splits == 1: write the normalised output directly
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Bounds-safe on any values (checks off, CUDA graphs, torch.compile): the length is
    # clamped to the table's capacity, so no table read passes the row.
    seq_len = tl.minimum(tl.maximum(tl.load(SeqLens + seq), 0), max_blocks * block_size)
    # Splits follow this sequence's real length: at most one per min_split tokens, so a
    # short context in a long-capacity table runs in few splits (the rest exit at once).
    used_splits = tl.maximum(tl.minimum(tl.cdiv(seq_len, min_split), num_splits), 1)
    chunk = tl.cdiv(tl.cdiv(seq_len, used_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < head_dim
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        Q + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    if KV_FP8:
        qk_scale = qk_scale * tl.load(KScale)
    table = BlockTables + seq.to(tl.int64) * stride_bts
    k_base = KCache + kv_head * stride_kh
    v_base = VCache + kv_head * stride_vh
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n
        tok_ok = tokens < end
        block = tl.load(table + (tokens // block_size) * stride_btb, mask=tok_ok, other=0).to(tl.int64)
        # A table entry outside [0, num_blocks) (garbage, -1 padding) is never dereferenced:
        # its tokens are masked out of the softmax, as in the reference.
        block_ok = (block >= 0) & (block < num_blocks)
        tok_ok = tok_ok & block_ok
        block = tl.where(block_ok, block, 0)
        slot = tokens % block_size
        k_t = tl.load(
            k_base + block[None, :] * stride_kb + slot[None, :] * stride_kt + offs_d[:, None] * stride_kd,
            mask=tok_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if KV_FP8:
            k_t = k_t.to(Q.dtype.element_ty)
        scores = dot_f32(q, k_t, UPCAST, PRECISION) * qk_scale
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + block[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=tok_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = v.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(VScale)
    if SINGLE_PASS:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0: acc is 0, output 0
        o_ptrs = Out + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # Partials are contiguous fp32: [num_seqs, num_heads, num_splits(, BLOCK_D)].
        row = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(PartMax + row, m_i, mask=g_ok)
        tl.store(PartSum + row, l_i, mask=g_ok)
        tl.store(PartAcc + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_ok[:, None])


# num_splits is a runtime value (unspecialised): one compiled combine per BLOCK_S (a power of
# two >= num_splits, at most 7 of them), not one per split count.
@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    PartAcc, PartMax, PartSum, Out,
    stride_os, stride_oh, stride_od,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    rows = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + offs_s
    # Empty splits stored NEG_BIG/0/0; padding lanes get -inf so their weight is exactly 0.
    m = tl.load(PartMax + rows, mask=s_ok, other=float("-inf"))
    l = tl.load(PartSum + rows, mask=s_ok, other=0.0)
    acc = tl.load(PartAcc + rows[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.exp2(m - m_all)
    total = tl.sum(l * weight, 0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    o_ptrs = Out + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: no parallelism to fill


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per sequence (the grid's third axis): enough programs to fill the device.

    ``max_context`` is the block-table capacity (max_blocks_per_seq * block_size), an upper
    bound known without reading seq_lens back from the device; each program then uses
    only as many of the splits as its real length fills with MIN_SPLIT_TOKENS each.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), programs)
    by_length = max(1, triton.cdiv(max_context, MIN_SPLIT_TOKENS))
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    num_splits: int,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    cfg = tile_config(TILES, query.device)
    capacity = block_tables.shape[1] * block_size
    auto = num_splits <= 0
    if auto:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, query.device)
    # A forced count only partitions work: cap it (grid z <= 65535, one combine tile, and
    # no more splits than BLOCK_N tiles in the table).
    num_splits = max(1, min(num_splits, MAX_SPLITS, triton.cdiv(max(capacity, 1), cfg["BLOCK_N"])))
    group = num_heads // num_kv_heads
    block_d = head_dim_block(head_dim)
    kv_fp8 = key_cache.dtype in FP8_KV_DTYPES
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the single-pass kernel
    with on_device(query):
        _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            query, key_cache, value_cache, block_tables, seq_lens, out, part_acc, part_max, part_sum,
            k_scale if kv_fp8 else out, v_scale if kv_fp8 else out,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
            softmax_scale * LOG2E,
            head_dim,
            block_size,
            key_cache.shape[0],
            block_tables.shape[1],
            num_splits,
            MIN_SPLIT_TOKENS if auto else 1,
            GROUP=group,
            KV_FP8=kv_fp8,
            SINGLE_PASS=num_splits == 1,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_D=block_d,
            **dot_flags(query.dtype, query.device),
            **cfg,
        )
        if num_splits > 1:
            _combine_kernel[(num_seqs, num_heads)](
                part_acc, part_max, part_sum, out,
                *out.stride(),
                head_dim,
                num_splits,
                BLOCK_S=triton.next_power_of_2(num_splits),
                BLOCK_D=block_d,
                num_warps=cfg["num_warps"],
            )
    return out


def _decode_fake(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    num_splits: int,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return query.new_empty(query.shape)


decode_op = define_op("attention_decode_paged_triton", _decode, fake=_decode_fake)


def _scale_tensor(scale, like: torch.Tensor) -> Optional[torch.Tensor]:
    """A float scale as a one-element fp32 tensor on ``like``'s device (vLLM passes tensors,
    which go through as they are)."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale.reshape(1) if scale is not None else None
    return torch.full((1,), float(scale), dtype=torch.float32, device=like.device)


def decode_paged(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                 k_scale=None, v_scale=None):
    """The op's signature on top of the custom op (which needs a concrete float scale)."""
    scale = resolve_scale(softmax_scale, query.shape[-1])
    # seq_lens is read with unit stride (block_tables with its strides).
    return decode_op(query, key_cache, value_cache, block_tables, seq_lens.contiguous(), scale, int(num_splits),
                     _scale_tensor(k_scale, query), _scale_tensor(v_scale, query))


def check(query, key_cache=None, *args, **kwargs):
    if key_cache is not None and key_cache.dtype in FP8_KV_DTYPES and fp8_kv_reason(key_cache.dtype):
        return fp8_kv_reason(key_cache.dtype)
    return head_dim_reason(query.shape[-1])


@functools.lru_cache(maxsize=None)
def fp8_kv_reason(dtype) -> Optional[str]:
    """Why an fp8 cache cannot be served here, or None. Triton's e4m3fn (fp8e4nv) needs
    sm_89+ on NVIDIA; ROCm's Triton handles the OCP formats on gfx94x/gfx95x only."""
    if triton_interpret():
        return None
    if not torch.cuda.is_available():
        return "no GPU for an fp8 KV cache"
    if is_rocm():
        arch = device_info("cuda").arch or ""
        return None if arch.startswith(("gfx94", "gfx95")) else f"fp8 KV cache needs gfx94x/gfx95x, not {arch}"
    major, minor = torch.cuda.get_device_capability()
    if dtype == torch.float8_e4m3fn and (major, minor) < (8, 9):
        return f"fp8 e4m3 KV cache needs sm_89 or newer, not sm_{major}{minor}"
    return None


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, decode_paged, custom_op=decode_op, check=check, check_scalars=(),
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton paged-KV decode attention (GQA, split-K flash-decoding, fp8 KV cache)",
    ))


UNIT_STRIDES = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_btb=1)  # contiguous rows: JIT constants


def _aot_variants():
    """Per target: single pass and split-K (with the combine kernel), fp16/bf16/fp32, GQA groups."""
    types = dict(BlockTables="*i32", SeqLens="*i32", PartAcc="*fp32", PartMax="*fp32", PartSum="*fp32",
                 qk_scale="fp32")
    for target, cfg in per_target(TILES):
        blocks, options = split_tiles(cfg)
        # Resources grow with BLOCK_D, BLOCK_G and the dtype: the widest of each are here.
        for dtype, single, group, block_d in (("fp16", True, 4, 128), ("bf16", False, 8, 128),
                                              ("fp32", False, 1, 64), ("bf16", True, 16, 256),
                                              ("fp32", True, 64, 256), ("fp16", False, 32, 256)):
            flags = dict(GROUP=group, KV_FP8=False, SINGLE_PASS=single, BLOCK_G=max(16, triton.next_power_of_2(group)),
                         BLOCK_D=block_d, UPCAST=False, PRECISION="ieee", **blocks)
            yield variant(_decode_kernel, flags, pointer=f"*{dtype}", options=options, targets=(target,),
                          values=UNIT_STRIDES, **types)
        # fp8 KV caches (e4m3fn = fp8e4nv, e5m2 = fp8e5) under 16-bit queries, both passes.
        for dtype, kv, single, group, block_d in (("bf16", "*fp8e4nv", True, 4, 128), ("fp16", "*fp8e4nv", False, 8, 128),
                                                  ("bf16", "*fp8e5", False, 16, 256)):
            flags = dict(GROUP=group, KV_FP8=True, SINGLE_PASS=single, BLOCK_G=max(16, triton.next_power_of_2(group)),
                         BLOCK_D=block_d, UPCAST=False, PRECISION="ieee", **blocks)
            yield variant(_decode_kernel, flags, pointer=f"*{dtype}", options=options, targets=(target,),
                          values=UNIT_STRIDES, KCache=kv, VCache=kv, KScale="*fp32", VScale="*fp32", **types)
        for dtype, splits, block_d in (("fp16", 8, 128), ("bf16", 3, 64), ("fp32", 64, 256)):
            flags = dict(BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
            yield variant(_combine_kernel, flags, pointer=f"*{dtype}", options={"num_warps": options["num_warps"]},
                          targets=(target,), values=dict(stride_od=1, num_splits=splits), PartAcc="*fp32", PartMax="*fp32",
                          PartSum="*fp32")


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
