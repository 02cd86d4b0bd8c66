"""CPU kernel for attention.decode_paged (csrc/decode_paged.cpp): one task per (sequence, kv
head) on torch's intra-op threads, the pages read where they lie (no gather into a batch),
the query heads of a kv head together; fp8 caches read as bytes through a 256-entry table
of their values times the scale."""
from __future__ import annotations

import math
from typing import Optional

import torch

from graft.custom_ops import define_op
from graft.kernels.cpp._build import load_library
from graft.kernels.cpp._common import cpp_implementation
from graft.ops.attention.reference import FP8_KV_DTYPES, _fp8_values


class _Kernel:
    op = None  # torch.ops.graft_cpp.decode_paged.default once the library is loaded


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, key_values: Optional[torch.Tensor],
            value_values: Optional[torch.Tensor]) -> torch.Tensor:
    kernel = _Kernel.op
    if kernel is None:
        kernel = _Kernel.op = load_library().decode_paged.default
    return kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, key_values, value_values)


def _decode_fake(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, key_values: Optional[torch.Tensor],
                 value_values: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


decode_paged_op = define_op("attention_decode_paged_cpp", _decode, fake=_decode_fake, device_types="cpu")


def decode_paged(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                 k_scale=None, v_scale=None):
    # num_splits only partitions work; this kernel always runs one task per (sequence, kv head).
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if key_cache.dtype in FP8_KV_DTYPES:
        # The codes' values times the scale: a tensor scale stays on the device (no host read).
        key_values = _fp8_values(key_cache.dtype, query.device) * k_scale
        value_values = _fp8_values(value_cache.dtype, query.device) * v_scale
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    else:
        key_values = value_values = None
    return decode_paged_op(query, key_cache, value_cache, block_tables, seq_lens, scale, key_values, value_values)


def check_decode(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                 k_scale=None, v_scale=None):
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        return "the cpp decode kernel reads each cache row contiguously (stride(3) == 1)"
    if key_cache.dtype != value_cache.dtype:
        return f"key_cache {key_cache.dtype} and value_cache {value_cache.dtype} differ"
    return None


def register(registry) -> None:
    registry.add_impl(cpp_implementation(
        "attention.decode_paged", decode_paged, decode_paged_op,
        "CPU C++ paged-KV decode: task per (seq, kv head) on torch's threads, pages read in place, fp8 by "
        "table lookup",
        check=check_decode, check_scalars=()))
