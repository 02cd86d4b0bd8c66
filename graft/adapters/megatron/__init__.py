"""graft inside Megatron-core: a ``ModuleSpec`` provider whose norms, linear layers, core
attention and MoE experts run on graft ops.

    from graft.adapters.megatron import get_gpt_layer_graft_spec
    layer_spec = get_gpt_layer_graft_spec(num_experts=None, qk_layernorm=False)
    model = GPTModel(config, transformer_layer_spec=layer_spec, ...)

``GraftGPTModel`` (a ``GPTModel``) can also run the output layer and loss as one
``loss.fused_linear_cross_entropy`` call (``fused_loss=True`` or ``GRAFT_MEGATRON_FUSED_LOSS=1``).
``GRAFT_MEGATRON=0`` makes ``get_gpt_layer_graft_spec`` return Megatron's own local spec.
Importing this package does not import Megatron; the spec helpers do, on first use.
"""
from graft.adapters.megatron.integration import ENV_VAR, SUPPORTED, activate, enabled, integration
from graft.adapters.megatron.integration import counter


def get_gpt_layer_graft_spec(*args, **kwargs):
    from graft.adapters.megatron.spec import get_gpt_layer_graft_spec as build

    return build(*args, **kwargs)


def __getattr__(name):
    if name == "GraftGPTModel":
        from graft.adapters.megatron.output_loss import GraftGPTModel

        return GraftGPTModel
    if name == "GraftSpecProvider":
        from graft.adapters.megatron.spec import GraftSpecProvider

        return GraftSpecProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENV_VAR", "SUPPORTED", "activate", "enabled", "integration", "calls", "counter", "get_gpt_layer_graft_spec",
           "GraftSpecProvider", "GraftGPTModel"]

calls = counter.calls  # what graft served here (see integration.counter)
