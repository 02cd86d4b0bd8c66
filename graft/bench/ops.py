"""Per-op dispatch cost: ``graft.call(op, ...)`` (validation, selection, the selected
implementation) against calling that selected implementation directly, on each op's
first quick case. Collectives need a process group: their rows are measured on every
rank of one (``collectives=True``, from :mod:`graft.bench.distributed`)."""
from __future__ import annotations

import torch

from graft.bench.timing import interleaved


def first_quick_cases() -> dict:
    """op name -> its first ``quick`` case (op modules' CASES order)."""
    from graft.ops import family_modules

    cases = {}
    for module in family_modules():
        for case in getattr(module, "CASES", ()):
            if "quick" in case.tags and case.op not in cases:
                cases[case.op] = case
    return cases


def measure(rounds: int, inner: int, progress=print, only=None, collectives=False, sync=None) -> list:
    import graft

    registry = graft.get_registry()
    cases = first_quick_cases()
    rows = []
    for op in sorted(registry.ops):
        if (registry.ops[op].family == "collectives") != collectives or (only and op not in only):
            continue
        case = cases.get(op)
        if case is None:
            rows.append({"op": op, "error": "no quick case"})
            continue
        dtype = torch.float32 if torch.float32 in case.dtypes else case.dtypes[0]
        args, kwargs = case.inputs("cpu", dtype)
        impl = graft.select(op, *args, **kwargs)
        direct = impl.fn
        times = interleaved({"graft": lambda: graft.call(op, *args, **kwargs),
                             "direct": lambda: direct(*args, **kwargs)}, rounds=rounds, inner=inner, sync=sync)
        row = {"op": op, "case": case.name, "dtype": str(dtype).replace("torch.", ""), "backend": impl.backend,
               "direct_us": times["direct"] * 1e6, "graft_us": times["graft"] * 1e6,
               # per-round differences (each pair back to back), median
               "overhead_us": times.difference("graft", "direct") * 1e6}
        progress(f"  {op:32s} {row['backend']:7s} direct {row['direct_us']:9.1f} us  graft {row['graft_us']:9.1f} us"
                 f"  overhead {row['overhead_us']:+7.1f} us")
        rows.append(row)
    return rows
