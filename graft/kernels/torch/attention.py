"""graft's torch backend of the attention ops: torch's fused SDPA and batched gathers, ranked above
the references (:mod:`graft.ops.attention.reference`), which they fall back to where SDPA defines
something else."""
from __future__ import annotations

import math
from typing import Optional

import torch

from graft.custom_ops import no_double_backward
from graft.ops._validate import acc, acc_dtype
from graft.ops.attention.reference import (FP8_KV_DTYPES, _attend, _fp8_values, _probs, _scale_or_default,
                                           prefill_paged_reference, prefill_reference)


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
