"""HIP/CUDA kernel for moe.topk_routing (csrc/moe_kernels.cu): one block per token,
softmax or sigmoid in fp32, then top-k by repeated block arg-max."""
from __future__ import annotations

import torch

from graft.custom_ops import define_op
from graft.kernels.hip._build import load_extension
from graft.kernels.hip._common import hip_implementation

MAX_EXPERTS = 8192  # one token's scores and taken flags sit in shared memory (5 bytes each)


def _topk(logits: torch.Tensor, top_k: int, renormalize: bool, sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(load_extension().topk_routing(logits, top_k, renormalize, sigmoid))


def _topk_fake(logits: torch.Tensor, top_k: int, renormalize: bool, sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.shape[0]
    return (logits.new_empty((tokens, top_k), dtype=torch.float32),
            logits.new_empty((tokens, top_k), dtype=torch.int32))


topk_routing_op = define_op("moe_topk_routing_hip", _topk, fake=_topk_fake, device_types="cuda")


def topk_routing(router_logits, top_k, renormalize=True, scoring="softmax"):
    return topk_routing_op(router_logits, int(top_k), bool(renormalize), scoring == "sigmoid")


def check_topk(router_logits, top_k, renormalize=True, scoring="softmax"):
    experts = router_logits.shape[-1]
    if experts > MAX_EXPERTS:
        return f"{experts} experts > {MAX_EXPERTS} not supported by the hip routing kernel (shared-memory row)"
    return None


def register(registry) -> None:
    registry.add_impl(hip_implementation(
        "moe.topk_routing", topk_routing, topk_routing_op,
        "HIP/CUDA top-k routing: block per token, fp32 softmax/sigmoid, block arg-max per pick",
        check=check_topk, check_scalars=()))
