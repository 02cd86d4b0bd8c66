"""graft's plugin for TorchTitan (entry point ``torchtitan`` in group ``graft.adapters``).

Its hooks come from the folder's modules (see :class:`graft.integration.FrameworkPlugin`);
loading it imports nothing of TorchTitan.
"""
from graft.integration import FrameworkPlugin

plugin = FrameworkPlugin(
    "graft.adapters.torchtitan",
    description=("TorchTitan integration: model converter (RMSNorm, SwiGLU feed-forward activation, varlen "
                 "attention, opt-in MoE experts on graft ops), optimizer container (Adam/AdamW step on "
                 "fused.adam_step)"),
)
