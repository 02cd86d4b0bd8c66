"""A toy op family used by the core tests: an adapter defined in-process, so the plugin
host, registry and selection are exercised without depending on real kernels."""
from __future__ import annotations

import torch

from graft.hookspecs import hookimpl
from graft.registry import Implementation, OpSpec


def scale_reference(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


TOY_OP = OpSpec(
    name="fused.toy_scale",
    family="fused",
    signature="(Tensor x, float factor) -> Tensor",
    reference=scale_reference,
    description="x * factor (test op)",
)


class ToyAdapter:
    """Registers two fake 'optimized' backends for the toy op: 'fast' (fp32 only, rejects
    odd sizes per call) and 'vendor' (CPU, any dtype). Each tags its output so tests can
    see which one ran."""

    def __init__(self, define_op: bool = True):
        self.define_op = define_op
        self.calls = []

    @hookimpl
    def graft_adapter_info(self):
        return {"description": "toy adapter for tests"}

    @hookimpl
    def graft_register_ops(self, registry):
        if self.define_op:
            registry.add_op(TOY_OP)

    @hookimpl
    def graft_register_kernels(self, registry):
        def fast(x, factor):
            self.calls.append("fast")
            return x * factor

        def vendor(x, factor):
            self.calls.append("vendor")
            return x * factor

        registry.add_impl(
            Implementation(
                op="fused.toy_scale",
                backend="fast",
                fn=fast,
                dtypes=frozenset({torch.float32}),
                check=lambda x, factor: None if x.numel() % 2 == 0 else f"odd numel {x.numel()}",
            )
        )
        registry.add_impl(Implementation(op="fused.toy_scale", backend="vendor", fn=vendor, devices=frozenset({"cpu"})))


class ReferenceOnly:
    """Gives the toy op its torch reference, like graft's torch adapter does for real ops."""

    @hookimpl(trylast=True)
    def graft_register_kernels(self, registry):
        from graft.registry import reference_impl

        registry.add_impl(reference_impl(TOY_OP, provider=""))
