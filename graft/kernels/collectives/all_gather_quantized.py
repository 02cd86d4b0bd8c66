"""Quantized all-gather: every rank sends int8 values plus one fp32 scale per block.

For ZeRO-style parameter gathering, where the gathered weights feed a forward pass and
are thrown away, the bytes on the wire matter more than the last bits: per block of
``block_size`` values the payload is ``block_size`` int8 + 4 bytes of scale, i.e.
``(b + 4) / (4b)`` of fp32 (0.258x at b=128) or ``(b + 4) / (2b)`` of bf16 (0.516x).

Error bound (what the tests check, element by element): symmetric round-to-nearest with
``scale = absmax(finite values of the block) / 126`` maps every finite value to ``q * scale``
with ``|x - q * scale| <= scale / 2 = absmax / 252`` (no clipping: ``|x| <= absmax`` so
``|x / scale| <= 126``). The dequantized fp32 value is then rounded to the output dtype,
adding at most half an ulp of it: ``|y| * 2^-8`` for bf16, ``2^-11`` for fp16, ``2^-24`` for
fp32. :func:`error_bound` returns that per-element bound; a zero block has scale 1 and is
exact.

Non-finite values travel exactly, as an exact gather moves them: the three int8 codes
outside ``[-126, 126]`` are escapes (``-128`` NaN, ``127`` +Inf, ``-127`` -Inf), and the
block's scale ignores them, so one NaN or Inf changes nothing else in its block. The
payload stays the same size on every rank (no extra exchange, no host sync).

Where it pays: bandwidth-bound gathers (across nodes, or large ZeRO-3 parameter gathers on
slow links). Small messages are latency-bound and the extra quantize/dequantize passes cost
more than they save, so below ``GRAFT_QUANTIZED_GATHER_MIN_BYTES`` per rank (default 64 KiB)
the exact gather serves the op. On loopback gloo (this machine's CPU runs) memory copies
are as fast as the "network", and the benchmark shows no gain at any size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from graft.custom_ops import define_op
from graft.registry import Implementation

from ._common import all_gather_single, quantized_min_bytes, resolve_group

QMAX = 126  # finite values use [-126, 126]; the codes outside are the escapes below
NAN_CODE, POSINF_CODE, NEGINF_CODE = -128, 127, -127
_HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def _finite_absmax(blocks: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(blocks)
    return torch.where(finite, blocks.abs(), 0.0).amax(dim=1)


def quantize(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> (int8 values [blocks, block_size], fp32 scales [blocks])."""
    blocks = _blocks(x, block_size)
    absmax = _finite_absmax(blocks)
    scales = absmax / QMAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(torch.nan_to_num(blocks, nan=0.0, posinf=0.0, neginf=0.0) / scales[:, None])
    q = q.clamp_(-QMAX, QMAX)
    q = torch.where(torch.isnan(blocks), NAN_CODE, q)
    q = torch.where(blocks == float("inf"), POSINF_CODE, q)
    q = torch.where(blocks == float("-inf"), NEGINF_CODE, q)
    return q.to(torch.int8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, shape, dtype) -> torch.Tensor:
    qf = q.to(torch.float32)
    values = qf * scales[:, None]
    escaped = qf.abs() > QMAX
    special = torch.where(qf == NAN_CODE, float("nan"), torch.sign(qf) * float("inf"))
    values = torch.where(escaped, special, values)
    return values.reshape(-1)[:numel].to(dtype).view(shape)


def error_bound(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x| (see the module docstring);
    0 where x is not finite (NaN, +-Inf travel exactly)."""
    absmax = _finite_absmax(_blocks(x, block_size))[:, None]
    per_elem = (absmax / (2 * QMAX)).expand(-1, block_size).reshape(-1)[: x.numel()].view(x.shape)
    half_ulp = _HALF_ULP.get(x.dtype, 0.0)
    finite = torch.isfinite(x)
    bound = per_elem * (1 + 1e-6) + (torch.where(finite, x.abs().float(), 0.0) + per_elem) * half_ulp
    return torch.where(finite, bound, 0.0)


def _gather_int8(x: torch.Tensor, block_size: int, group_name: str) -> torch.Tensor:
    pg = resolve_group(group_name)
    ws = dist.get_world_size(pg)
    q, scales = quantize(x, block_size)
    # One collective, not two: values and scales share a byte payload.
    payload = torch.cat([q.reshape(-1).view(torch.uint8), scales.view(torch.uint8)])
    gathered = payload.new_empty(ws * payload.numel())
    all_gather_single(gathered, payload, group=pg)
    n_q = q.numel()
    parts = []
    for row in gathered.view(ws, -1):
        rq = row[:n_q].view(torch.int8).view(q.shape)
        rs = row[n_q:].clone().view(torch.float32)  # clone: the float view needs 4-byte alignment
        parts.append(dequantize(rq, rs, x.numel(), x.shape, x.dtype))
    return torch.cat(parts) if parts[0].dim() else torch.stack(parts)


def _fake(x: torch.Tensor, block_size: int, group_name: str) -> torch.Tensor:
    ws = dist.get_world_size(resolve_group(group_name))
    return torch.empty((ws * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)


int8_op = define_op("collectives_all_gather_quantized_int8", _gather_int8, fake=_fake)


def all_gather_int8(x, group=None, block_size: int = 128):
    return int8_op(x.contiguous(), block_size, resolve_group(group).group_name)


def _check(x, group=None, block_size=128):
    nbytes = x.numel() * x.element_size()
    if nbytes < quantized_min_bytes():
        # Latency-bound: quantize/dequantize passes cost more than the bytes they save.
        return f"{nbytes} bytes per rank < {quantized_min_bytes()} (GRAFT_QUANTIZED_GATHER_MIN_BYTES): exact gather"
    return None


def register(registry) -> None:
    registry.add_impl(
        Implementation(
            op="collectives.all_gather_quantized",
            backend="int8",
            fn=all_gather_int8,
            description="int8 values + fp32 per-block scales, one all-gather",
            devices=frozenset({"cpu", "cuda"}),
            dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
            check=_check,
            custom_op=int8_op,
        )
    )
