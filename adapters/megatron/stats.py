"""Counts of what graft served inside Megatron-core modules (no Megatron import here).

Keys are ``"<op>:<backend>"`` for graft op calls (``"gemm.linear:triton"``) and
``"fallback.<module>"`` for calls a graft module handed back to Megatron's own code.
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
