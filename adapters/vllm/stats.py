"""What graft handed back to vLLM's own code (no vLLM import here).

Keys are ``"fallback.<layer>"`` for calls a graft layer or method left to vLLM's own
implementation; each reason is logged once at INFO on ``graft.integration.vllm``.
"""
from __future__ import annotations

from graft.integration import CallCounter

counter = CallCounter("vllm")
calls = counter.calls
count = counter.count
fallback = counter.fallback
reset = counter.reset
