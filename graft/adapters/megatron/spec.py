"""graft's ModuleSpec provider for Megatron-core, and GPT layer specs built from it.

Megatron builds a transformer layer from a ``ModuleSpec`` tree; its spec helpers ask a
``BackendSpecProvider`` which class to use for each submodule (linear layers, norm, core
attention, grouped experts). :class:`GraftSpecProvider` answers with graft-backed
modules, and :func:`get_gpt_layer_graft_spec` assembles the same tree as Megatron's
``get_gpt_layer_local_spec`` (self-attention + MLP or MoE, pre-norm) from it.
"""
from __future__ import annotations

from typing import Optional, Tuple

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from graft.adapters.megatron.modules import (
    NORMALIZATIONS,
    GraftColumnParallelLinear,
    GraftDotProductAttention,
    GraftNorm,
    GraftRowParallelLinear,
    GraftSequentialMLP,
)


class GraftSpecProvider(BackendSpecProvider):
    """Megatron ``BackendSpecProvider`` whose submodules run on graft ops.

    Norms are :class:`GraftNorm`: RMSNorm (``fused.rms_norm``) or LayerNorm
    (``fused.layer_norm``) as ``config.normalization`` says, like Megatron's local
    ``WrappedTorchNorm``; other normalizations are refused at build time. ``moe_use_grouped_gemm`` is served by graft's
    fused-experts module as well (graft's grouped GEMM *is* the fused-experts kernel).

    ``off``: parts (``norm``, ``linear``, ``attention``, ``moe``) whose graft ops cannot serve
    here (``FrameworkIntegration.unavailable_parts``); Megatron's local modules serve those.
    """

    def __init__(self, off=()):
        self.off = frozenset(off)
        self._local = LocalSpecProvider()

    def column_parallel_linear(self) -> type:
        return self._local.column_parallel_linear() if "linear" in self.off else GraftColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return self._local.row_parallel_linear() if "linear" in self.off else GraftRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return self._local.layer_norm(rms_norm, for_qk) if "norm" in self.off else GraftNorm

    def core_attention(self) -> type:
        return self._local.core_attention() if "attention" in self.off else GraftDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool
                            ) -> Tuple[type, Optional[MLPSubmodules]]:
        fc1, fc2 = self.column_parallel_linear(), self.row_parallel_linear()
        if "moe" in self.off:
            return SequentialMLP, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
        return GraftSequentialMLP, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)

    def activation_func(self) -> type | None:
        return None


def get_gpt_layer_graft_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             qk_layernorm: bool = False, normalization: Optional[str] = None) -> ModuleSpec:
    """A GPT ``TransformerLayer`` spec whose norms, linears, core attention and MoE experts
    run on graft ops; same structure (and parameter names) as ``get_gpt_layer_local_spec``.

    Use it wherever Megatron takes a layer spec (``GPTModel(transformer_layer_spec=...)``,
    ``build_module(spec, config=...)``). Norms follow ``config.normalization`` (RMSNorm or
    LayerNorm; anything else is refused when the layer is built); ``normalization``, when
    given, must be one of those and agree with the config (a mismatch is an error at build
    time, not a silently different norm). With ``GRAFT_MEGATRON=0`` (or ``GRAFT_DISABLE=all``) this returns
    Megatron's own ``get_gpt_layer_local_spec`` with the same arguments, so the calling code
    needs no change to run without graft. Raises a clear error on an unsupported
    megatron-core version.
    """
    from graft.adapters.megatron.integration import enabled

    if not enabled():
        return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                        qk_layernorm=qk_layernorm, normalization=normalization)
    if normalization is not None and normalization not in NORMALIZATIONS:
        raise ValueError(f"get_gpt_layer_graft_spec: normalization must be one of {NORMALIZATIONS} or None "
                         f"(follow config.normalization), got {normalization!r}")
    from graft.adapters.megatron.integration import integration
    from graft.integration import log_part_off

    off = integration().unavailable_parts()
    for part, why in off.items():
        log_part_off("megatron", part, why)
    backend = GraftSpecProvider(off)
    if "norm" in off:  # Megatron's own norm, chosen as its local spec chooses it
        rms = normalization == "RMSNorm"
        layer_norm = ModuleSpec(module=backend.layer_norm(rms_norm=rms, for_qk=False))
        qk_norm = ModuleSpec(module=backend.layer_norm(rms_norm=rms, for_qk=True))
    else:
        layer_norm = ModuleSpec(module=backend.layer_norm(for_qk=False), params={"expected": normalization})
        qk_norm = ModuleSpec(module=backend.layer_norm(for_qk=True), params={"expected": normalization})
    mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts,
                                          moe_grouped_gemm=moe_grouped_gemm)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=layer_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm if qk_layernorm else IdentityOp,
                    k_layernorm=qk_norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=layer_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )
