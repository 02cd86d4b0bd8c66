"""Quantization and packing helpers for the int8 and int4 GEMM ops.

int8 (``gemm.w8a8``), symmetric, no zero point:

* :func:`quantize_per_token_int8` ``x [..., K] -> (x_q int8, scale fp32 [..., 1])``:
  one scale per row (token), ``x ~= x_q * scale``.
* :func:`quantize_per_channel_int8` ``w [N, K] -> (w_q int8, scale fp32 [N])``:
  one scale per output channel, ``w ~= w_q * scale[:, None]``.
* :func:`quantize_per_tensor_int8`: one scalar (0-d) scale.

int4 (``gemm.w4a16``): an unpacked int4 matrix is ``q [K, N]`` (in-features by
out-features, the layout GPTQ and AWQ checkpoints use) of codes ``0..15``, with per
group ``zeros [K/g, N]`` (codes ``0..15``) and ``scales [K/g, N]``; group ``i`` covers
rows ``i*g .. i*g+g-1`` of K, and ``W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]``
(so ``linear(x) = x @ W``). Eight 4-bit codes share one int32; the two checkpoint
formats differ in how (checked against AutoGPTQ's and AutoAWQ's pack code, and vLLM's
loaders for them):

GPTQ (AutoGPTQ "v1" format, what vLLM's ``gptq`` method loads)
    ``qweight [K/8, N]`` packed along K: nibble ``j`` (bits ``4j..4j+3``) of
    ``qweight[r, n]`` is ``q[8r + j, n]``. ``qzeros [K/g, N/8]`` packed along N the
    same plain way: nibble ``j`` of ``qzeros[i, c]`` is ``zeros[i, 8c + j]`` **minus
    one** (AutoGPTQ stores ``zero - 1`` and adds the 1 back when dequantizing; a
    symmetric checkpoint therefore stores 7 for zero point 8). A zero point of 0 is not
    representable in this format: :func:`pack_gptq` rejects it. ``scales [K/g, N]``.
    Act-order checkpoints (``desc_act`` with a permuting ``g_idx``) are not supported.
AWQ (AutoAWQ "GEMM" format, what vLLM's ``awq`` method loads)
    ``qweight [K, N/8]`` packed along N with an interleaved nibble order: nibble ``i``
    of ``qweight[k, c]`` holds column ``8c + AWQ_PACK_ORDER[i]`` with
    ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``; equivalently column ``8c + j`` sits
    in nibble ``AWQ_NIBBLE_OF_COLUMN[j] = (j // 2) + 4 * (j % 2)``. ``qzeros [K/g, N/8]``
    use the same interleave and store the zero point itself. ``scales [K/g, N]``.

GPTQ interleaved (``gptq_interleaved``: graft's offline layout for its W4A16 kernel, made once
from a GPTQ checkpoint by :func:`interleave_gptq`)
    GPTQ's ``qweight [K/8, N]``, ``qzeros`` and ``scales``, with the words' nibbles reordered in
    each block of ``INTERLEAVE_K = 128`` rows of K: nibble ``j`` of word row ``r`` of block ``b``
    (``qweight[16b + r, n]``) is ``q[128b + 16j + r, n]``. One shift of a block's 16 word rows
    then gives 16 consecutive rows of K, the K of one tensor-core MMA, in the layout the words
    were loaded in (GPTQ's nibble j of 8 consecutive rows needs an 8-way reshape per tile).
    K must be a multiple of 128.

Packing needs K (GPTQ) resp. N (AWQ, and GPTQ's qzeros) to be multiples of 8: other
sizes are rejected with GraftInputError rather than padded, since a padded checkpoint
would no longer match the layer's real shape.
"""
from __future__ import annotations

import torch

from graft.errors import GraftInputError

PACK_FACTOR = 8  # int4 codes per int32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_PACK_ORDER[i] of its group of 8
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(j) for j in range(PACK_FACTOR))  # (0, 4, 1, 5, 2, 6, 3, 7)
FORMATS = ("gptq", "awq", "gptq_interleaved")
INTERLEAVE_K = 128  # rows of K per block of the gptq_interleaved layout
_WORD_ROWS = INTERLEAVE_K // PACK_FACTOR  # word rows per block (16: one MMA's K per shift)

_INT8_MAX = 127.0


# ----------------------------------------------------------------------------- int8


def _int8_from_amax(x: torch.Tensor, amax: torch.Tensor):
    # An all-zero row gets scale 1 (any scale would do) instead of a division by zero.
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    q = torch.round(x.float() / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def quantize_per_token_int8(x: torch.Tensor):
    """Symmetric int8 with one fp32 scale per row: ``(x_q [..., K], scale [..., 1])``."""
    if not x.is_floating_point():
        raise GraftInputError(f"quantize_per_token_int8: x must be floating point, got {x.dtype}")
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    return _int8_from_amax(x, amax)


def quantize_per_channel_int8(w: torch.Tensor):
    """Symmetric int8 with one fp32 scale per output channel (row of ``w [N, K]``): ``(w_q, scale [N])``."""
    if not w.is_floating_point() or w.dim() != 2:
        raise GraftInputError(f"quantize_per_channel_int8: w must be a 2-D float [N, K], got {w.dtype} {tuple(w.shape)}")
    q, scale = quantize_per_token_int8(w)
    return q, scale.reshape(-1)


def quantize_per_tensor_int8(x: torch.Tensor):
    """Symmetric int8 with one scalar fp32 scale: ``(x_q, scale)`` (0-d)."""
    if not x.is_floating_point():
        raise GraftInputError(f"quantize_per_tensor_int8: x must be floating point, got {x.dtype}")
    return _int8_from_amax(x, x.detach().abs().amax().float())


# ----------------------------------------------------------------------------- int4


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False, gptq_compatible: bool = True):
    """Round-to-nearest int4 of a linear weight ``w [N, K]`` (framework layout).

    Returns ``(q [K, N], zeros [K/g, N], scales [K/g, N])``: int32 codes 0..15, int32
    zero points and fp32 scales (``group_size=-1``: one group spanning K). Symmetric
    uses zero point 8. Asymmetric zero points are kept in 1..15 when
    ``gptq_compatible`` (GPTQ's format cannot store 0, see the module docstring).
    """
    if not w.is_floating_point() or w.dim() != 2:
        raise GraftInputError(f"quantize_int4: w must be a 2-D float [N, K], got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if g <= 0 or k % g:
        raise GraftInputError(f"quantize_int4: group_size {group_size} must be -1 or a positive divisor of K={k}")
    wg = w.detach().float().t().reshape(k // g, g, n)  # [groups, g, N]
    if symmetric:
        amax = wg.abs().amax(dim=1)
        scales = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
        scales = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
        zeros = torch.round(-lo / scales).to(torch.int32).clamp(1 if gptq_compatible else 0, 15)
    q = torch.round(wg / scales[:, None, :]) + zeros[:, None, :]
    q = q.clamp(0, 15).to(torch.int32).reshape(k, n)
    return q, zeros, scales


def dequantize_int4(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``W [K, N]`` in fp32 from unpacked codes (``zeros=None``: symmetric, zero point 8)."""
    k, n = q.shape
    g = k if group_size == -1 else group_size
    groups = torch.arange(k, device=q.device) // g
    z = 8.0 if zeros is None else zeros.float()[groups]
    return (q.float() - z) * scales.float()[groups]


def _check_codes(name: str, t: torch.Tensor, lo: int = 0) -> None:
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise GraftInputError(f"{name} must be an integer tensor of int4 codes, got {t.dtype}")
    if t.dim() != 2:
        raise GraftInputError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < lo or int(t.max()) > 15):
        raise GraftInputError(f"{name} values must lie in {lo}..15, got {int(t.min())}..{int(t.max())}")


def _to_int32_bits(packed: torch.Tensor) -> torch.Tensor:
    # Bit patterns with bit 31 set are negative int32: wrap from the int64 accumulator.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """Pack along dim 0: ``[R*8, C] -> [R, C]``, nibble j of row r = codes[8r + j]."""
    r = codes.shape[0] // PACK_FACTOR
    c = codes.to(torch.int64).reshape(r, PACK_FACTOR, -1)
    shifts = (4 * torch.arange(PACK_FACTOR, device=codes.device, dtype=torch.int64)).reshape(1, -1, 1)
    return _to_int32_bits((c << shifts).sum(dim=1))


def _pack_cols(codes: torch.Tensor, order=tuple(range(PACK_FACTOR))) -> torch.Tensor:
    """Pack along dim 1: ``[R, C*8] -> [R, C]``, nibble i of column c = codes[:, 8c + order[i]]."""
    rows, cols = codes.shape
    c = codes.to(torch.int64).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)[:, :, list(order)]
    shifts = (4 * torch.arange(PACK_FACTOR, device=codes.device, dtype=torch.int64)).reshape(1, 1, -1)
    return _to_int32_bits((c << shifts).sum(dim=2))


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    shifts = (4 * torch.arange(PACK_FACTOR, device=packed.device, dtype=torch.int32)).reshape(1, -1, 1)
    codes = (packed.to(torch.int32)[:, None, :] >> shifts) & 0xF
    return codes.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, order=tuple(range(PACK_FACTOR))) -> torch.Tensor:
    shifts = (4 * torch.arange(PACK_FACTOR, device=packed.device, dtype=torch.int32)).reshape(1, 1, -1)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [R, C, nibble]
    inverse = [order.index(j) for j in range(PACK_FACTOR)]
    return nibbles[:, :, inverse].reshape(packed.shape[0], -1)


def _check_multiple(what: str, size: int, fmt: str) -> None:
    if size % PACK_FACTOR:
        raise GraftInputError(
            f"{fmt} packing needs {what} to be a multiple of {PACK_FACTOR} (eight int4 per int32), got {size}"
        )


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor | None = None):
    """``(qweight [K/8, N], qzeros [K/g, N/8] or None)`` in AutoGPTQ's v1 layout (zero stored minus one)."""
    _check_codes("q", q)
    _check_multiple("K (rows of q)", q.shape[0], "GPTQ")
    qweight = _pack_rows(q)
    if zeros is None:
        return qweight, None
    _check_codes("zeros", zeros, lo=1)  # stored as zero - 1, so 0 cannot be represented
    _check_multiple("N (columns of zeros)", zeros.shape[1], "GPTQ qzeros")
    return qweight, _pack_cols(zeros - 1)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor | None = None):
    """Inverse of :func:`pack_gptq`: ``(q [K, N], zeros [K/g, N] or None)`` with true zero points."""
    q = _unpack_rows(qweight)
    return q, None if qzeros is None else _unpack_cols(qzeros) + 1


def pack_awq(q: torch.Tensor, zeros: torch.Tensor | None = None):
    """``(qweight [K, N/8], qzeros [K/g, N/8] or None)`` in AutoAWQ's interleaved layout."""
    _check_codes("q", q)
    _check_multiple("N (columns of q)", q.shape[1], "AWQ")
    qweight = _pack_cols(q, AWQ_PACK_ORDER)
    if zeros is None:
        return qweight, None
    _check_codes("zeros", zeros)
    _check_multiple("N (columns of zeros)", zeros.shape[1], "AWQ")
    return qweight, _pack_cols(zeros, AWQ_PACK_ORDER)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor | None = None):
    """Inverse of :func:`pack_awq`: ``(q [K, N], zeros [K/g, N] or None)``."""
    q = _unpack_cols(qweight, AWQ_PACK_ORDER)
    return q, None if qzeros is None else _unpack_cols(qzeros, AWQ_PACK_ORDER)


def _check_interleavable(qweight: torch.Tensor) -> None:
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise GraftInputError(f"qweight must be a 2-D int32 tensor of packed words, got {qweight.dtype} "
                              f"{tuple(qweight.shape)}")
    if qweight.shape[0] % _WORD_ROWS:
        raise GraftInputError(f"the gptq_interleaved layout reorders K in blocks of {INTERLEAVE_K} rows, so K must "
                              f"be a multiple of {INTERLEAVE_K}; got K={qweight.shape[0] * PACK_FACTOR}")


def _block_order(codes: torch.Tensor, inner: int, outer: int) -> torch.Tensor:
    """Rows of each block of 128 as [outer, inner] -> [inner, outer] (a transpose per block)."""
    k, n = codes.shape
    return codes.reshape(k // INTERLEAVE_K, outer, inner, n).transpose(1, 2).reshape(k, n)


def interleave_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight [K/8, N]`` -> the ``gptq_interleaved`` layout (same shape; qzeros and
    scales are unchanged). Done once, when the weights are loaded (as vLLM repacks GPTQ for
    Marlin); K must be a multiple of 128."""
    _check_interleavable(qweight)
    # packed row R = 16b + r, nibble j must hold K row 128b + 16j + r: list the codes in packing
    # order (8R + j = 128b + 8r + j) by transposing each block's [j, r] rows to [r, j].
    return _pack_rows(_block_order(_unpack_rows(qweight), inner=_WORD_ROWS, outer=PACK_FACTOR))


def deinterleave_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_gptq`: back to GPTQ's ``qweight [K/8, N]``."""
    _check_interleavable(qweight)
    return _pack_rows(_block_order(_unpack_rows(qweight), inner=PACK_FACTOR, outer=_WORD_ROWS))


def pack_int4(q: torch.Tensor, zeros: torch.Tensor | None, fmt: str):
    """Pack for ``fmt`` in :data:`FORMATS`."""
    if fmt == "gptq":
        return pack_gptq(q, zeros)
    if fmt == "awq":
        return pack_awq(q, zeros)
    if fmt == "gptq_interleaved":
        if q.shape[0] % INTERLEAVE_K:
            raise GraftInputError(f"the gptq_interleaved layout reorders K in blocks of {INTERLEAVE_K} rows, so K "
                                  f"must be a multiple of {INTERLEAVE_K}; got K={q.shape[0]}")
        qweight, qzeros = pack_gptq(q, zeros)
        return interleave_gptq(qweight), qzeros
    raise GraftInputError(f"unknown int4 format {fmt!r}; expected one of {', '.join(FORMATS)}")


def unpack_int4(qweight: torch.Tensor, qzeros: torch.Tensor | None, fmt: str):
    """Unpack for ``fmt`` in :data:`FORMATS`: ``(q [K, N], zeros or None)``."""
    if fmt == "gptq":
        return unpack_gptq(qweight, qzeros)
    if fmt == "awq":
        return unpack_awq(qweight, qzeros)
    if fmt == "gptq_interleaved":
        return unpack_gptq(deinterleave_gptq(qweight), qzeros)
    raise GraftInputError(f"unknown int4 format {fmt!r}; expected one of {', '.join(FORMATS)}")


# --------------------------------------------------------------------------- fp8 (e4m3)
# Scales are fp32 with ``x ~= q.float() * scale``; a zero block gets scale 1 (codes 0), not a
# division by zero. FP8_BLOCK is DeepSeek-V3's: 128 K per activation scale, 128x128 per weight.
FP8_BLOCK = 128


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    return float(torch.finfo(dtype).max)


def _fp8_scale(amax: torch.Tensor, dtype) -> torch.Tensor:
    amax = amax.float()
    return torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))


def quantize_fp8_per_tensor(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """``(q, scale[1])``: one fp32 scale for the whole tensor."""
    scale = _fp8_scale(x.abs().amax(), dtype).reshape(1)
    return (x.float() / scale).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype), scale


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK, dtype: torch.dtype = torch.float8_e4m3fn):
    """``x [M, K]`` -> ``(q [M, K], scale [M, ceil(K/group)])``: one scale per token per group."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).reshape(m, groups, group)
    scale = _fp8_scale(padded.abs().amax(dim=2), dtype)
    q = (padded / scale[:, :, None]).clamp(-fp8_max(dtype), fp8_max(dtype)).reshape(m, groups * group)[:, :k]
    return q.to(dtype).contiguous(), scale


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float8_e4m3fn):
    """``w [..., N, K]`` -> ``(q, scale [..., ceil(N/block), ceil(K/block)])``: one scale per block."""
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    blocks = padded.reshape(*lead, nb, block, kb, block)
    scale = _fp8_scale(blocks.abs().amax(dim=(-3, -1)), dtype)
    q = (blocks / scale[..., :, None, :, None]).clamp(-fp8_max(dtype), fp8_max(dtype))
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k]
    return q.to(dtype).contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple = (1, 1)) -> torch.Tensor:
    """fp32 ``q * scale`` where each scale covers a ``block`` of the last two dims (a
    one-element scale covers everything)."""
    if scale.numel() == 1:
        return q.float() * scale.float().reshape(())
    full = scale.float()
    for dim, size in ((-2, block[0]), (-1, block[1])):
        if size > 1:
            full = full.repeat_interleave(size, dim=dim)
    return q.float() * full[..., : q.shape[-2], : q.shape[-1]]
