"""A vLLM worker extension that reports what graft served inside the engine.

vLLM runs the model in its engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the
default) or in worker processes, where graft's counters live. Pass this class as
``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` and read them with
:func:`engine_served_calls` (or ``llm.collective_rpc("graft_served_calls")``, one dict per
worker). In-process engines can read ``graft.served_calls("vllm")`` directly too.
No vLLM import here: vLLM imports this module by name in each worker.
"""
from __future__ import annotations

from collections import Counter

WORKER_EXTENSION = "graft.adapters.vllm.worker.GraftWorkerExtension"


class GraftWorkerExtension:
    def graft_served_calls(self) -> dict:
        """``{"<op>:<backend>": calls}`` served by graft in this worker's process."""
        from graft.integration import served_calls

        return served_calls("vllm")


def engine_served_calls(llm) -> dict:
    """What graft served in every worker of ``llm`` (a ``vllm.LLM`` built with this extension), summed."""
    total: Counter = Counter()
    for calls in llm.collective_rpc("graft_served_calls"):
        total.update(calls)
    return dict(sorted(total.items()))
