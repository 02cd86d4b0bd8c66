"""Counts of what graft served inside DeepSpeed, per entry point (no DeepSpeed import here).

``graft.adapters.deepspeed.calls`` is read by tests and by anyone checking that graft is
really in the loop: e.g. ``calls["collectives.all_reduce"]`` routed all-reduces,
``calls["fused.adam_step"]`` tensors updated by graft's Adam, ``calls["fallback.*"]``
calls graft left to torch.distributed.
"""
from __future__ import annotations

import threading
from collections import Counter

calls: Counter = Counter()
_lock = threading.Lock()


def count(key: str, n: int = 1) -> None:
    with _lock:
        calls[key] += n


def reset() -> None:
    with _lock:
        calls.clear()
