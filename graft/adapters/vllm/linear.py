"""Unquantized linear layers of vLLM served by graft's ``gemm.linear``.

vLLM's linear layers are ``PluggableLayer`` classes that pick a quant method at
construction (``UnquantizedLinearMethod`` when the model is not quantized). The
graft subclasses below are registered out-of-tree for the common layer classes; after
vLLM's own ``__init__`` they swap the unquantized method for
:class:`GraftUnquantizedLinearMethod`, which only changes ``apply``. Quantized
layers keep their quant method untouched. With ``VLLM_BATCH_INVARIANT=1`` vLLM's own GEMM
runs (counted as ``fallback.linear`` in :data:`graft.adapters.vllm.integration.counter.calls`, the
reason logged once).
"""
from __future__ import annotations

import torch

from vllm import envs
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)

from graft.adapters.vllm._registration import register_oot
from graft.adapters.vllm.integration import counter


class GraftUnquantizedLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized method with the GEMM computed by graft (weight stays [out, in])."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # vLLM's CPU platform repacks the weight for its own GEMM and drops layer.weight;
        # graft reads layer.weight, so keep it as loaded there. Other platforms: vLLM's.
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            super().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if envs.VLLM_BATCH_INVARIANT:
            counter.fallback("linear", "VLLM_BATCH_INVARIANT=1")
            return super().apply(layer, x, bias)
        return counter.run("gemm.linear", x, layer.weight, bias)


class _GraftLinearMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.quant_method) is UnquantizedLinearMethod:
            graft_method = GraftUnquantizedLinearMethod.__new__(GraftUnquantizedLinearMethod)
            graft_method.__dict__.update(self.quant_method.__dict__)  # keeps vLLM's GEMM choice for fallbacks
            self.quant_method = graft_method


class GraftReplicatedLinear(_GraftLinearMixin, ReplicatedLinear):
    pass


class GraftColumnParallelLinear(_GraftLinearMixin, ColumnParallelLinear):
    pass


class GraftMergedColumnParallelLinear(_GraftLinearMixin, MergedColumnParallelLinear):
    pass


class GraftQKVParallelLinear(_GraftLinearMixin, QKVParallelLinear):
    pass


class GraftRowParallelLinear(_GraftLinearMixin, RowParallelLinear):
    pass


REPLACEMENTS = (
    (ReplicatedLinear, GraftReplicatedLinear),
    (ColumnParallelLinear, GraftColumnParallelLinear),
    (MergedColumnParallelLinear, GraftMergedColumnParallelLinear),
    (QKVParallelLinear, GraftQKVParallelLinear),
    (RowParallelLinear, GraftRowParallelLinear),
)


def register(parts=("linear",)) -> dict:
    results = {in_tree.__name__: register_oot(in_tree, graft_cls) for in_tree, graft_cls in REPLACEMENTS}
    failed = {k: v for k, v in results.items() if v != "registered"}
    return {"linear": "registered" if not failed else "; ".join(f"{k}: {v}" for k, v in failed.items())}
