"""HIP/CUDA kernel for attention.decode_paged (csrc/attention_kernels.cu): one block per
(sequence, head) over vLLM's paged KV layout, warp reductions and an online softmax."""
from __future__ import annotations

import math

import torch

from graft.custom_ops import define_op
from graft.kernels.hip._build import load_extension
from graft.kernels.hip._common import hip_implementation

MAX_HEAD_DIM = 256  # kDecodeMaxHeadDim in csrc/graft_kernels.h: per-lane accumulators are sized for it


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return load_extension().decode_paged(query, key_cache, value_cache, block_tables, seq_lens, scale)


def _decode_fake(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


decode_paged_op = define_op("attention_decode_paged_hip", _decode, fake=_decode_fake, device_types="cuda")


def decode_paged(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                 k_scale=None, v_scale=None):
    # num_splits only partitions work; this kernel always runs one block per (sequence, head).
    # k_scale/v_scale come only with fp8 caches, which check_decode declines.
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return decode_paged_op(query, key_cache, value_cache, block_tables, seq_lens, scale)


def check_decode(query, key_cache, value_cache, block_tables, seq_lens, softmax_scale=None, num_splits=0,
                 k_scale=None, v_scale=None):
    if (key_cache is not None and key_cache.dtype != query.dtype) or k_scale is not None or v_scale is not None:
        return f"{key_cache.dtype} (fp8) KV cache not supported by the hip decode kernel"
    head_dim = query.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM} not supported by the hip decode kernel"
    return None


def register(registry) -> None:
    registry.add_impl(hip_implementation(
        "attention.decode_paged", decode_paged, decode_paged_op,
        "HIP/CUDA paged-KV decode: block per (seq, head), warp-shuffle dot products, online softmax",
        check=check_decode, check_scalars=("k_scale", "v_scale")))
