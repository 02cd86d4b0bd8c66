"""graft's plugin for vLLM (entry point ``vllm`` in group ``graft.adapters``).

Its hooks come from the folder's modules (see :class:`graft.integration.FrameworkPlugin`);
loading it imports nothing of vLLM.
"""
from graft.integration import FrameworkPlugin

plugin = FrameworkPlugin(
    "graft.adapters.vllm",
    description="vLLM integration (out-of-tree CustomOps and attention backend)",
    upstream="graft.tools.patches.upstream.vllm",
)
