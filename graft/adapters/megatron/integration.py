"""The Megatron-core integration's switch and version gate.

Megatron-core has no plugin hook: a model's layers come from the ``ModuleSpec`` the
training code passes in. So graft is used by passing graft's spec
(``graft.adapters.megatron.get_gpt_layer_graft_spec()``); ``GRAFT_MEGATRON=0`` makes that
function return Megatron's own local spec instead, and :func:`activate` only checks that
the installed megatron-core is supported.
"""
from __future__ import annotations

from graft.integration import CallCounter, FrameworkIntegration

# Declared in graft.settings.
ENV_VAR = "GRAFT_MEGATRON"
FUSED_LOSS_ENV_VAR = "GRAFT_MEGATRON_FUSED_LOSS"
SUPPORTED = ">=0.16,<0.17"


def integration() -> FrameworkIntegration:
    return FrameworkIntegration(
        name="megatron",
        distribution="megatron-core",
        supported=SUPPORTED,
        activate=activate,
        description="ModuleSpec provider: RMSNorm -> fused.rms_norm, linears -> gemm.linear, core attention -> "
        "attention.prefill, MoE experts -> moe.fused_experts",
        env_var=ENV_VAR,
        needs={"norm": ("fused.rms_norm", "fused.layer_norm"), "linear": ("gemm.linear",),
               "attention": ("attention.prefill",), "moe": ("moe.fused_experts",)},
        notes=["opt-in per model: build layers with graft.adapters.megatron.get_gpt_layer_graft_spec()"],
    )


def enabled() -> bool:
    """False when switched off by env var; raises a clear error on a missing/unsupported megatron-core."""
    return integration().opt_in_enabled("graft's Megatron-core integration is off (%s): using Megatron's local spec")


def activate() -> bool:
    """Check the switch and the version (Megatron needs no patching: graft's spec is passed in)."""
    return enabled()


# What graft served inside Megatron-core modules: keys "<op>:<backend>" ("gemm.linear:triton")
# and "fallback.<module>" for calls handed back to Megatron's own code (each reason logged
# once on graft.integration.megatron).
counter = CallCounter("megatron")
