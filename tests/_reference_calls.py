"""Fixture counting calls of every op's torch reference (import it into a test module)."""
from __future__ import annotations

import pytest


@pytest.fixture
def reference_calls(fresh_graft, monkeypatch):
    """Counts calls of every op's torch reference: the OpSpec's and the module attribute
    (graft.ops.<family>.<name>_reference) that adapters pass around."""
    import graft.ops as ops_pkg
    from graft.plugins import get_registry

    calls: dict = {}
    registry = get_registry()
    wrapped = {}
    for spec in registry.ops.values():
        original = spec.reference

        def counting(*args, __op=spec.name, __fn=original, **kwargs):
            calls[__op] = calls.get(__op, 0) + 1
            return __fn(*args, **kwargs)

        wrapped[original] = counting
        object.__setattr__(spec, "reference", counting)
    for family in ("attention", "fused", "gemm", "moe"):
        module = getattr(ops_pkg, family)
        for name in dir(module):
            value = getattr(module, name)
            if name.endswith("_reference") and value in wrapped:
                monkeypatch.setattr(module, name, wrapped[value])
    yield calls
    for original, counting in wrapped.items():
        for spec in registry.ops.values():
            if spec.reference is counting:
                object.__setattr__(spec, "reference", original)
