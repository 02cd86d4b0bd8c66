"""vLLM's unquantized fused-MoE method served by graft's ``moe.fused_experts``.

``UnquantizedFusedMoEMethod`` is a vLLM CustomOp; the graft subclass is registered
out-of-tree and takes every platform's ``forward_*``. graft serves the plain case:
weights in vLLM's checkpoint layout (``w13 = [gate; up]`` of ``[E, 2I, H]``, ``w2`` of
``[E, H, I]``), SiLU gating, no expert-parallel map, no biases, no shared experts
fused in, router weights applied to the output. vLLM keeps everything else, and
backends that repack the weights (FlashInfer, AITER, vLLM's CPU kernels), where
graft would read the wrong layout.
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from graft.adapters.vllm._registration import register_oot
from graft.ops import moe

# vLLM backends that leave w13/w2 in the checkpoint layout graft's op expects.
STANDARD_LAYOUT_BACKENDS = (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.OOT)


class GraftUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    def graft_reason(self, layer, shared_experts) -> str | None:
        """Why graft cannot serve this layer (None: it can)."""
        if self.unquantized_backend not in STANDARD_LAYOUT_BACKENDS:
            return f"vLLM MoE backend {self.unquantized_backend.value} repacks the weights"
        if layer.activation != MoEActivation.SILU:
            return f"activation {layer.activation}"
        if layer.expert_map is not None:
            return "expert parallelism (expert_map)"
        if self.moe.has_bias:
            return "expert biases"
        if layer.apply_router_weight_on_input:
            return "router weights applied on the input"
        if shared_experts is not None:
            return "shared experts fused into the routed kernel"
        return None

    def forward_graft(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        if self.graft_reason(layer, shared_experts) is not None:
            return self.forward_native(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return moe.fused_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights.float(), topk_ids.to(torch.int32), "silu"
        )

    forward_cuda = forward_hip = forward_xpu = forward_cpu = forward_oot = forward_graft


def register(parts=("moe",)) -> dict:
    return {"moe": register_oot(UnquantizedFusedMoEMethod, GraftUnquantizedFusedMoEMethod)}
