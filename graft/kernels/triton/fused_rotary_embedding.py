"""Triton rotary position embedding (``fused.rotary_embedding``), functional.

One launch covers q and k: one program per token. It loads the token's cos/sin row once
and rotates all of its q heads, then all of its k heads, a chunk of HEAD_BLOCK heads at a
time as a [HEAD_BLOCK, rot_dim/2] tile (neox: element i with i + rot_dim/2; GPT-J: 2i
with 2i+1) in fp32, copying the pass-through tail of a partially rotated head. The chunk
bounds the live tile (HEAD_BLOCK * BLOCK_HALF <= TILE_ELEMS) so 64 heads x 128 do not
spill registers; a token with fewer heads runs one masked chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op, register_backward
from graft.kernels.triton._aot import variant
from graft.kernels.triton._common import on_device, triton_implementation

# Elements of one [HEAD_BLOCK, BLOCK_HALF] tile: 16 per thread per operand at 4 warps.
TILE_ELEMS = 2048


@triton.jit
def _rotate_heads(src_row, dst_row, num_heads, head_size, half, cos, sin,
                  IS_NEOX: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_PASS: tl.constexpr):
    """Rotate ``num_heads`` contiguous heads of one token (src_row/dst_row: the token's
    first element), HEAD_BLOCK heads per step; cos/sin are [1, BLOCK_HALF] fp32."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if IS_NEOX:
        i1 = i
        i2 = i + half
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    hs = tl.arange(0, HEAD_BLOCK)[:, None]
    out_ty = dst_row.dtype.element_ty
    for h0 in range(0, num_heads, HEAD_BLOCK):
        h = h0 + hs
        m = (h < num_heads) & (i < half)
        base = h * head_size  # < 2^31: one token's row (the row start is int64)
        x1 = tl.load(src_row + base + i1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src_row + base + i2, mask=m, other=0.0).to(tl.float32)
        tl.store(dst_row + base + i1, (x1 * cos - x2 * sin).to(out_ty), mask=m)
        tl.store(dst_row + base + i2, (x2 * cos + x1 * sin).to(out_ty), mask=m)
        if BLOCK_PASS > 0:
            j = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
            mj = (h < num_heads) & (j < head_size)
            tl.store(dst_row + base + j, tl.load(src_row + base + j, mask=mj, other=0.0), mask=mj)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    num_q_heads, num_k_heads, q_stride, k_stride, cache_stride, head_size, half, max_position,
    IS_NEOX: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    m = i < half
    # A position outside [0, max_position) reads no cache row: cos 1, sin 0 leave the
    # token unrotated (the reference's definition), whatever the value checks are set to.
    pos = tl.full([1, BLOCK_HALF], 0, tl.int64) + tl.load(pos_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < max_position)
    row = cache_ptr + tl.where(pos_ok, pos, 0) * cache_stride
    cos = tl.load(row + i, mask=m & pos_ok, other=1.0).to(tl.float32)
    sin = tl.load(row + half + i, mask=m & pos_ok, other=0.0).to(tl.float32)
    if BACKWARD:  # a rotation's transpose is the rotation by -theta
        sin = -sin
    # int64 row starts: tokens * stride passes 2^31 at long contexts.
    _rotate_heads(q_ptr + t * q_stride, q_out_ptr + t * num_q_heads * head_size, num_q_heads, head_size, half,
                  cos, sin, IS_NEOX, HEAD_BLOCK, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(k_ptr + t * k_stride, k_out_ptr + t * num_k_heads * head_size, num_k_heads, head_size, half,
                  cos, sin, IS_NEOX, HEAD_BLOCK, BLOCK_HALF, BLOCK_PASS)


def launch_config(num_q_heads: int, num_k_heads: int, half: int, rest: int = 0) -> dict:
    """HEAD_BLOCK (heads per step: a power of two covering the larger head count, up to the
    TILE_ELEMS budget for the wider of the rotated-pair tile and the pass-through tile),
    BLOCK_HALF, BLOCK_PASS and num_warps for one token's program."""
    block_half = triton.next_power_of_2(max(half, 1))
    block_pass = triton.next_power_of_2(rest) if rest > 0 else 0
    width = max(block_half, block_pass)
    heads = triton.next_power_of_2(max(num_q_heads, num_k_heads, 1))
    head_block = max(1, min(heads, TILE_ELEMS // width))
    tile = head_block * width
    return dict(HEAD_BLOCK=head_block, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
                num_warps=4 if tile >= 1024 else (2 if tile >= 256 else 1))


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[T, H*D] or [T, H, D] -> [T, H*D] with contiguous heads (a view when possible)."""
    t2 = t.reshape(t.shape[0], -1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
    cos_sin_cache: torch.Tensor, is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(positions, q, k, head_size, cos_sin_cache, is_neox, False)


def _rotate(positions, q, k, head_size, cos_sin_cache, is_neox, backward):
    tokens = positions.numel()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q2, k2 = _token_rows(q), _token_rows(k)
    num_q_heads, num_k_heads = q2.shape[1] // head_size, k2.shape[1] // head_size
    if tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = cache.shape[1] // 2
    rest = head_size - 2 * half
    with on_device(q):
        _rotary_kernel[(tokens,)](
            positions.reshape(-1), q2, k2, cache, q_out, k_out,
            num_q_heads, num_k_heads, q2.stride(0), k2.stride(0), cache.stride(0), head_size, half, cache.shape[0],
            IS_NEOX=is_neox, BACKWARD=backward,
            **launch_config(num_q_heads, num_k_heads, half, rest),
        )
    return q_out, k_out


def _rotary_fake(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
    cos_sin_cache: torch.Tensor, is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


rotary_op = define_op("fused_rotary_embedding_triton", _rotary, fake=_rotary_fake)


def rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox=True):
    """fused.rotary_embedding; a missing k travels as an empty [T, 0] tensor through the custom op."""
    k_in = k if k is not None else q.new_empty((q.shape[0], 0))
    # The kernel reads positions with unit stride: a strided or expanded view would read other values.
    q_out, k_out = rotary_op(positions.contiguous(), q, k_in, int(head_size), cos_sin_cache, bool(is_neox))
    return q_out, (k_out if k is not None else None)


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        "fused.rotary_embedding", rotary_embedding, custom_op=rotary_op,
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton rotary embedding, q and k in one launch (neox/GPT-J, partial rotary)",
    ))


def _aot_variant(dtype, cache, neox, q_heads, k_heads, half, rest, backward=False):
    cfg = launch_config(q_heads, k_heads, half, rest)
    flags = dict(IS_NEOX=neox, HEAD_BLOCK=cfg["HEAD_BLOCK"], BLOCK_HALF=cfg["BLOCK_HALF"], BLOCK_PASS=cfg["BLOCK_PASS"])
    if backward:
        flags["BACKWARD"] = True
    return variant(_rotary_kernel, flags, pointer=f"*{dtype}", options={"num_warps": cfg["num_warps"]},
                   pos_ptr="*i64", cache_ptr=cache)


# positions int64 (torch's default index dtype), an fp32 cos/sin cache for 16-bit q/k as well.
# Head layouts: Llama-3 (32..64 q heads x 128: the 2048-element tile, heads chunked), 64 x 64
# (a 64-head chunk), GPT-J partial rotary (16 x 256, rot_dim 64), fp32 with few heads (4/4 x 256).
def _forward_aot_variants() -> list:
    return [
        _aot_variant(*spec)
        for spec in (("bf16", "*fp32", True, 32, 8, 64, 0), ("bf16", "*fp32", True, 64, 8, 32, 0),
                     ("fp16", "*fp16", False, 16, 16, 32, 192), ("fp32", "*fp32", True, 4, 4, 128, 0))
    ]


# ---------------------------------------------------------------------------- backward
# The rotation is linear and orthogonal: dq = R(-theta) dq_out (the same kernel with sin
# negated); the pass-through tail copies its gradient. cos_sin_cache and positions get none.


def _rotary_bwd(
    positions: torch.Tensor, dq_out: torch.Tensor, dk_out: torch.Tensor, head_size: int,
    cos_sin_cache: torch.Tensor, is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(positions, dq_out, dk_out, head_size, cos_sin_cache, is_neox, True)


rotary_bwd_op = define_op("fused_rotary_embedding_backward_triton", _rotary_bwd, fake=_rotary_fake)


def _setup(ctx, inputs, output):
    positions, q, k, head_size, cache, is_neox = inputs
    ctx.save_for_backward(positions, cache)
    ctx.head_size, ctx.is_neox = head_size, is_neox


def _backward(ctx, dq_out, dk_out):
    positions, cache = ctx.saved_tensors
    dq, dk = rotary_bwd_op(positions, dq_out, dk_out, ctx.head_size, cache, ctx.is_neox)
    return None, dq, dk, None, None, None


register_backward(rotary_op, _backward, _setup)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return _forward_aot_variants() + [_aot_variant("bf16", "*fp32", True, 32, 8, 64, 0, backward=True)]
