"""Gather the conformance cases: each op family module's ``CASES`` plus what adapters
contribute through the ``graft_conformance_cases`` hook, filtered by op/family/tags."""
from __future__ import annotations

from graft.cases import OpCase
from graft.errors import GraftConfigError

# Families whose ops need several processes (torch.distributed ranks): the single-process
# runner reports their cases as skipped with this pointer instead of dropping them.
MULTI_PROCESS_FAMILIES = {"collectives": "needs multi-process; see python -m graft.tools.bench.collectives_sweep"}


def builtin_cases() -> list:
    from graft.ops import family_modules

    cases: list = []
    for module in family_modules():
        cases.extend(getattr(module, "CASES", ()))
    return cases


def adapter_cases(host, registry) -> list:
    return [c for c in host.collect("graft_conformance_cases", registry=registry) if isinstance(c, OpCase)]


def all_cases(host, registry) -> list:
    """Every case whose op is registered, built-in first; duplicates (same op and name) dropped."""
    seen, cases = set(), []
    for case in builtin_cases() + adapter_cases(host, registry):
        if case.op not in registry.ops or case.id in seen:
            continue
        seen.add(case.id)
        cases.append(case)
    return cases


def select_cases(cases, registry, ops=None, families=None, tags=None) -> list:
    """Filter by op names, families and tags (a case matches if it has any wanted tag).

    Unknown op or family names are usage errors (GraftConfigError), not empty runs.
    """
    if ops:
        unknown = [o for o in ops if o not in registry.ops]
        if unknown:
            raise GraftConfigError(f"unknown op(s) {', '.join(unknown)}; known ops: {', '.join(sorted(registry.ops))}")
    if families:
        known = set(registry.families().values())
        unknown = [f for f in families if f not in known]
        if unknown:
            raise GraftConfigError(f"unknown famil(ies) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    out = []
    for case in cases:
        if ops and case.op not in ops:
            continue
        if families and registry.ops[case.op].family not in families:
            continue
        if tags and not (set(case.tags) & set(tags)):
            continue
        out.append(case)
    return out
