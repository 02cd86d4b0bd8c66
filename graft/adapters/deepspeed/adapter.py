"""graft's plugin for DeepSpeed (entry point ``deepspeed`` in group ``graft.adapters``).

Its hooks come from the folder's modules (see :class:`graft.integration.FrameworkPlugin`);
loading it imports nothing of DeepSpeed.
"""
from graft.integration import FrameworkPlugin

plugin = FrameworkPlugin(
    "graft.adapters.deepspeed",
    description="DeepSpeed integration: accelerator wrapper (FusedAdam via fused.adam_step) and deepspeed.comm routing to graft collectives",
    upstream="graft.tools.patches.upstream.deepspeed",
)
