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

import operator

import torch

from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import (can_read_values, check_same_device, check_same_dtype, check_tensor, checks_values_on,
                                 int_steps, readable_bounds, values_in_range)
from graft.ops.attention.reference import (FP8_KV_DTYPES, decode_paged_reference, prefill_paged_reference,
                                           prefill_reference)
from graft.registry import OpSpec


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32,)


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


# The conformance cases, re-exported here (imported last: a cases module may use this module's names).
from graft.ops.attention.cases import make_prefill_inputs, make_decode_inputs, make_prefill_paged_inputs, CASES
