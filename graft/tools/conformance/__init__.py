"""The conformance suite: every registered implementation against its baselines.

``graft conformance`` (see :mod:`graft.tools.conformance.cli`) and the pytest plugin
(:mod:`graft.tools.conformance.pytest_plugin`) run the same cases: each op family's ``CASES``
plus adapters' ``graft_conformance_cases``. Numerics are checked against the op's torch
reference with per-dtype tolerances (:mod:`graft.tools.conformance.tolerances`); throughput is
the ratio against the reference and the framework's own kernel where installed
(:mod:`graft.baselines`), measured in the same run.

Nothing is imported eagerly: the pytest plugin is loaded by every pytest run where graft
is installed, and must not pull in torch for people who do not ask for the suite.
"""
_LAZY = {"Options": "graft.tools.conformance.runner", "Report": "graft.tools.conformance.runner",
         "Runner": "graft.tools.conformance.runner", "run_conformance": "graft.tools.conformance.runner"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graft.tools.conformance' has no attribute {name!r}")
