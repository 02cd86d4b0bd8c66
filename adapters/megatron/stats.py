"""What graft served inside Megatron-core modules (no Megatron import here).

Keys are ``"<op>:<backend>"`` for graft op calls (``"gemm.linear:triton"``) and
``"fallback.<module>"`` for calls a graft module handed back to Megatron's own code
(each reason logged once on ``graft.integration.megatron``).
"""
from __future__ import annotations

from graft.integration import CallCounter

counter = CallCounter("megatron")
calls = counter.calls
count = counter.count
fallback = counter.fallback
reset = counter.reset
