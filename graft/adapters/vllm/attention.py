"""The ``GRAFT`` attention backend for vLLM 0.33's v1 engine, computed by graft's ops.

* decode requests (one query token) -> ``attention.decode_paged`` on the paged cache;
* prefill / chunked-prefill requests -> ``attention.prefill`` (varlen, causal
  bottom-right) on the fresh keys/values when no request has cached context, else
  ``attention.prefill_paged``, which reads the context (cached tokens and this step's,
  already written) through the block table: no gather of the pages. Where that op has no
  kernel for the call here (its torch reference would serve) while ``attention.prefill``
  has one, the context is gathered into a contiguous K/V for ``attention.prefill`` instead,
  counted as ``fallback.attention.prefill_gather`` with the reason logged once.

KV cache: vLLM 0.33 hands each layer a logical ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` tensor (keys then values in the last dim, any physical stride order);
``kv_cache.transpose(1, 2).split(head_size, -1)`` gives the two
``[num_blocks, block_size, num_kv_heads, head_size]`` views graft's decode op takes
without copies. The cache write (a scatter by ``slot_mapping``) is plain torch, without
host syncs.

fp8 KV cache (``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``): vLLM allocates the
cache as bytes; keys and values are written divided by the layer's per-tensor scales
(``layer._k_scale`` / ``_v_scale``, device tensors: no host read) and saturated to the fp8
range, decode reads the pages through ``attention.decode_paged``'s fp8 path, and prefills
attend to the same quantised values vLLM's own backends attend to: this step's keys and
values quantised and dequantised when no request has cached context, else the context
gathered out of the pages and dequantised for ``attention.prefill`` (``attention.prefill_paged``
reads no fp8 cache: counted as ``fallback.attention.prefill_gather``, the reason logged once).

Scope (refused in ``__init__`` or through the ``supports_*`` hooks, so vLLM chooses
another backend or says why): decoder self-attention only; no ALiBi, sliding window,
logits soft-cap, attention sinks, or fp8 KV formats other than e4m3fn and e5m2 (ROCm's
e4m3fnuz, ``fp8_inc``, ``fp8_ds_mla``). CUDA graphs: declared for
uniform single-token decode batches (``UNIFORM_SINGLE_TOKEN_DECODE``), where the builder
reads no device tensor on the host and the KV write has no boolean mask; batches with
prefills run eagerly (their lengths are read on the host once per step).

Select it with ``--attention-backend GRAFT`` (``AttentionConfig(backend="GRAFT")``), or
let ``GRAFT_VLLM_ATTENTION_OVERRIDE=TRITON_ATTN`` route a built-in backend to it. vLLM's
CPU platform always picks ``CPU_ATTN`` (it ignores ``--attention-backend``), so there the
override ``GRAFT_VLLM_ATTENTION_OVERRIDE=CPU_ATTN`` is the way in.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from graft import config, dispatch, settings
from graft.adapters.vllm.integration import counter
from graft.platform import dtype_name

log = logging.getLogger("graft.vllm")

BACKEND_NAME = "GRAFT"


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
    """Logical per-layer KV cache shape vLLM 0.33 passes to ``forward``."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int, dtype: torch.dtype | None = None):
    """Per-layer cache -> (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_size] (views),
    viewed as ``dtype`` if given (an fp8 cache is allocated as bytes)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    if dtype is not None and dtype != kv_cache.dtype:
        key_cache, value_cache = key_cache.view(dtype), value_cache.view(dtype)
    return key_cache, value_cache


# vLLM's kv_cache_dtype names of the fp8 formats graft's ops read.
FP8_KV_CACHE = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the cache holds for ``x``: ``x / scale``, saturated to the fp8 range (a plain cast
    would turn an out-of-range value into NaN)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


@dataclass
class GraftAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context incl. this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    causal: bool
    # Requests [0, num_decodes) have one query token each (vLLM reorders them first).
    num_decodes: int
    num_decode_tokens: int
    # The remaining (prefill) requests, offsets relative to their first token.
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_cu_seqlens_k: torch.Tensor | None = None
    prefill_max_seqlen_q: int = 0
    prefill_max_seqlen_k: int = 0
    # When any prefill request has cached context (chunked prefill, prefix caching): its
    # context lengths (incl. this step's tokens) and block-table rows; None: use the fresh k/v.
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    prefill_seq_lens_cpu: torch.Tensor | None = None  # host copy, for the gather fallback only
    _gather_index: tuple | None = None

    def gather_index(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) of every context token of the prefill requests, in order: the gather
        fallback's index, built once per step (the metadata is shared by every layer)."""
        if self._gather_index is None:
            assert self.prefill_seq_lens_cpu is not None and self.prefill_block_table is not None  # context present
            p_seq = self.prefill_seq_lens_cpu.long()
            block_table = self.prefill_block_table
            dev = block_table.device
            # Token j of prefill request r sits in block block_table[r, j // bs] at j % bs.
            req = torch.repeat_interleave(torch.arange(p_seq.numel()), p_seq)
            pos = torch.arange(int(p_seq.sum())) - torch.repeat_interleave(_cumsum0(p_seq)[:-1].long(), p_seq)
            req, pos = req.to(dev), pos.to(dev)
            self._gather_index = (block_table[req, pos // block_size].long(), pos % block_size)
        return self._gather_index


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths, 0)
    return out


class GraftAttentionMetadataBuilder(AttentionMetadataBuilder[GraftAttentionMetadata]):
    # CUDA graphs for batches of single-token decodes: build() reads nothing on the host for
    # them and forward() / the KV write take fixed shapes with no host sync.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # Single-token requests first, so decodes form one leading slice of the batch.
        self._init_reorder_batch_threshold(1)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> GraftAttentionMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        # Query lengths come from vLLM's host copy: splitting decodes from prefills reads no device tensor.
        query_lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[:num_reqs].to(torch.int32)
        is_decode = query_lens == 1
        num_decodes = num_reqs if bool(is_decode.all()) else int((~is_decode).int().argmax())
        meta = GraftAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens[:num_reqs].to(torch.int32),
            block_table=m.block_table_tensor[:num_reqs].to(torch.int32),
            slot_mapping=m.slot_mapping,
            causal=True,  # only prefills read it (decodes see their whole context)
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
        )
        if num_decodes == num_reqs:
            # A uniform decode batch (what vLLM captures in CUDA graphs): device tensors are only
            # sliced here, never read on the host, so a replay sees the values of its own step.
            return meta
        # Prefills: their lengths are read on the host once per step (not captured in graphs).
        seq_lens = m.seq_lens[:num_reqs].to("cpu", torch.int32)
        meta.causal = bool(m.causal) if not isinstance(m.causal, torch.Tensor) else bool(m.causal.all())
        p_query = query_lens[num_decodes:]
        p_seq = seq_lens[num_decodes:]
        dev = m.query_start_loc.device
        meta.prefill_cu_seqlens_q = _cumsum0(p_query).to(dev)
        meta.prefill_cu_seqlens_k = _cumsum0(p_seq).to(dev)
        meta.prefill_max_seqlen_q = int(p_query.max())
        meta.prefill_max_seqlen_k = int(p_seq.max())
        if bool((p_seq != p_query).any()):
            meta.prefill_seq_lens = meta.seq_lens[num_decodes:]
            meta.prefill_block_table = meta.block_table[num_decodes:]
            meta.prefill_seq_lens_cpu = p_seq
        return meta


_FP8_GATHER = ("attention.prefill_paged reads no fp8 KV cache: the context is gathered out of the pages and "
               "dequantised for attention.prefill")

# Per (device, dtype, heads, head size, config generation): None when attention.prefill_paged
# serves prefills with context, else why the context is gathered for attention.prefill.
_gather_reasons: dict = {}


def _gather_reason(q, key, value, key_cache, value_cache, m, scale) -> str | None:
    """Whether graft's paged prefill has a kernel for this call, decided once per configuration.

    Its torch reference gathers per sequence in Python; where attention.prefill has a
    kernel here and the paged op has none (a backend without one, an unsupported head
    size), gathering once and running that kernel is faster."""
    key_ = (q.device, q.dtype, q.shape[1], q.shape[2], config.current().generation)
    if key_ in _gather_reasons:
        return _gather_reasons[key_]
    paged = dispatch.select("attention.prefill_paged", q, key_cache, value_cache, m.prefill_block_table,
                            m.prefill_cu_seqlens_q, m.prefill_seq_lens, m.prefill_max_seqlen_q, m.causal, scale)
    reason = None
    if paged.backend == config.REFERENCE_BACKEND:
        flat = dispatch.select("attention.prefill", q, key, value, m.prefill_cu_seqlens_q, m.prefill_cu_seqlens_k,
                               m.prefill_max_seqlen_q, m.prefill_max_seqlen_k, m.causal, scale)
        if flat.backend != config.REFERENCE_BACKEND:
            reason = (f"attention.prefill_paged has no kernel for {dtype_name(q.dtype)} head size "
                      f"{q.shape[2]} on {q.device.type} here (only its torch reference), attention.prefill runs on "
                      f"{flat.backend}: gathering the cached K/V out of the pages for it")
    _gather_reasons[key_] = reason
    return reason


def _fp8_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The torch dtype of an fp8 KV cache graft's ops read, or None (not fp8, or a format
    they do not read: ROCm's e4m3fnuz, which vLLM's "fp8" means on MI300)."""
    dtype = FP8_KV_CACHE.get(kv_cache_dtype)
    if dtype is torch.float8_e4m3fn:
        from vllm.platforms import current_platform

        if current_platform.fp8_dtype() != torch.float8_e4m3fn:
            return None
    return dtype


class GraftAttentionImpl(AttentionImpl[GraftAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported_options,
    ) -> None:
        unsupported = [
            what
            for what, present in (
                ("ALiBi", alibi_slopes is not None),
                ("sliding window", sliding_window is not None),
                ("logits soft-cap", bool(logits_soft_cap)),
                ("attention sinks", sinks is not None),
                (f"kv_cache_dtype={kv_cache_dtype}", kv_cache_dtype not in ("auto", "float16", "bfloat16")
                 and _fp8_cache_dtype(kv_cache_dtype) is None),
                (f"attn_type={attn_type}", attn_type != AttentionType.DECODER),
            )
            if present
        ]
        if unsupported:
            raise NotImplementedError(f"graft's GRAFT attention backend does not support {', '.join(unsupported)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = _fp8_cache_dtype(kv_cache_dtype)  # torch dtype of an fp8 cache, else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Write this step's keys/values into their slots; slot -1 marks a padding token.

        No boolean mask (its nonzero() is a host sync, and CUDA graphs cannot capture it):
        padding rows are redirected to repeat the first real token's write (same slot, same
        values, so the duplicate is harmless), or, when every token is padding, to rewrite
        slot 0 with what it already holds.
        """
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)  # bytes, for an fp8 cache
        block_size = key_cache.shape[1]
        n = slot_mapping.shape[0]
        if self.fp8 is not None:
            key = quantize_kv(key[:n], layer._k_scale, self.fp8).view(torch.uint8)
            value = quantize_kv(value[:n], layer._v_scale, self.fp8).view(torch.uint8)
        slots = slot_mapping.long()
        if slots.device.type == "cpu" and not torch.compiler.is_compiling() and n and bool(slots.min() >= 0):
            # The CPU (no CUDA graph to capture, reading a value is free) without padding, the
            # usual eager step: one scatter per cache, none of the padding redirection below.
            blocks, offsets = slots // block_size, slots % block_size
            key_cache.index_put_((blocks, offsets), key[:n].to(key_cache.dtype))
            value_cache.index_put_((blocks, offsets), value[:n].to(value_cache.dtype))
            return
        keep = slots >= 0
        first = keep.int().argmax().view(1)  # first real token (0 if none), found on the device
        first_slot = slots.index_select(0, first).clamp(min=0)
        first_kept = keep.index_select(0, first)[:, None, None]
        slots = torch.where(keep, slots, first_slot)
        blocks, offsets = slots // block_size, slots % block_size
        row = keep[:, None, None]
        for new, cache in ((key[:n], key_cache), (value[:n], value_cache)):
            new = new.to(cache.dtype)
            held = cache[first_slot // block_size, first_slot % block_size]  # [1, kv_heads, head_size]
            filler = torch.where(first_kept, new.index_select(0, first), held)
            cache.index_put_((blocks, offsets), torch.where(row, new, filler))

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: GraftAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("graft's GRAFT attention backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        m = attn_metadata
        out = output[: m.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size, self.fp8)
        nd = m.num_decode_tokens
        fp8 = self.fp8
        if m.num_decodes:
            scales = (0, layer._k_scale, layer._v_scale) if fp8 is not None else ()
            out[:nd] = counter.run(
                "attention.decode_paged",
                query[:nd],
                key_cache,
                value_cache,
                m.block_table[: m.num_decodes],
                m.seq_lens[: m.num_decodes],
                self.scale,
                *scales,
            )
        if m.prefill_cu_seqlens_q is not None:
            q = query[nd : m.num_actual_tokens]
            k, v = key[nd : m.num_actual_tokens], value[nd : m.num_actual_tokens]
            if m.prefill_seq_lens is not None:
                reason = _FP8_GATHER if fp8 is not None else _gather_reason(q, k, v, key_cache, value_cache, m,
                                                                            self.scale)
                if reason is None:
                    out[nd:] = counter.run(
                        "attention.prefill_paged",
                        q,
                        key_cache,
                        value_cache,
                        m.prefill_block_table,
                        m.prefill_cu_seqlens_q,
                        m.prefill_seq_lens,
                        m.prefill_max_seqlen_q,
                        m.causal,
                        self.scale,
                    )
                    return output
                counter.fallback("attention.prefill_gather", reason)
                blocks, slots = m.gather_index(key_cache.shape[1])
                if fp8 is None:
                    k, v = key_cache[blocks, slots], value_cache[blocks, slots]
                else:  # indexed as bytes: torch's CPU indexing kernels take no fp8 dtype
                    k = dequantize_kv(key_cache.view(torch.uint8)[blocks, slots].view(fp8), layer._k_scale, q.dtype)
                    v = dequantize_kv(value_cache.view(torch.uint8)[blocks, slots].view(fp8), layer._v_scale,
                                      q.dtype)
            elif fp8 is not None:  # attend to what the cache holds, as vLLM's backends do
                k = dequantize_kv(quantize_kv(k, layer._k_scale, fp8), layer._k_scale, q.dtype)
                v = dequantize_kv(quantize_kv(v, layer._v_scale, fp8), layer._v_scale, q.dtype)
            out[nd:] = counter.run(
                "attention.prefill",
                q,
                k,
                v,
                m.prefill_cu_seqlens_q,
                m.prefill_cu_seqlens_k,
                m.prefill_max_seqlen_q,
                m.prefill_max_seqlen_k,
                m.causal,
                self.scale,
            )
        return output


class GraftAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # fp8 on ROCm's e4m3fnuz platforms is refused in GraftAttentionImpl.__init__, with the reason.
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", *FP8_KV_CACHE]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[GraftAttentionImpl]:
        return GraftAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[GraftAttentionMetadataBuilder]:
        return GraftAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True  # graft's own selection decides which kernel serves the device

    get_kv_cache_shape = staticmethod(kv_cache_shape)


CLASS_PATH = f"{GraftAttentionBackend.__module__}.{GraftAttentionBackend.__qualname__}"


def register(parts=("attention",)) -> dict:
    """Register the GRAFT backend (and, if asked, serve a built-in backend name with it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME in AttentionBackendEnum.__members__:
        current = AttentionBackendEnum[BACKEND_NAME].get_path()
        status = "registered" if current == CLASS_PATH else f"skipped: GRAFT is already {current}"
    else:
        register_backend(BACKEND_NAME, CLASS_PATH)
        status = "registered"
    override = (settings.raw("GRAFT_VLLM_ATTENTION_OVERRIDE") or "").strip().upper()
    if override:
        if override not in AttentionBackendEnum.__members__:
            raise ValueError(
                f"GRAFT_VLLM_ATTENTION_OVERRIDE={override!r} is not a vLLM attention backend; "
                f"one of {', '.join(AttentionBackendEnum.__members__)}"
            )
        register_backend(AttentionBackendEnum[override], CLASS_PATH)
        status += f"; serves {override}"
    return {"attention": status}
