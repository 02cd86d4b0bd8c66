"""What graft served inside vLLM, and what it handed back to vLLM's own code (no vLLM import here).

Keys are ``"<op>:<backend>"`` for calls graft served (the implementation that actually
ran, after any fallback between graft's backends) and ``"fallback.<layer>"`` for calls a
graft layer or method left to vLLM's own implementation; each fallback reason is logged
once at INFO on ``graft.integration.vllm``. ``graft.served_calls("vllm")`` returns the
served part; ``python -m graft.adapters.vllm`` prints it.
"""
from __future__ import annotations

from graft import dispatch
from graft.integration import CallCounter

counter = CallCounter("vllm")
calls = counter.calls
count = counter.count
served = counter.served
served_calls = counter.served_calls
fallback = counter.fallback
reset = counter.reset


def run(op: str, *args):
    """Run a graft op for vLLM and count which backend served it."""
    out, impl = dispatch.run(op, *args)
    counter.served(op, impl.backend)
    return out
