"""graft inside vLLM: out-of-tree CustomOps, linear/MoE methods and an attention backend.

vLLM calls :func:`graft.adapters.vllm.plugin.register` at start-up in every process
(the ``vllm.general_plugins`` entry point), so ``pip install graft`` alone activates it.
Modules that import vLLM (``custom_ops``, ``linear``, ``moe``, ``attention``) are
imported only from ``register()``, never at graft import time: graft must stay
importable without vLLM.
"""
