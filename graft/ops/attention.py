"""Attention: flash-attention prefill over packed variable-length sequences, and
single-token decode against a paged KV cache.

``attention.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
causal=False, softmax_scale=None)`` follows flash-attn's "varlen" convention:

* ``q`` is ``[total_q, num_heads, head_dim]``, ``k``/``v`` are ``[total_k, num_kv_heads,
  head_dim]``: the sequences of a batch packed one after the other along dim 0.
* ``cu_seqlens_q``/``cu_seqlens_k`` (int32, ``[batch + 1]``, starting at 0,
  non-decreasing) are the offsets of each sequence; ``cu_seqlens_q[-1] == total_q``
  and ``cu_seqlens_k[-1] <= total_k``. ``max_seqlen_q``/``max_seqlen_k`` are upper
  bounds of the per-sequence lengths (kernels size their launch grid with them).
* GQA/MQA: ``num_heads % num_kv_heads == 0``; query head ``h`` reads kv head
  ``h // (num_heads // num_kv_heads)``.
* ``causal`` masks are bottom-right aligned when a sequence has ``seqlen_q != seqlen_k``
  (query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``), as in flash-attn >= 2.1 and
  vLLM: the queries are the last ``seqlen_q`` tokens of the context. A query row that
  sees no key outputs zeros.
* ``softmax_scale`` defaults to ``1/sqrt(head_dim)``. Softmax and accumulation are fp32;
  the output has ``q``'s dtype and shape.

``attention.decode_paged(query, key_cache, value_cache, block_tables, seq_lens,
softmax_scale=None, num_splits=0, k_scale=None, v_scale=None)``: one query token per sequence.

* ``query`` is ``[num_seqs, num_heads, head_dim]``.
* ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``:
  the per-cache layout of vLLM's v1 FlashAttention backend. (vLLM 0.33 allocates one
  ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` tensor per layer and hands the
  kernel ``kv_cache.transpose(1, 2).split(head_dim, -1)``, i.e. two non-contiguous views of
  exactly this logical shape; older releases used ``[2, num_blocks, block_size,
  num_kv_heads, head_dim]`` and ``kv_cache.unbind(0)``. Both are served without copies:
  kernels take arbitrary strides.)
* ``block_tables`` (int32, ``[num_seqs, max_blocks_per_seq]``) maps a sequence's logical
  block ``i`` (tokens ``i*block_size ..``) to a physical block of the caches.
* ``seq_lens`` (int32, ``[num_seqs]``) is each context's length including the current
  token; ``0`` gives a zero output row.
* fp8 KV cache (vLLM's ``kv_cache_dtype="fp8"``/``"fp8_e5m2"``): ``key_cache``/``value_cache``
  in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (both the same dtype) hold values
  divided by the per-tensor scales ``k_scale``/``v_scale`` (vLLM's ``layer._k_scale`` /
  ``_v_scale``: a float or a one-element fp32 tensor on the query's device; tensors keep
  CUDA graphs free of host reads). Both are required with an fp8 cache and rejected with
  any other. The reference dequantises (``k.float() * k_scale``) and computes in fp32;
  kernels dequantise on load. ``query`` stays fp16/bf16/fp32 and sets the output dtype.
* ``num_splits`` only changes how an implementation partitions the work (split-K /
  flash-decoding); ``0`` lets it choose, a forced count is capped (Triton: 64 splits).
  Results must not depend on it beyond rounding.
* Out-of-range values never reach memory, whatever the value-check settings: with the
  checks on they are a ``GraftInputError`` (below); with them off (``GRAFT_CHECK_VALUES=0``,
  tracing, CUDA graphs) a ``seq_len`` outside ``[0, capacity]`` is clamped into it and the
  tokens of a used block-table entry outside ``[0, num_blocks)`` are skipped (they take
  no part in the softmax; a row with no valid token outputs zeros). The reference
  defines the same results.

``attention.prefill_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
max_seqlen_q, causal=False, softmax_scale=None)``: prefill (or a chunk of one) whose keys and
values are read from the paged cache, as vLLM runs prefills with cached context (prefix
caching, chunked prefill). Forward only (inference): no backward is registered.

* ``q`` is packed as in ``attention.prefill`` (``cu_seqlens_q``, ``max_seqlen_q``);
  ``key_cache``/``value_cache``/``block_tables`` are as in ``attention.decode_paged``.
* ``seq_lens[b]`` is sequence ``b``'s whole context in the cache: the cached tokens *and*
  this step's, already written there (vLLM writes the cache before attention). Its keys are
  tokens ``0 .. seq_lens[b] - 1`` through its block-table row; its ``seqlen_q`` queries are
  the last ``seqlen_q`` of them, so ``causal`` is bottom-right aligned as in
  ``attention.prefill`` (query ``i`` sees keys ``j <= i + seq_len - seqlen_q``) and
  ``seqlen_q <= seq_len``. With no cached context it equals ``attention.prefill`` on the
  contiguous keys/values.
* Out-of-range values (value checks off) are handled as in both ops above: ``cu_seqlens_q``
  clamped to the packed rows, ``seq_len`` clamped into ``[0, capacity]``, tokens of a table
  entry outside ``[0, num_blocks)`` skipped, a row that sees no key outputs zeros.

Validation (``GraftInputError``) checks dtypes, ranks, shapes, GQA divisibility, index
dtypes and devices from metadata, and reads ``cu_seqlens_*`` / ``seq_lens`` back from the
device for the value checks (start at 0, non-decreasing, totals, ``max_seqlen`` bounds,
``0 <= seq_len <= block-table capacity``, the used block-table entries in
``[0, num_blocks)``). Those value checks are skipped while tracing
(``torch.compile``, fake/meta tensors) and during CUDA-graph capture, where reading device
memory is impossible. No input needs to be contiguous: the Triton kernels take strides.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch

from graft.cases import OpCase
from graft.custom_ops import no_double_backward
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import (acc, acc_dtype, can_read_values, check_same_device, check_same_dtype, check_tensor,
                                 checks_values_on, int_steps, readable_bounds, values_in_range)
from graft.registry import OpSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32,)
# fp8 KV-cache formats (vLLM's "fp8"/"fp8_e4m3" and "fp8_e5m2"), dequantised with per-tensor scales.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------- references


def _attend(q, k, v, scale, causal, key_pos=None, context_len=None):
    """One sequence: q [Sq, H, D], k/v [Sk, KVH, D] -> fp32 [Sq, H, D]. Plain fp32 math.

    ``key_pos``/``context_len``: the keys are the tokens at ``key_pos`` of a context of
    ``context_len`` tokens (some skipped); the causal diagonal follows those positions."""
    sq, num_heads, _ = q.shape
    sk, num_kv_heads, _ = k.shape
    if key_pos is None:
        key_pos, context_len = torch.arange(sk, device=q.device), sk
    group = num_heads // num_kv_heads
    qf = acc(q).transpose(0, 1)  # [H, Sq, D]
    kf = acc(k).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Sk, D]
    vf = acc(v).repeat_interleave(group, dim=1).transpose(0, 1)
    if sk == 0:
        return torch.zeros(sq, num_heads, q.shape[-1], dtype=acc_dtype(q), device=q.device)
    probs = _probs(qf, kf, scale, causal, key_pos, context_len)
    return torch.matmul(probs, vf).transpose(0, 1)  # [Sq, H, D]


def _probs(qf, kf, scale, causal, key_pos, context_len):
    """Attention weights [H, Sq, Sk] of fp32 ``qf`` [H, Sq, D] over ``kf`` [H, Sk, D]: the
    causal diagonal bottom-right aligned on ``key_pos`` in a context of ``context_len``."""
    sq = qf.shape[1]
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if causal:
        visible = key_pos[None, :] <= torch.arange(sq, device=qf.device)[:, None] + (context_len - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    # Rows that see no key: softmax of all -inf is NaN; define them as zeros.
    row_empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # masked out, not +inf from an inf input
    return torch.softmax(scores.masked_fill(row_empty, 0.0), dim=-1).masked_fill(row_empty, 0.0)


def _scale_or_default(softmax_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def prefill_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softmax_scale=None):
    scale = _scale_or_default(softmax_scale, q.shape[-1])
    out = torch.zeros_like(q)
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    total_q, total_k = q.shape[0], k.shape[0]
    for b in range(len(starts_q) - 1):
        # Clamped to the packed tensors (out-of-range or decreasing cu_seqlens with the value
        # checks off): the same bounds the kernels use; rows no sequence covers stay zero.
        q0 = min(max(starts_q[b], 0), total_q)
        q1 = min(max(starts_q[b + 1], q0), total_q)
        k0 = min(max(starts_k[b], 0), total_k)
        k1 = min(max(starts_k[b + 1], k0), total_k)
        if q1 > q0:
            out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal).to(q.dtype)
    return out


def _sdpa_serves(sq, sk, causal) -> bool:
    """Whether torch's SDPA computes what the reference defines for one sequence: some query
    and key, and (causal) every query row sees a key, so no row is the reference's zero row."""
    return sq > 0 and sk > 0 and (not causal or sq <= sk)


def _sdpa(q, k, v, scale, causal):
    """q [B, Sq, H, D], k/v [B, Sk, KVH, D] -> [B, Sq, H, D] through F.scaled_dot_product_attention
    (bottom-right causal; GQA without repeating K/V)."""
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal and sq != sk:  # SDPA's is_causal is top-left aligned: bottom-right needs the mask
        rows = torch.arange(sq, device=q.device)[:, None]
        mask = torch.arange(sk, device=q.device)[None, :] <= rows + (sk - sq)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal and mask is None,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def prefill_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softmax_scale=None):
    """graft's torch backend of attention.prefill (:func:`_prefill_torch_eager`). Its
    per-sequence lengths are host reads of ``cu_seqlens``, which ``torch.compile`` cannot trace
    (a data-dependent graph break, an error under ``fullgraph=True``): there it is the custom
    op ``torch.ops.graft.attention_prefill_torch`` (a fake of the output's shape, a backward
    that recomputes the forward and differentiates it eagerly, itself an op)."""
    if torch.compiler.is_compiling():
        return _PREFILL_TORCH_OP(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                   bool(causal), None if softmax_scale is None else float(softmax_scale))
    return _prefill_torch_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                softmax_scale)


def _prefill_torch_custom(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          softmax_scale: Optional[float]) -> torch.Tensor:
    with torch.no_grad():
        return _prefill_torch_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    softmax_scale).clone()


def _prefill_torch_custom_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                               softmax_scale: Optional[float]) -> torch.Tensor:
    return q.new_empty(q.shape)


def _prefill_torch_grads(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool, softmax_scale: Optional[float]) -> list[torch.Tensor]:
    """dq, dk, dv of attention.prefill, written out (a custom op's body records no autograd
    graph): per sequence, as :func:`_attend` defines the forward, in the accumulation dtype
    dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = dS K * scale, dK = dS^T Q * scale,
    dV = P^T dO; GQA gradients summed over each KV head's group."""
    scale = _scale_or_default(softmax_scale, q.shape[-1])
    gq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    gk = torch.zeros(k.shape, dtype=acc_dtype(k), device=k.device)
    gv = torch.zeros(v.shape, dtype=acc_dtype(v), device=v.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    total_q, total_k = q.shape[0], k.shape[0]
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    for b in range(len(starts_q) - 1):
        q0 = min(max(starts_q[b], 0), total_q)  # the forward's clamping of the bounds
        q1 = min(max(starts_q[b + 1], q0), total_q)
        k0 = min(max(starts_k[b], 0), total_k)
        k1 = min(max(starts_k[b + 1], k0), total_k)
        sq, sk = q1 - q0, k1 - k0
        if sq == 0 or sk == 0:
            continue
        qf = acc(q[q0:q1]).transpose(0, 1)  # [H, Sq, D]
        kf = acc(k[k0:k1]).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Sk, D]
        vf = acc(v[k0:k1]).repeat_interleave(group, dim=1).transpose(0, 1)
        do = acc(grad[q0:q1]).transpose(0, 1)
        probs = _probs(qf, kf, scale, causal, torch.arange(sk, device=q.device), sk)
        dp = torch.matmul(do, vf.transpose(1, 2))
        ds = probs * (dp - (dp * probs).sum(dim=-1, keepdim=True))
        gq[q0:q1] += (torch.matmul(ds, kf) * scale).transpose(0, 1)
        dk = torch.matmul(ds.transpose(1, 2), qf) * scale  # [H, Sk, D]
        dv = torch.matmul(probs.transpose(1, 2), do)
        gk[k0:k1] += dk.view(num_kv_heads, group, sk, head_dim).sum(1).transpose(0, 1)
        gv[k0:k1] += dv.view(num_kv_heads, group, sk, head_dim).sum(1).transpose(0, 1)
    return [gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)]


def _prefill_torch_grads_fake(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                              max_seqlen_k: int, causal: bool, softmax_scale: Optional[float]) -> list[torch.Tensor]:
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]


def _register_prefill_torch_ops():
    """The custom ops of the torch backend under torch.compile (registered at import: a
    registration cannot be traced)."""
    from graft.custom_ops import define_op, register_backward

    forward = define_op("attention_prefill_torch", _prefill_torch_custom, fake=_prefill_torch_custom_fake)
    grads = define_op("attention_prefill_torch_grads", _prefill_torch_grads, fake=_prefill_torch_grads_fake)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.rest = inputs[5:]

    def backward(ctx, grad):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        gq, gk, gv = grads(grad.contiguous(), q, k, v, cu_q, cu_k, *ctx.rest)
        return gq, gk, gv, None, None, None, None, None, None

    register_backward(forward, backward, setup_context, name="attention.prefill on torch")
    return forward


def _prefill_torch_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                         softmax_scale=None):
    """graft's torch backend of attention.prefill: torch's fused attention
    (``F.scaled_dot_product_attention``, fp32 softmax and accumulation as the reference), one
    batched call when every sequence has the same lengths (a framework's ``[batch, seq]``
    batch), else one call per sequence; the reference's own code for the sequences SDPA does
    not define the same way (a causal query row that sees no key, empty sequences) and for
    non-finite inputs. Differentiable through SDPA's own backward."""
    # SDPA's CPU kernel drops a NaN query where the reference propagates it: non-finite
    # inputs take the reference. Any NaN/inf makes the sum non-finite (one cheap reduction
    # per tensor and one host read; a sum that merely overflows also takes the reference).
    if not math.isfinite(q.detach().sum() + k.detach().sum() + v.detach().sum()):
        return prefill_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale)
    scale = _scale_or_default(softmax_scale, q.shape[-1])
    # SDPA's fused kernels (CPU flash, CUDA flash/efficient) have no double backward: name it.
    q, k, v = no_double_backward("attention.prefill on torch", "torch's fused SDPA backward cannot be "
                                 "differentiated again", q, k, v)
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    total_q, total_k = q.shape[0], k.shape[0]
    batch = len(starts_q) - 1
    if batch > 0 and total_q % batch == 0:
        sq, sk = total_q // batch, starts_k[-1] // batch
        if (sk * batch <= total_k and _sdpa_serves(sq, sk, causal)
                and starts_q == list(range(0, total_q + 1, sq)) and starts_k == list(range(0, sk * batch + 1, sk))):
            out = _sdpa(q.view(batch, sq, *q.shape[1:]), k[: sk * batch].view(batch, sk, *k.shape[1:]),
                        v[: sk * batch].view(batch, sk, *v.shape[1:]), scale, causal)
            return out.reshape(q.shape)
    out = torch.zeros_like(q)
    for b in range(batch):
        # The reference's clamping of the bounds (out-of-range cu_seqlens with value checks off).
        q0 = min(max(starts_q[b], 0), total_q)
        q1 = min(max(starts_q[b + 1], q0), total_q)
        k0 = min(max(starts_k[b], 0), total_k)
        k1 = min(max(starts_k[b + 1], k0), total_k)
        if q1 == q0:
            continue
        if _sdpa_serves(q1 - q0, k1 - k0, causal):
            out[q0:q1] = _sdpa(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal)[0]
        else:
            out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal).to(q.dtype)
    return out


_PREFILL_TORCH_OP = _register_prefill_torch_ops()


def prefill_paged_torch(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                        causal=False, softmax_scale=None):
    """graft's torch backend of attention.prefill_paged: every sequence's context gathered
    out of its pages with one index (what vLLM's own torch paths do), then
    :func:`prefill_torch` (SDPA). Out-of-range lengths, block ids or query bounds (value
    checks off) take the reference, which defines what they mean."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    lens = seq_lens.tolist()
    starts = cu_seqlens_q.tolist()
    capacity = block_tables.shape[1] * block_size
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if (not lens or sum(lens) == 0 or starts[0] != 0 or starts[-1] > q.shape[0]
            or any(not 0 <= n <= capacity or not 0 <= m <= n for n, m in zip(lens, q_lens))):
        return prefill_paged_reference(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                       max_seqlen_q, causal, softmax_scale)
    counts = torch.tensor(lens)
    req = torch.repeat_interleave(torch.arange(len(lens)), counts).to(q.device)
    pos = (torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)).to(q.device)
    blocks = block_tables[req, pos // block_size].long()
    if not bool(((blocks >= 0) & (blocks < num_blocks)).all()):
        return prefill_paged_reference(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                       max_seqlen_q, causal, softmax_scale)
    slot = pos % block_size
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = counts.cumsum(0).to(q.device)
    return prefill_torch(q, key_cache[blocks, slot], value_cache[blocks, slot], cu_seqlens_q, cu_k, max_seqlen_q,
                         max(lens), causal, softmax_scale)


def torch_implementations():
    """graft's torch backend of attention.prefill, prefill_paged and decode_paged (rank above the plain references)."""
    from graft.registry import torch_fast_path

    return [
        torch_fast_path("attention.prefill", prefill_torch,
                        "torch.nn.functional.scaled_dot_product_attention (batched when sequences have equal "
                        "lengths); reference for zero-key causal rows and non-finite inputs"),
        torch_fast_path("attention.prefill_paged", prefill_paged_torch,
                        "context gathered out of the pages with one index, then SDPA (prefill's torch "
                        "backend); reference for out-of-range lengths and block ids"),
        torch_fast_path("attention.decode_paged", decode_paged_torch,
                        "all sequences in one batched matmul/softmax over the used pages (gathered once, fp8 "
                        "dequantised after the gather), shorter contexts masked"),
    ]


def decode_paged_reference(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                           k_scale=None, v_scale=None):
    scale = _scale_or_default(softmax_scale, query.shape[-1])
    block_size = key_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    out = torch.zeros_like(query)
    for s, n in enumerate(seq_lens.tolist()):
        n = min(max(n, 0), capacity)  # out-of-range lengths (value checks off) are clamped
        # Tokens of a table entry outside [0, num_blocks) are skipped (see the module doc).
        context = _paged_context(key_cache, value_cache, block_tables[s], n, k_scale, v_scale) if n else None
        if context is None:
            continue
        k, v, _ = context
        out[s] = _attend(query[s : s + 1], k, v, scale, causal=False)[0].to(query.dtype)
    return out


def _blocks_of(cache, blocks, scale):
    """``cache[blocks]``; an fp8 cache is indexed as bytes (torch's CPU indexing takes no fp8
    dtype) and dequantised (``.float() * scale``) after the gather: only the pages read."""
    if cache.dtype not in FP8_KV_DTYPES:
        return cache[blocks]
    scale = scale.reshape(()) if isinstance(scale, torch.Tensor) else float(scale)  # a tensor: no host read
    return cache.view(torch.uint8)[blocks].view(cache.dtype).float() * scale


def _paged_context(key_cache, value_cache, table_row, n, k_scale=None, v_scale=None):
    """Sequence keys/values of the first ``n`` cache tokens of one table row, without the
    tokens of entries outside [0, num_blocks): (k, v, their positions or None when none is
    skipped), or None if no token is left. fp8 caches come back dequantised (fp32)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    blocks = table_row[: (n + block_size - 1) // block_size].long()
    block_ok = (blocks >= 0) & (blocks < num_blocks)
    if bool(block_ok.all()):  # the usual case: no masking needed
        k = _blocks_of(key_cache, blocks, k_scale).reshape(-1, num_kv_heads, head_dim)[:n]
        return k, _blocks_of(value_cache, blocks, v_scale).reshape(-1, num_kv_heads, head_dim)[:n], None
    ok = block_ok.repeat_interleave(block_size)[:n]
    if not bool(ok.any()):
        return None
    blocks = blocks.clamp(0, num_blocks - 1)
    k = _blocks_of(key_cache, blocks, k_scale).reshape(-1, num_kv_heads, head_dim)[:n][ok]
    v = _blocks_of(value_cache, blocks, v_scale).reshape(-1, num_kv_heads, head_dim)[:n][ok]
    return k, v, torch.arange(n, device=key_cache.device)[ok]


def decode_paged_torch(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                       k_scale=None, v_scale=None):
    """graft's torch backend of attention.decode_paged: every sequence at once, no Python loop
    over them. The tokens up to the longest context are gathered out of their pages with one
    index per cache, straight into the ``[seqs, kv_heads, tokens, head_dim]`` layout the
    batched matmuls take (an fp8 cache as bytes, dequantised after the gather), so the work
    grows with the batch's contexts, never with the cache; shorter contexts and the tokens of
    out-of-range table entries are masked out of the softmax. fp32 math as the reference
    (``num_splits`` changes nothing here: one pass). One host read: the longest context."""
    scale = _scale_or_default(softmax_scale, query.shape[-1])
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.clamp(0, capacity)  # out-of-range lengths (value checks off) are clamped
    longest = int(lens.max()) if num_seqs else 0
    if longest == 0 or num_blocks == 0:  # no token to attend to: zero rows
        return torch.zeros_like(query)
    device = query.device
    pos = torch.arange(longest, device=device)
    blocks = block_tables[:, pos // block_size].long()  # [N, tokens]
    clamped = blocks.clamp(0, num_blocks - 1)  # masked tokens read a valid block, never outside the cache
    visible = (pos[None, :] < lens[:, None]) & (clamped == blocks)  # (== : the entry was in range)
    blocks = clamped
    slots = pos % block_size
    pair = _kv_tokens_of(key_cache, value_cache, blocks, slots, k_scale, v_scale)
    if pair is not None:  # vLLM's layout: each token's key and value side by side, one gather
        k, v = pair
    else:
        k = _tokens_of(key_cache, blocks, slots, k_scale)  # [N, KVH, tokens, D]
        v = _tokens_of(value_cache, blocks, slots, v_scale)
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [N, KVH, group, tokens]: GQA without repeating K/V
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    # A row that sees no key (all masked, or every key -inf) outputs zeros, as in the reference.
    # (amax == -inf: the same rows as isneginf(...).all(), NaN rows included, in one reduction)
    row_empty = scores.amax(dim=-1, keepdim=True) == float("-inf")
    probs = torch.softmax(scores.masked_fill(row_empty, 0.0), dim=-1).masked_fill(row_empty, 0.0)
    return torch.matmul(probs, v).reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _kv_tokens_of(key_cache, value_cache, blocks, slots, k_scale, v_scale):
    """Keys and values of the tokens (as ``_tokens_of``) in one gather, where both caches are
    views of one storage with each (block, slot, head)'s value row a fixed distance after its
    key row (vLLM's ``[num_blocks, kv_heads, block_size, 2 * head_size]`` cache split in
    two): the gather copies each token's key and value as one contiguous run, and the runs of
    one (block, head) follow each other in memory, so decode reads its pages sequentially
    (two separate row gathers, each skipping every other run, were latency-bound: 4x
    slower at vLLM's CPU shapes). None where the caches are not laid out so."""
    k_raw = key_cache.view(torch.uint8) if key_cache.dtype in FP8_KV_DTYPES else key_cache
    v_raw = value_cache.view(torch.uint8) if value_cache.dtype in FP8_KV_DTYPES else value_cache
    if (k_raw.dtype != v_raw.dtype or k_raw.stride() != v_raw.stride() or k_raw.shape != v_raw.shape
            or k_raw.stride(3) != 1 or k_raw.numel() == 0
            or k_raw.untyped_storage().data_ptr() != v_raw.untyped_storage().data_ptr()):
        return None
    delta = v_raw.storage_offset() - k_raw.storage_offset()
    d = k_raw.shape[3]
    s_block, s_slot, s_head, _ = k_raw.stride()
    row = math.gcd(math.gcd(s_block, s_slot), s_head)
    width = delta + d
    if delta < d or row <= 0 or min(s_block, s_slot, s_head) < 0 or width > 4 * d:
        return None
    last = sum((n - 1) * st for n, st in zip(k_raw.shape[:3], (s_block, s_slot, s_head))) // row
    available = k_raw.untyped_storage().nbytes() // k_raw.element_size() - k_raw.storage_offset()
    if last * row + width > available:
        return None
    heads = torch.arange(k_raw.shape[2], device=k_raw.device)
    offsets = (blocks[:, None, :] * (s_block // row) + heads[None, :, None] * (s_head // row)
               + slots * (s_slot // row))
    rows = k_raw.as_strided((last + 1, width), (row, 1))
    out = rows.index_select(0, offsets.flatten()).view(*offsets.shape, width)
    k, v = out[..., :d], out[..., delta:width]
    if k_raw is key_cache:
        return k.float(), v.float()
    return _dequantised(k, key_cache.dtype, k_scale), _dequantised(v, value_cache.dtype, v_scale)


def _dequantised(codes, dtype, scale):
    """fp8 codes (as bytes) -> fp32 values times the scale, through a 256-entry table (the
    same fp32 product as ``.float() * scale``, NaN codes included): torch's CPU fp8 -> fp32
    conversion is elementwise scalar code, several times slower than this lookup."""
    scale = scale.reshape(()) if isinstance(scale, torch.Tensor) else float(scale)
    values = _fp8_values(dtype, codes.device) * scale
    return values.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _tokens_of(cache, blocks, slots, scale):
    """``cache`` ([num_blocks, block_size, kv_heads, D]) at the tokens (``blocks`` [N, tokens],
    ``slots`` [tokens]) of every kv head, as fp32 ``[N, kv_heads, tokens, D]``; an fp8 cache
    gathered as bytes (torch's CPU indexing takes no fp8 dtype), then dequantised."""
    raw = cache.view(torch.uint8) if cache.dtype in FP8_KV_DTYPES else cache
    heads = torch.arange(raw.shape[2], device=raw.device)
    s_block, s_slot, s_head, s_dim = raw.stride()
    row = math.gcd(math.gcd(s_block, s_slot), s_head)
    if s_dim == 1 and row > 0 and min(s_block, s_slot, s_head) >= 0:
        # Every (block, slot, head) starts a run of D contiguous elements at a multiple of
        # ``row``: over the storage seen as rows ``row`` apart, one index_select copies whole
        # rows (vLLM's strided views included), about twice as fast as advanced indexing,
        # which computes an offset per element.
        offsets = (blocks[:, None, :] * (s_block // row) + heads[None, :, None] * (s_head // row)
                   + slots * (s_slot // row))
        last = sum((n - 1) * st for n, st in zip(raw.shape[:3], (s_block, s_slot, s_head))) // row
        rows = raw.as_strided((last + 1, raw.shape[3]), (row, 1))
        out = rows.index_select(0, offsets.flatten()).view(*offsets.shape, raw.shape[3])
    else:
        out = raw.permute(0, 2, 1, 3)[blocks[:, None, :], heads[None, :, None], slots]
    if raw is cache:
        return out.float()
    return _dequantised(out, cache.dtype, scale)


_FP8_VALUES: dict = {}


def _fp8_values(dtype, device) -> torch.Tensor:
    """fp32 value of each of the 256 codes of an fp8 format (index = the byte)."""
    key = (dtype, device)
    if key not in _FP8_VALUES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_VALUES[key] = codes.view(dtype).float().to(device)
    return _FP8_VALUES[key]


def prefill_paged_reference(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                            causal=False, softmax_scale=None):
    scale = _scale_or_default(softmax_scale, q.shape[-1])
    capacity = block_tables.shape[1] * key_cache.shape[1]
    out = torch.zeros_like(q)
    starts_q = cu_seqlens_q.tolist()
    total_q = q.shape[0]
    for b, n in enumerate(seq_lens.tolist()):
        # The same clamps as attention.prefill (cu_seqlens_q) and decode_paged (seq_len).
        q0 = min(max(starts_q[b], 0), total_q)
        q1 = min(max(starts_q[b + 1], q0), total_q)
        n = min(max(n, 0), capacity)
        if q1 == q0 or n == 0:
            continue
        context = _paged_context(key_cache, value_cache, block_tables[b], n)
        if context is None:
            continue
        k, v, pos = context
        out[q0:q1] = _attend(q[q0:q1], k, v, scale, causal, key_pos=pos, context_len=None if pos is None else n
                             ).to(q.dtype)
    return out


# --------------------------------------------------------------------------- validation


def _as_int(name, value, op):
    try:
        return operator.index(value)
    except TypeError:
        raise GraftInputError(f"{op}: {name} must be an int, got {type(value).__name__}") from None


def _check_scale(op, softmax_scale):
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise GraftInputError(f"{op}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}")


def _check_heads(op, q_name, num_heads, num_kv_heads):
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise GraftInputError(
            f"{op}: {q_name} has {num_heads} heads, not a multiple of num_kv_heads={num_kv_heads} (GQA needs a whole "
            "number of query heads per kv head)"
        )


def _check_cu_seqlens(op, name, cu, total, max_seqlen, exact_total) -> tuple:
    """cu_seqlens checked; returns its (first, last, shortest, longest sequence). A valid
    contiguous CPU tensor is read in C (graft/_fastcall.c); anything else, or one that fails,
    once as a list (cheaper than comparisons as tensors), which names the problem."""
    steps = int_steps(cu)
    if steps is not None:
        first, last, shortest, longest = steps
        if (first == 0 and shortest >= 0 and last <= total and (last == total or not exact_total)
                and longest <= max_seqlen):
            return steps
    values = cu.tolist()
    if values[0] != 0:
        raise GraftInputError(f"{op}: {name} must start at 0, got {values[0]}")
    lengths = list(map(operator.sub, values[1:], values))  # runs on every call: no generator frames
    if lengths and min(lengths) < 0:
        raise GraftInputError(f"{op}: {name} must be non-decreasing, got {values}")
    if exact_total and values[-1] != total:
        raise GraftInputError(f"{op}: {name}[-1] = {values[-1]} must equal the number of packed tokens ({total})")
    if values[-1] > total:
        raise GraftInputError(f"{op}: {name}[-1] = {values[-1]} exceeds the number of packed tokens ({total})")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise GraftInputError(f"{op}: a sequence has {longest} tokens but the max_seqlen given for {name} is {max_seqlen}")
    return values[0], values[-1], min(lengths, default=0), longest


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def validate_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softmax_scale=None):
    # Fast path (value checks off, as on GPUs by default): the common valid call in a few
    # attribute reads; anything else goes through the full checks below, which name the problem.
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)
            and q.dtype in _FLOAT_SET and k.dtype == q.dtype and v.dtype == q.dtype
            and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
            and q.ndim == 3 and k.ndim == 3 and cu_seqlens_q.ndim == 1 and k.shape == v.shape
            and q.shape[2] == k.shape[2] and k.shape[1] and not q.shape[1] % k.shape[1]
            and cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0] and cu_seqlens_q.shape[0] >= 1
            and cu_seqlens_k.ndim == 1 and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and max_seqlen_q >= 0 and max_seqlen_k >= 0 and type(causal) is bool
            and (softmax_scale is None or type(softmax_scale) is float)
            and k.device == q.device and v.device == q.device and cu_seqlens_q.device == q.device
            and cu_seqlens_k.device == q.device and not checks_values_on(cu_seqlens_q)):
        return
    op = "attention.prefill"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(f"{op}: {name}", t, dtypes=FLOAT_DTYPES, ndim=3)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(f"{op}: {name}", t, dtypes=INDEX_DTYPES, ndim=1)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if k.shape != v.shape:
        raise GraftInputError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise GraftInputError(f"{op}: head_dim of q ({q.shape[2]}) and k/v ({k.shape[2]}) differ")
    _check_heads(op, "q", q.shape[1], k.shape[1])
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 1:
        raise GraftInputError(
            f"{op}: cu_seqlens_q and cu_seqlens_k must both have batch+1 >= 1 entries, got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    max_q = _as_int("max_seqlen_q", max_seqlen_q, op)
    max_k = _as_int("max_seqlen_k", max_seqlen_k, op)
    if not isinstance(causal, bool):
        raise GraftInputError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    _check_scale(op, softmax_scale)
    check_prefill_values(q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k)


def check_prefill_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """attention.prefill's checks of values (``OpSpec.check_values``): the max_seqlens (which
    change from call to call), and the cu_seqlens where values may be read."""
    op = "attention.prefill"
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise GraftInputError(f"{op}: max_seqlen_q/max_seqlen_k must be >= 0, got {max_seqlen_q}/{max_seqlen_k}")
    if can_read_values(cu_seqlens_q):
        _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, exact_total=True)
        _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, exact_total=False)


def _check_kv_scales(op, query, key_cache, value_cache, k_scale, v_scale):
    """fp8 caches need both scales (float or one-element fp32 tensor on query's device);
    other caches take none."""
    fp8 = key_cache.dtype in FP8_KV_DTYPES or value_cache.dtype in FP8_KV_DTYPES
    if not fp8:
        check_same_dtype(query=query, key_cache=key_cache, value_cache=value_cache)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise GraftInputError(
                    f"{op}: {name} is given but the caches are {key_cache.dtype}; scales apply only to fp8 caches "
                    f"({', '.join(str(d) for d in FP8_KV_DTYPES)})"
                )
        return
    if key_cache.dtype != value_cache.dtype:
        raise GraftInputError(
            f"{op}: key_cache is {key_cache.dtype} and value_cache {value_cache.dtype}; an fp8 KV cache needs one "
            f"dtype for both"
        )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise GraftInputError(
                f"{op}: {name} is required with an fp8 KV cache ({key_cache.dtype}): the per-tensor scale the cache "
                "was quantised with (vLLM: layer._k_scale / layer._v_scale)"
            )
        if isinstance(scale, torch.Tensor):
            if scale.dtype != torch.float32 or scale.numel() != 1:
                raise GraftInputError(
                    f"{op}: {name} must be a float or a one-element float32 tensor, got a {scale.dtype} tensor of "
                    f"shape {tuple(scale.shape)}"
                )
            if scale.device != query.device:
                raise GraftInputError(f"{op}: {name} is on {scale.device}, query on {query.device}; use one device")
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise GraftInputError(f"{op}: {name} must be a float or a one-element float32 tensor, got "
                                  f"{type(scale).__name__}")


def _fast_scale(scale, query) -> bool:
    if type(scale) is float:
        return True
    return (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.numel() == 1
            and scale.device == query.device)


def _fast_kv_dtypes(query, key_cache, value_cache, k_scale, v_scale) -> bool:
    """The caches' dtypes and scales are a valid pair: query's dtype without scales, or fp8 with both."""
    if key_cache.dtype == query.dtype:
        return value_cache.dtype == query.dtype and k_scale is None and v_scale is None
    return (key_cache.dtype in FP8_KV_DTYPES and value_cache.dtype == key_cache.dtype
            and _fast_scale(k_scale, query) and _fast_scale(v_scale, query))


def validate_decode_paged(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                          k_scale=None, v_scale=None):
    # Fast path (value checks off, as on GPUs by default); the full checks below name any problem.
    if (isinstance(query, torch.Tensor) and isinstance(key_cache, torch.Tensor)
            and isinstance(value_cache, torch.Tensor) and isinstance(block_tables, torch.Tensor)
            and isinstance(seq_lens, torch.Tensor) and query.dtype in _FLOAT_SET
            and _fast_kv_dtypes(query, key_cache, value_cache, k_scale, v_scale) and block_tables.dtype == torch.int32
            and seq_lens.dtype == torch.int32 and query.ndim == 3 and key_cache.ndim == 4
            and block_tables.ndim == 2 and seq_lens.ndim == 1 and key_cache.shape == value_cache.shape
            and query.shape[2] == key_cache.shape[3] and key_cache.shape[1] >= 1 and key_cache.shape[2]
            and not query.shape[1] % key_cache.shape[2] and block_tables.shape[0] == query.shape[0]
            and seq_lens.shape[0] == query.shape[0] and type(num_splits) is int and num_splits >= 0
            and (softmax_scale is None or type(softmax_scale) is float)
            and key_cache.device == query.device and value_cache.device == query.device
            and block_tables.device == query.device and seq_lens.device == query.device
            and not checks_values_on(seq_lens)):
        return
    op = "attention.decode_paged"
    _check_paged_metadata(op, "query", query, key_cache, value_cache, block_tables, seq_lens,
                          cache_dtypes=FLOAT_DTYPES + FP8_KV_DTYPES)
    _check_kv_scales(op, query, key_cache, value_cache, k_scale, v_scale)
    num_seqs = query.shape[0]
    splits = _as_int("num_splits", num_splits, op)
    if splits < 0:
        raise GraftInputError(f"{op}: num_splits must be >= 0 (0 = choose automatically), got {splits}")
    _check_scale(op, softmax_scale)
    check_decode_paged_values(key_cache, block_tables, seq_lens)


def check_decode_paged_values(key_cache, block_tables, seq_lens):
    """attention.decode_paged's checks of values (``OpSpec.check_values``)."""
    bounds = readable_bounds(seq_lens)
    if bounds is not None:
        _check_paged_values("attention.decode_paged", key_cache, block_tables, seq_lens, bounds)


def _check_paged_metadata(op, q_name, query, key_cache, value_cache, block_tables, seq_lens, num_seqs=None,
                          cache_dtypes=FLOAT_DTYPES):
    """Dtypes, ranks, shapes and devices of a paged KV cache and its table (no value read);
    ``num_seqs`` defaults to the query's first dimension (one token per sequence). Caches in
    the query's dtype, unless ``cache_dtypes`` admits fp8 (the caller then checks the scales)."""
    check_tensor(f"{op}: {q_name}", query, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(f"{op}: key_cache", key_cache, dtypes=cache_dtypes, ndim=4)
    check_tensor(f"{op}: value_cache", value_cache, dtypes=cache_dtypes, ndim=4)
    check_tensor(f"{op}: block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(f"{op}: seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1)
    if key_cache.dtype not in FP8_KV_DTYPES and value_cache.dtype not in FP8_KV_DTYPES:
        check_same_dtype(**{q_name: query, "key_cache": key_cache, "value_cache": value_cache})
    check_same_device(**{q_name: query, "key_cache": key_cache, "value_cache": value_cache,
                         "block_tables": block_tables, "seq_lens": seq_lens})
    if key_cache.shape != value_cache.shape:
        raise GraftInputError(
            f"{op}: key_cache and value_cache must have the same shape [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = query.shape[0] if num_seqs is None else num_seqs
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim:
        raise GraftInputError(f"{op}: head_dim of {q_name} ({head_dim}) and the caches ({cache_head_dim}) differ")
    if block_size < 1:
        raise GraftInputError(f"{op}: block_size (key_cache.shape[1]) must be >= 1")
    _check_heads(op, q_name, num_heads, num_kv_heads)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise GraftInputError(
            f"{op}: block_tables has {block_tables.shape[0]} rows and seq_lens {seq_lens.shape[0]} entries; "
            f"both must equal num_seqs={num_seqs}"
        )


def _check_paged_values(op, key_cache, block_tables, seq_lens, bounds) -> None:
    """seq_lens (whose ``(min, max)`` is ``bounds``) within the table's capacity; the table
    entries they use name blocks of the caches."""
    block_size, num_blocks = key_cache.shape[1], key_cache.shape[0]
    lo, hi = bounds
    capacity = block_tables.shape[1] * block_size
    if lo < 0 or hi > capacity:
        raise GraftInputError(
            f"{op}: seq_lens must lie in [0, max_blocks_per_seq * block_size = {capacity}], got min {lo}, max {hi}"
        )
    if not hi:
        return  # no sequence uses a block
    # The common case in one pass: every entry of the table, used or not, names a block.
    # Only otherwise are the entries the sequences use told apart (stale or padding ones may be anything).
    if values_in_range(block_tables, 0, num_blocks):
        return
    used = torch.arange(block_tables.shape[1], device=seq_lens.device)[None, :] < (
        (seq_lens.long() + block_size - 1) // block_size
    )[:, None]
    num_blocks = key_cache.shape[0]
    bad = block_tables[used & ((block_tables < 0) | (block_tables >= num_blocks))]
    if bad.numel():
        raise GraftInputError(
            f"{op}: block_tables entries within seq_lens must lie in [0, num_blocks = {num_blocks}), "
            f"got {int(bad[0])} ({bad.numel()} such entries)"
        )


def validate_prefill_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                           causal=False, softmax_scale=None):
    # Fast path (value checks off, as on GPUs by default); the full checks below name any problem.
    if (isinstance(q, torch.Tensor) and isinstance(key_cache, torch.Tensor)
            and isinstance(value_cache, torch.Tensor) and isinstance(block_tables, torch.Tensor)
            and isinstance(cu_seqlens_q, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
            and q.dtype in _FLOAT_SET and key_cache.dtype == q.dtype and value_cache.dtype == q.dtype
            and block_tables.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
            and seq_lens.dtype == torch.int32 and q.ndim == 3 and key_cache.ndim == 4 and block_tables.ndim == 2
            and cu_seqlens_q.ndim == 1 and seq_lens.ndim == 1 and key_cache.shape == value_cache.shape
            and q.shape[2] == key_cache.shape[3] and key_cache.shape[1] >= 1 and key_cache.shape[2]
            and not q.shape[1] % key_cache.shape[2] and cu_seqlens_q.shape[0] >= 1
            and block_tables.shape[0] == cu_seqlens_q.shape[0] - 1 and seq_lens.shape[0] == block_tables.shape[0]
            and type(max_seqlen_q) is int and max_seqlen_q >= 0 and type(causal) is bool
            and (softmax_scale is None or type(softmax_scale) is float)
            and key_cache.device == q.device and value_cache.device == q.device
            and block_tables.device == q.device and cu_seqlens_q.device == q.device and seq_lens.device == q.device
            and not checks_values_on(seq_lens)):
        return
    op = "attention.prefill_paged"
    check_tensor(f"{op}: cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1)
    if cu_seqlens_q.shape[0] < 1:
        raise GraftInputError(f"{op}: cu_seqlens_q must have batch+1 >= 1 entries, got 0")
    num_seqs = cu_seqlens_q.shape[0] - 1
    _check_paged_metadata(op, "q", q, key_cache, value_cache, block_tables, seq_lens, num_seqs)
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    max_q = _as_int("max_seqlen_q", max_seqlen_q, op)
    if not isinstance(causal, bool):
        raise GraftInputError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    _check_scale(op, softmax_scale)
    check_prefill_paged_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens, max_q)


def check_prefill_paged_values(q, key_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q):
    """attention.prefill_paged's checks of values (``OpSpec.check_values``): max_seqlen_q
    (which changes from call to call), and the cu_seqlens, seq_lens and table where values
    may be read."""
    op = "attention.prefill_paged"
    if max_seqlen_q < 0:
        raise GraftInputError(f"{op}: max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if not can_read_values(cu_seqlens_q):
        return
    _, _, _, longest_q = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, exact_total=True)
    if seq_lens.shape[0]:
        bounds = readable_bounds(seq_lens)
        if bounds is None:  # not plain: read once, compared in Python
            lens = seq_lens.tolist()
            bounds = min(lens), max(lens)
        _check_paged_values(op, key_cache, block_tables, seq_lens, bounds)
        if bounds[0] >= longest_q:
            return  # no context is shorter than the longest query run: every sequence fits
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        for b, (start, end, seq_len) in enumerate(zip(cu, cu[1:], lens)):
            if end - start > seq_len:
                raise GraftInputError(
                    f"{op}: sequence {b} has {end - start} query tokens but seq_lens[{b}] = {seq_len}; "
                    "the queries are the last tokens of the context, so seq_len >= seqlen_q"
                )


# --------------------------------------------------------------------------- ops and entry points

OPS = [
    OpSpec(
        name="attention.prefill",
        family="attention",
        signature=(
            "prefill(q[Tq,H,D], k[Tk,KVH,D], v[Tk,KVH,D], cu_seqlens_q[B+1] int32, cu_seqlens_k[B+1] int32, "
            "max_seqlen_q: int, max_seqlen_k: int, causal: bool = False, softmax_scale: float | None = None) "
            "-> [Tq,H,D]"
        ),
        reference=prefill_reference,
        description="flash-attention forward over packed variable-length sequences (causal bottom-right, GQA)",
        validate=validate_prefill,
        check_values=check_prefill_values,
        dtypes=FLOAT_DTYPES,
        grad_inputs=(0, 1, 2),
    ),
    OpSpec(
        name="attention.prefill_paged",
        family="attention",
        signature=(
            "prefill_paged(q[Tq,H,D], key_cache[NB,BS,KVH,D], value_cache[NB,BS,KVH,D], block_tables[B,MB] int32, "
            "cu_seqlens_q[B+1] int32, seq_lens[B] int32, max_seqlen_q: int, causal: bool = False, "
            "softmax_scale: float | None = None) -> [Tq,H,D]"
        ),
        reference=prefill_paged_reference,
        description="prefill attention reading cached context from a paged KV cache (vLLM layout, causal "
                    "bottom-right, GQA; forward only)",
        validate=validate_prefill_paged,
        check_values=check_prefill_paged_values,
        dtypes=FLOAT_DTYPES,
    ),
    OpSpec(
        name="attention.decode_paged",
        family="attention",
        signature=(
            "decode_paged(query[N,H,D], key_cache[NB,BS,KVH,D], value_cache[NB,BS,KVH,D], "
            "block_tables[N,MB] int32, seq_lens[N] int32, softmax_scale: float | None = None, "
            "num_splits: int = 0, k_scale: float | Tensor[1] | None = None, v_scale: ... = None) -> [N,H,D] "
            "(caches fp8 e4m3fn/e5m2 with k_scale/v_scale, or query's dtype)"
        ),
        reference=decode_paged_reference,
        description="single-token decode attention over a paged KV cache (vLLM layout, GQA, split-K, fp8 KV option)",
        validate=validate_decode_paged,
        check_values=check_decode_paged_values,
        dtypes=FLOAT_DTYPES,
    ),
]


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softmax_scale=None):
    """Varlen flash-attention forward; see the module docstring for the layout."""
    return call(
        "attention.prefill", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale,
    )


def prefill_padded(q, k, v, causal=False, softmax_scale=None):
    """Equal-length batch layout: q [B, Sq, H, D], k/v [B, Sk, KVH, D] -> [B, Sq, H, D].

    A thin view over the varlen op (no copies when the inputs are contiguous).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(f"attention.prefill_padded: {name}", t, ndim=4)
    if k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2]:
        raise GraftInputError(
            f"attention.prefill_padded: batch/sequence dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    batch, sq = q.shape[:2]
    sk = k.shape[1]
    cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (batch + 1) * sk, sk, dtype=torch.int32, device=q.device)
    out = prefill(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, sq, sk, causal, softmax_scale)
    return out.view(q.shape)


def prefill_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, causal=False,
                  softmax_scale=None):
    """Prefill attention over a paged KV cache (context + this step's tokens); see the module docstring."""
    return call(
        "attention.prefill_paged", q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
        causal=causal, softmax_scale=softmax_scale,
    )


def decode_paged(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                 k_scale=None, v_scale=None):
    """Paged-KV decode attention; see the module docstring for the layout (and the fp8 KV cache)."""
    if k_scale is None and v_scale is None:  # the kwargs every backend took before the fp8 option
        return call(
            "attention.decode_paged", query, key_cache, value_cache, block_tables, seq_lens,
            softmax_scale=softmax_scale, num_splits=num_splits,
        )
    return call(
        "attention.decode_paged", query, key_cache, value_cache, block_tables, seq_lens,
        softmax_scale=softmax_scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
    )


# --------------------------------------------------------------------------- cases


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def make_prefill_inputs(seqlens_q, seqlens_k, num_heads, num_kv_heads, head_dim, causal, device, dtype, gen):
    """Packed inputs for the given per-sequence lengths (deterministic in ``gen``)."""
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q = _randn((total_q, num_heads, head_dim), dtype, device, gen)
    k = _randn((total_k, num_kv_heads, head_dim), dtype, device, gen)
    v = _randn((total_k, num_kv_heads, head_dim), dtype, device, gen)
    cu_q = torch.tensor([0] + list(_cumsum(seqlens_q)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(_cumsum(seqlens_k)), dtype=torch.int32, device=device)
    args = (q, k, v, cu_q, cu_k, max(seqlens_q, default=0), max(seqlens_k, default=0))
    return args, {"causal": causal}


def make_decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, device, dtype, gen, num_splits=0,
                       spare_blocks=3, kv_dtype=None):
    """A paged cache with every sequence's blocks scattered at random physical positions;
    ``kv_dtype`` (fp8): caches quantised per tensor, scales as one-element fp32 tensors."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(max(blocks_per_seq, default=0), 1)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    key_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), dtype, device, gen)
    value_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), dtype, device, gen)
    perm = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at arbitrary (valid) blocks: kernels must not read them.
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    query = _randn((len(seq_lens), num_heads, head_dim), dtype, device, gen)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    args = (query, key_cache, value_cache, block_tables.to(device), lens.to(device))
    if kv_dtype is None:
        return args, {"num_splits": num_splits}
    from graft import quant

    k_q, k_scale = quant.quantize_fp8_per_tensor(key_cache.float(), kv_dtype)
    v_q, v_scale = quant.quantize_fp8_per_tensor(value_cache.float(), kv_dtype)
    args = (query, k_q, v_q) + args[3:]
    return args, {"num_splits": num_splits, "k_scale": k_scale.reshape(1), "v_scale": v_scale.reshape(1)}


def make_prefill_paged_inputs(seqlens_q, context_lens, num_heads, num_kv_heads, head_dim, block_size, causal, device,
                              dtype, gen, spare_blocks=3):
    """Queries for the last ``seqlens_q[b]`` tokens of contexts of ``seqlens_q[b] + context_lens[b]``
    tokens, held in a paged cache whose blocks are scattered at random (deterministic in ``gen``)."""
    seq_lens = [q + c for q, c in zip(seqlens_q, context_lens)]
    (_, key_cache, value_cache, block_tables, lens), _ = make_decode_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, device, dtype, gen, spare_blocks=spare_blocks)
    q = _randn((sum(seqlens_q), num_heads, head_dim), dtype, device, gen)
    cu_q = torch.tensor([0] + list(_cumsum(seqlens_q)), dtype=torch.int32, device=device)
    args = (q, key_cache, value_cache, block_tables, cu_q, lens, max(seqlens_q, default=0))
    return args, {"causal": causal}


def _cumsum(values):
    total = 0
    for x in values:
        total += x
        yield total


def _prefill_flops(args, kwargs):
    q, _, _, cu_q, cu_k = args[:5]
    num_heads, head_dim = q.shape[1], q.shape[2]
    sq = torch.diff(cu_q).tolist()
    sk = torch.diff(cu_k).tolist()
    pairs = 0
    for a, b in zip(sq, sk):
        if kwargs.get("causal"):
            # visible keys of row i: clamp(i + b - a + 1, 0, b)
            pairs += sum(min(max(i + b - a + 1, 0), b) for i in range(a))
        else:
            pairs += a * b
    return 4.0 * pairs * num_heads * head_dim  # QK^T and PV, 2 flops per MAC


def _decode_flops(args, kwargs):
    query, _, _, _, seq_lens = args
    return 4.0 * float(seq_lens.sum()) * query.shape[1] * query.shape[2]


def _prefill_reduction(args, kwargs):
    return max(args[6], args[0].shape[-1])  # softmax/PV sum over keys, QK^T over head_dim


def _decode_reduction(args, kwargs):
    return max(int(args[4].max()) if args[4].numel() else 0, args[0].shape[-1])


def _prefill_paged_flops(args, kwargs):
    q, _, _, _, cu_q, seq_lens = args[:6]
    return _prefill_flops((q, None, None, cu_q, _cumsum0_tensor(seq_lens)), kwargs)


def _cumsum0_tensor(lengths):
    return torch.tensor([0] + list(_cumsum(lengths.tolist())), dtype=torch.int32)


def _prefill_paged_reduction(args, kwargs):
    seq_lens = args[5]
    return max(int(seq_lens.max()) if seq_lens.numel() else 0, args[0].shape[-1])


def _prefill_paged_case(name, seqlens_q, context_lens, heads, kv_heads, head_dim, block_size, causal,
                        tags=frozenset({"quick"})):
    return OpCase(
        op="attention.prefill_paged",
        name=name,
        make_inputs=lambda device, dtype, gen: make_prefill_paged_inputs(
            seqlens_q, context_lens, heads, kv_heads, head_dim, block_size, causal, device, dtype, gen
        ),
        tags=tags,
        flops=_prefill_paged_flops,
        reduction=_prefill_paged_reduction,
    )


def _prefill_case(name, seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, tags=frozenset({"quick"})):
    return OpCase(
        op="attention.prefill",
        name=name,
        make_inputs=lambda device, dtype, gen: make_prefill_inputs(
            seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, device, dtype, gen
        ),
        tags=tags,
        flops=_prefill_flops,
        reduction=_prefill_reduction,
    )


def _decode_case(name, seq_lens, heads, kv_heads, head_dim, block_size, num_splits=0, tags=frozenset({"quick"}),
                 kv_dtype=None):
    return OpCase(
        op="attention.decode_paged",
        name=name,
        make_inputs=lambda device, dtype, gen: make_decode_inputs(
            seq_lens, heads, kv_heads, head_dim, block_size, device, dtype, gen, num_splits, kv_dtype=kv_dtype
        ),
        tags=tags,
        flops=_decode_flops,
        reduction=_decode_reduction,
    )


_GPU = frozenset({"gpu"})
CASES = [
    _prefill_case("b3_ragged_h4_kv2_d64_causal", [1, 33, 7], [1, 33, 7], 4, 2, 64, True),
    _prefill_case("b3_ragged_h2_kv2_d128", [17, 5, 40], [17, 5, 40], 2, 2, 128, False),
    _prefill_case("b2_q_lt_k_mqa_d64_causal", [5, 1], [37, 20], 4, 1, 64, True),
    _prefill_case("b3_empty_seq_h2_d64_causal", [9, 0, 4], [9, 0, 4], 2, 1, 64, True),
    _decode_case("n4_odd_lens_h4_kv2_d64_bs16", [1, 17, 32, 45], 4, 2, 64, 16),
    _decode_case("n3_zero_len_h4_kv1_d128_bs8_split3", [0, 9, 70], 4, 1, 128, 8, num_splits=3),
    # Paged prefill: block sizes that do not divide the lengths, zero context, an empty
    # query, an empty batch; the first is the smallest (the fuzz module starts from it).
    _prefill_paged_case("b2_ctx_h2_kv1_d64_bs5_causal", [3, 6], [7, 0], 2, 1, 64, 5, True),
    _prefill_paged_case("b3_ctx_h4_kv2_d64_bs16_causal", [1, 7, 20], [0, 33, 5], 4, 2, 64, 16, True),
    _prefill_paged_case("b4_odd_empty_q_h4_kv1_d128_bs8_causal", [3, 0, 11, 1], [17, 4, 2, 60], 4, 1, 128, 8, True),
    _prefill_paged_case("b2_zero_ctx_h2_kv2_d64_bs16_causal", [9, 17], [0, 0], 2, 2, 64, 16, True),
    _prefill_paged_case("b2_ctx_h4_kv2_d64_bs16", [5, 12], [30, 3], 4, 2, 64, 16, False),
    _prefill_paged_case("b0_empty_batch_h2_kv1_d64_bs16", [], [], 2, 1, 64, 16, True),
    _decode_case("n3_fp8_e4m3_kv_h4_kv2_d64_bs16", [5, 40, 17], 4, 2, 64, 16, kv_dtype=torch.float8_e4m3fn),
    _decode_case("n2_fp8_e5m2_kv_h8_kv2_d128_bs8_split2", [33, 9], 8, 2, 128, 8, num_splits=2,
                 kv_dtype=torch.float8_e5m2),
    _prefill_case("b8_s2048_h32_kv8_d128_causal", [2048] * 8, [2048] * 8, 32, 8, 128, True, _GPU),
    _prefill_case("b8_s2048_h32_kv8_d128", [2048] * 8, [2048] * 8, 32, 8, 128, False, _GPU),
    _prefill_case("b4_ragged_h32_kv8_d64_causal", [4000, 1000, 3000, 129], [4000, 1000, 3000, 129], 32, 8, 64, True,
                  _GPU),
    # Chunked prefill / prefix caching: 512 new tokens after 1.5k-3.5k cached ones.
    _prefill_paged_case("b8_q512_ctx3584_h32_kv8_d128_bs16_causal", [512] * 8, [3584] * 8, 32, 8, 128, 16, True, _GPU),
    _prefill_paged_case("b4_ragged_ctx_h32_kv8_d128_bs16_causal", [2048, 512, 1000, 64], [0, 1536, 3000, 8000], 32, 8,
                        128, 16, True, _GPU),
    _decode_case("n64_ctx4096_h32_kv8_d128_bs16", [4096] * 64, 32, 8, 128, 16, tags=_GPU),
    _decode_case("n8_ctx32768_h32_kv8_d128_bs16", [32768] * 8, 32, 8, 128, 16, tags=_GPU),
    _decode_case("n64_ctx4096_h32_kv8_d128_bs16_fp8kv", [4096] * 64, 32, 8, 128, 16, tags=_GPU,
                 kv_dtype=torch.float8_e4m3fn),
]
