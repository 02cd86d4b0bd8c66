"""What graft served inside DeepSpeed, per entry point (no DeepSpeed import here).

``graft.adapters.deepspeed.calls`` is read by tests and by anyone checking that graft is
really in the loop: e.g. ``calls["collectives.all_reduce"]`` routed all-reduces,
``calls["fused.adam_step"]`` tensors updated by graft's Adam, ``calls["fallback.*"]``
calls graft left to torch.distributed (each reason logged once on
``graft.integration.deepspeed``).
"""
from __future__ import annotations

from graft.integration import CallCounter

counter = CallCounter("deepspeed")
calls = counter.calls
count = counter.count
fallback = counter.fallback
reset = counter.reset


def served(op: str, backend: str, n: int = 1) -> None:
    """Count ``n`` calls of ``op`` that graft served, under ``op`` and ``"<op>:<backend>"``."""
    count(op, n)
    counter.served(op, backend, n)
