"""Out-of-tree replacements for vLLM's RMSNorm, SiluAndMul and RotaryEmbedding CustomOps.

Each class subclasses the in-tree op, so weights, ``__init__`` and ``forward_native``
stay vLLM's. vLLM picks ``forward_<platform>`` when the op is enabled in
``compilation_config.custom_ops`` (``forward_native`` otherwise, which torch.compile
then fuses); graft takes every platform path, so whatever vLLM runs on, the op goes
through graft's dispatch and its ``GRAFT_*`` backend selection (``GRAFT_FUSED=torch``,
``GRAFT_FUSED_RMS_NORM=triton``...). Cases graft's ops do not cover fall back to
vLLM's own ``forward_native``.
"""
from __future__ import annotations

import torch

from vllm import envs
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from graft.adapters.vllm._registration import register_oot
from graft.adapters.vllm.integration import counter


class GraftRMSNorm(RMSNorm):
    def forward_graft(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # Weightless norms, partial-variance norms and batch-invariant mode are vLLM's.
        if not self.has_weight or self.variance_size_override is not None or envs.VLLM_BATCH_INVARIANT:
            return self.forward_native(x, residual)
        return counter.run("fused.rms_norm", x, self.weight.data, self.variance_epsilon, residual)

    forward_cuda = forward_hip = forward_xpu = forward_cpu = forward_oot = forward_graft


class GraftSiluAndMul(SiluAndMul):
    def forward_graft(self, x: torch.Tensor) -> torch.Tensor:
        return counter.run("fused.silu_and_mul", x)

    forward_cuda = forward_hip = forward_xpu = forward_cpu = forward_oot = forward_graft


class GraftRotaryEmbedding(RotaryEmbedding):
    def forward_graft(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        num_tokens = positions.numel()
        if query.shape[0] != num_tokens or query.dim() not in (2, 3):
            return self.forward_native(positions, query, key)  # e.g. [batch, seq, ...] layouts
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        return counter.run(
            "fused.rotary_embedding", positions.flatten(), query, key, self.head_size, cos_sin_cache, self.is_neox_style
        )

    forward_cuda = forward_hip = forward_xpu = forward_cpu = forward_oot = forward_graft


REPLACEMENTS = {
    "rms_norm": (RMSNorm, GraftRMSNorm),
    "silu_and_mul": (SiluAndMul, GraftSiluAndMul),
    "rotary_embedding": (RotaryEmbedding, GraftRotaryEmbedding),
}


def register(parts) -> dict:
    return {part: register_oot(*REPLACEMENTS[part]) for part in REPLACEMENTS if part in parts}
