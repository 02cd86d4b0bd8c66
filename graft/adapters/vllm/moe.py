"""vLLM's unquantized fused-MoE method served by graft's ``moe.fused_experts``.

``UnquantizedFusedMoEMethod`` is a vLLM CustomOp; the graft subclass is registered
out-of-tree and takes every platform's ``forward_*``. vLLM 0.33 calls it from
``RoutedExperts.forward_modular`` with the router's ``topk_weights``/``topk_ids``;
graft replaces only the expert computation (vLLM's modular kernel = prepare, experts,
finalize), so it serves the plain case:

* weights in vLLM's checkpoint layout (``w13 = [gate; up]`` of ``[E, 2I, H]``, ``w2`` of
  ``[E, H, I]``), SiLU gating without SwiGLU clamp/alpha/beta;
* no token dispatch across ranks (no DP/EP all-to-all, no naive DP all-gather) and no
  expert map; no expert biases; router weights applied to the output.

vLLM keeps everything else. Backends that repack the weights for their own kernel
(FlashInfer, AITER) stay vLLM's too, except vLLM's CPU experts: their repacking needs
vLLM's compiled ``_C`` extension and happens in ``process_weights_after_loading``, so
for a layer graft can serve, graft keeps the checkpoint layout there and then serves
every call of that layer itself.

Shared experts: vLLM runs them in the runner unless its kernel overlaps them
internally; in that case graft starts them the same way vLLM's kernel does.

A call graft leaves to vLLM's ``forward_native`` is counted as ``fallback.fused_moe`` in
:data:`graft.adapters.vllm.integration.counter.calls`, its reason logged once (``graft.integration.vllm``).
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.utils import is_weights_pre_processed

from graft.adapters.vllm._registration import register_oot
from graft.adapters.vllm.integration import counter

# vLLM backends that leave w13/w2 in the checkpoint layout graft's op expects.
STANDARD_LAYOUT_BACKENDS = (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.OOT)
# Backends whose repacking graft skips for the layers it serves (see the module doc).
LAYOUT_KEPT_BY_GRAFT_BACKENDS = (UnquantizedMoeBackend.CPU,)


class GraftUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    # True once process_weights_after_loading kept the checkpoint layout on a backend whose
    # own kernel expects repacked weights: from then on only graft can compute this layer.
    graft_owns_layout = False

    def graft_layer_reason(self, layer) -> str | None:
        """Why graft cannot serve this layer, whatever the call (None: it can)."""
        parallel = self.moe.moe_parallel_config
        if parallel.use_all2all_kernels or parallel.use_passthrough_all2all or parallel.dp_size > 1:
            return "tokens are dispatched across ranks (DP/EP)"
        if layer.activation != MoEActivation.SILU:
            return f"activation {layer.activation}"
        if any(getattr(layer, name, None) is not None for name in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
            return "SwiGLU clamp/alpha/beta"
        if layer.expert_map is not None:
            return "expert parallelism (expert_map)"
        if self.moe.has_bias:
            return "expert biases"
        if layer.apply_router_weight_on_input:
            return "router weights applied on the input"
        return None

    def graft_reason(self, layer) -> str | None:
        """Why graft cannot serve this layer now (None: it can)."""
        if self.unquantized_backend not in STANDARD_LAYOUT_BACKENDS and not self.graft_owns_layout:
            return f"vLLM MoE backend {self.unquantized_backend.value} repacks the weights"
        return self.graft_layer_reason(layer)

    def process_weights_after_loading(self, layer) -> None:
        if (
            self.unquantized_backend in LAYOUT_KEPT_BY_GRAFT_BACKENDS
            and not is_weights_pre_processed()
            and self.graft_layer_reason(layer) is None
        ):
            # vLLM's kernel object is still built: the runner asks it about routing formats.
            self._init_moe_kernel(layer)
            self.graft_owns_layout = True
            return
        super().process_weights_after_loading(layer)

    def forward_graft(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        reason = self.graft_reason(layer)
        if reason is not None:
            if self.graft_owns_layout:  # vLLM's kernel would read graft's (unpacked) layout
                raise RuntimeError(f"graft kept this MoE layer's weights unpacked but cannot serve it: {reason}")
            counter.fallback("fused_moe", reason)
            return self.forward_native(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        if shared_experts is not None:
            # Runs them only where vLLM expects the kernel to (the runner does it otherwise).
            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        return counter.run(
            "moe.fused_experts", x, layer.w13_weight, layer.w2_weight, topk_weights.float(),
            topk_ids.to(torch.int32), "silu",
        )

    forward_cuda = forward_hip = forward_xpu = forward_cpu = forward_oot = forward_graft


def register(parts=("moe",)) -> dict:
    return {"moe": register_oot(UnquantizedFusedMoEMethod, GraftUnquantizedFusedMoEMethod)}
