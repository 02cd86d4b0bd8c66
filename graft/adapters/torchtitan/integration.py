"""The TorchTitan integration's switch and version gate.

TorchTitan builds a model from a config tree and lets "model converters" rewrite that tree
before the build (its Float8/MX quantization uses the same hook). Graft's converter,
``graft.adapters.torchtitan.GraftConverter``, is named in the job's converter list; it swaps
module configs for graft's subclasses (same parameters, names, sharding declarations), so no
TorchTitan file is edited. ``GRAFT_TORCHTITAN=0`` makes the converter leave the tree as it
is; :func:`activate` only checks that the installed TorchTitan is supported.
"""
from __future__ import annotations

from graft.integration import CallCounter, FrameworkIntegration

ENV_VAR = "GRAFT_TORCHTITAN"  # declared in graft.settings
SUPPORTED = ">=0.3,<0.4"

# The parts graft serves in TorchTitan, and the graft ops each needs: the converter swaps
# ``norm``, ``swiglu``, ``attention`` (varlen) and, opt-in, ``moe``; ``optimizer`` is
# GraftOptimizersContainer (named in the job config).
NEEDS = {"norm": ("fused.rms_norm",), "swiglu": ("fused.silu_and_mul",), "moe": ("moe.fused_experts",),
         "attention": ("attention.prefill",), "optimizer": ("fused.adam_step",)}
MODEL_PARTS = ("norm", "swiglu", "attention", "moe")

# What stays TorchTitan's own code in every model (and why): reported once by the converter.
NOT_SERVED = {
    "flex_attention": ("TorchTitan's flex and SDPA inner attention stay its own (flex block masks have no graft "
                       "op counterpart; build the model with attn_backend='varlen' for attention.prefill)"),
    "router": "TorchTitan's MoE router (top-k, expert bias, load balancing) stays its own",
    "output_loss": ("TorchTitan's lm_head + (chunked) cross-entropy stay its own: not converted (lm_head is its "
                    "own FSDP2 unit, and ChunkedLossWrapper drives its forward per chunk with FSDP reshard and "
                    "gradient-sync control; loss.fused_linear_cross_entropy needs the unsharded weight outside it)"),
    "optimizer": ("the model converter does not swap the optimizer: name graft.adapters.torchtitan.optimizer."
                  "GraftOptimizersContainer.Config (or graft_adamw()) as the job's optimizer for fused.adam_step"),
}


def integration() -> FrameworkIntegration:
    return FrameworkIntegration(
        name="torchtitan",
        distribution="torchtitan",
        supported=SUPPORTED,
        activate=activate,
        description=("model converter: RMSNorm -> fused.rms_norm, SwiGLU activation -> fused.silu_and_mul, "
                     "varlen attention -> attention.prefill; GraftOptimizersContainer: Adam/AdamW step -> "
                     "fused.adam_step"),
        env_var=ENV_VAR,
        needs=dict(NEEDS),
        # the converter swaps a part only where graft is known faster (GRAFT_* variable or a
        # tuning table entry): `graft info` says the same of the parts it would leave
        measured=True,
        notes=["opt-in per job: add graft.adapters.torchtitan.GraftConverter.Config() to the model's converters"]
        + [f"{part}: {why}" for part, why in NOT_SERVED.items()],
    )


def enabled() -> bool:
    """False when switched off; raises a clear error on a missing/unsupported TorchTitan."""
    return integration().opt_in_enabled("graft's TorchTitan integration is off (%s): the model config is left as it is")


def activate() -> bool:
    """Check the switch and the version (TorchTitan needs no patching: the converter is named in its config)."""
    return enabled()


# What graft served inside TorchTitan modules: "<op>:<backend>" and "fallback.<module>".
counter = CallCounter("torchtitan")
