"""Per-op dispatch cost: ``graft.call(op, ...)`` (validation, selection, the selected
implementation) against calling that selected implementation directly, on each op's
first quick case, with value checks off (the GPU default) and, beside it, on (the CPU
default). Collectives need a process group: their rows are measured on every
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
        call = graft.dispatch.call
        # The dispatch cost proper is measured with value checks off, as they are by default
        # on GPUs (each is a device sync there); what the CPU's default value checks add
        # (reading cu_seqlens, expert ids... once per call) is reported beside it.
        with graft.override_config(GRAFT_CHECK_VALUES="0"):
            times = interleaved({"graft": lambda: call(op, *args, **kwargs),
                                 "direct": lambda: direct(*args, **kwargs)}, rounds=rounds, inner=inner, sync=sync)
        with graft.override_config(GRAFT_CHECK_VALUES="1"):
            checked = interleaved({"graft": lambda: call(op, *args, **kwargs),
                                   "direct": lambda: direct(*args, **kwargs)}, rounds=rounds, inner=inner, sync=sync)
        row = {"op": op, "case": case.name, "dtype": str(dtype).replace("torch.", ""), "backend": impl.backend,
               "direct_us": times["direct"] * 1e6, "graft_us": times["graft"] * 1e6,
               # per-round differences (each pair back to back), median
               "overhead_us": times.difference("graft", "direct") * 1e6,
               "overhead_with_value_checks_us": checked.difference("graft", "direct") * 1e6}
        progress(f"  {op:32s} {row['backend']:7s} direct {row['direct_us']:9.1f} us  graft {row['graft_us']:9.1f} us"
                 f"  overhead {row['overhead_us']:+7.1f} us  (with CPU value checks "
                 f"{row['overhead_with_value_checks_us']:+7.1f} us)")
        rows.append(row)
    return rows
