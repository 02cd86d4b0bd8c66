"""The torch definitions of the attention ops (the semantics every backend matches; plain fp32 math)."""
from __future__ import annotations

import math

import torch

from graft.ops._validate import acc, acc_dtype


# fp8 KV-cache formats (vLLM's "fp8"/"fp8_e4m3" and "fp8_e5m2"), dequantised with per-tensor scales.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
