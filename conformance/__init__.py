"""The conformance suite: every registered implementation against its baselines.

``graft conformance`` (see :mod:`graft.conformance.cli`) and the pytest plugin
(:mod:`graft.conformance.pytest_plugin`) run the same cases: each op family's ``CASES``
plus adapters' ``graft_conformance_cases``. Numerics are checked against the op's torch
reference with per-dtype tolerances (:mod:`graft.conformance.tolerances`); throughput is
the ratio against the reference and the framework's own kernel where installed
(:mod:`graft.conformance.baselines`), measured in the same run.
"""
from graft.conformance.runner import Options, Report, run_conformance

__all__ = ["Options", "Report", "run_conformance"]
