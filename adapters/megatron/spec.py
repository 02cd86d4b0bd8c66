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
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from graft.adapters.megatron.modules import (
    GraftColumnParallelLinear,
    GraftDotProductAttention,
    GraftRMSNorm,
    GraftRowParallelLinear,
    GraftSequentialMLP,
)


class GraftSpecProvider(BackendSpecProvider):
    """Megatron ``BackendSpecProvider`` whose submodules run on graft ops.

    LayerNorm (as opposed to RMSNorm) has no graft op: ``layer_norm(rms_norm=False)``
    returns Megatron's local choice. ``moe_use_grouped_gemm`` is served by graft's
    fused-experts module as well (graft's grouped GEMM *is* the fused-experts kernel).
    """

    def __init__(self):
        self._local = LocalSpecProvider()

    def column_parallel_linear(self) -> type:
        return GraftColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return GraftRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if rms_norm:
            return GraftRMSNorm
        return self._local.layer_norm(rms_norm=False, for_qk=for_qk)

    def core_attention(self) -> type:
        return GraftDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool
                            ) -> Tuple[type, Optional[MLPSubmodules]]:
        return GraftSequentialMLP, MLPSubmodules(linear_fc1=GraftColumnParallelLinear,
                                                 linear_fc2=GraftRowParallelLinear)

    def activation_func(self) -> type:
        return None


def get_gpt_layer_graft_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             qk_layernorm: bool = False, normalization: str = "RMSNorm") -> ModuleSpec:
    """A GPT ``TransformerLayer`` spec whose norms, linears, core attention and MoE experts
    run on graft ops; same structure (and parameter names) as ``get_gpt_layer_local_spec``.

    Use it wherever Megatron takes a layer spec (``GPTModel(transformer_layer_spec=...)``,
    ``build_module(spec, config=...)``). The config must match: ``normalization="RMSNorm"``
    for graft's norm. With ``GRAFT_MEGATRON=0`` (or ``GRAFT_DISABLE=all``) this returns
    Megatron's own ``get_gpt_layer_local_spec`` with the same arguments, so the calling code
    needs no change to run without graft. Raises a clear error on an unsupported
    megatron-core version.
    """
    from graft.adapters.megatron.activation import enabled

    if not enabled():
        return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                        qk_layernorm=qk_layernorm, normalization=normalization)
    backend = GraftSpecProvider()
    rms = normalization == "RMSNorm"
    layer_norm = backend.layer_norm(rms_norm=rms, for_qk=False)
    qk_norm = backend.layer_norm(rms_norm=rms, for_qk=True)
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
