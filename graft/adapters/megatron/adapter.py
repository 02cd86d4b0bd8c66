"""graft's plugin for Megatron-core (entry point ``megatron`` in group ``graft.adapters``).

Its hooks come from the folder's modules (see :class:`graft.integration.FrameworkPlugin`);
loading it imports nothing of Megatron-core.
"""
from graft.integration import FrameworkPlugin

plugin = FrameworkPlugin(
    "graft.adapters.megatron",
    description="Megatron-core integration: ModuleSpec provider (RMSNorm, linears, core attention, MoE experts on graft ops)",
    upstream="graft.tools.patches.upstream.megatron",
)
