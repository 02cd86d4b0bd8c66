"""Hostile inputs through every op's public entry point, on every backend that runs here,
with value checks on and off.

Each op's inputs start from its quick conformance cases and are then mutated: non-contiguous
copies, index tensors holding -1 or a huge value, NaN/inf scalars, NaN/inf tensor values, a
wrong dtype, a wrong last dimension. Every outcome must be a clear GraftError (GraftInputError
for bad input) or the torch reference's result (within the conformance tolerance; NaN/inf at
the same places): never a crash, another exception, or a different number.

Each op runs in a child process, so a segfault or abort fails that test (naming the last
case started) instead of killing the run. Mutations of values run with GRAFT_CHECK_VALUES=1
and =0; the others (shapes, dtypes, strides) do not depend on value checks and run once. Collectives are fuzzed in
tests/test_collectives.py (they need a process group).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)
CASES_PER_OP = 1  # the smallest quick case: the interpreter is slow
# Quick cases fuzzed besides the smallest one: input kinds the smallest case lacks.
EXTRA_CASES = {"attention.decode_paged": ("n3_fp8_e4m3_kv_h4_kv2_d64_bs16",)}  # fp8 caches + k_scale/v_scale
TIMEOUT_S = 240


def _ops() -> list:
    from graft.ops import all_op_specs

    return sorted(s.name for s in all_op_specs() if not s.name.startswith("collectives."))


@pytest.mark.parametrize("op", _ops())
def test_hostile_inputs(op):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env.update(TRITON_INTERPRET="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, HERE, op], capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [r["case"] for r in lines if r.get("started")]
    results = [r for r in lines if "outcome" in r]
    assert proc.returncode == 0, (
        f"{op}: child died with rc {proc.returncode} during "
        f"{started[-1] if started else 'start-up'}:\n{proc.stderr[-3000:]}"
    )
    bad = [r for r in results if r["outcome"] not in ("error", "match")]
    assert results, f"{op}: no case ran\n{proc.stderr[-2000:]}"
    assert not bad, f"{op}: " + "\n".join(
        f"{r['case']}: {r['outcome']}: {r['detail']}" for r in bad)


# ------------------------------------------------------------------------------ the child


def _mutations(args, kwargs):
    """(label, args, kwargs, reads_values) variants of one valid input; ``reads_values``: the
    mutation is of values (run with value checks on and off)."""
    import torch

    yield "valid", args, kwargs, False
    items = list(enumerate(args))

    def replaced(i, value):
        new = list(args)
        new[i] = value
        return tuple(new)

    def strided(t):
        base = t.new_empty(tuple(t.shape) + (2,))
        view = base[..., 0]
        view.copy_(t)
        return view

    tensors = [(i, a) for i, a in items if isinstance(a, torch.Tensor)]
    first_float = next((i for i, a in tensors if a.dtype.is_floating_point), None)
    if any(t.numel() > 1 for _, t in tensors):
        yield "noncontiguous", tuple(strided(a) if isinstance(a, torch.Tensor) and a.numel() > 1 else a
                                     for a in args), kwargs, False
    for i, t in tensors:
        if t.numel() == 0:
            continue
        if not t.dtype.is_floating_point and t.dtype != torch.bool:
            for label, value in (("-1", -1), ("huge", min(10**6, torch.iinfo(t.dtype).max))):
                bad = t.clone()
                bad.view(-1)[0] = value
                yield f"arg{i}[0]={label}", replaced(i, bad), kwargs, True
        elif t.dtype.is_floating_point:
            # NaN/inf in the first float tensor only (each such run executes the kernel)
            # (not in fp8 tensors: Triton's interpreter emulates fp8 without NaN encodings)
            specials = (("nan", math.nan), ("inf", math.inf)) if i == first_float and t.element_size() > 1 else ()
            for label, value in specials:
                bad = t.clone()
                bad.view(-1)[t.numel() // 2] = value
                yield f"arg{i}[mid]={label}", replaced(i, bad), kwargs, False
            yield f"arg{i}.float64", replaced(i, t.double()), kwargs, False
        if t.dim() >= 1 and t.shape[-1] > 1:
            yield f"arg{i}[..., :-1]", replaced(i, t[..., :-1]), kwargs, False
    # Tensor keyword arguments (fp8 KV-cache scales): non-finite values, a wrong dtype.
    for name, t in kwargs.items():
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel():
            bad = t.clone()
            bad.view(-1)[0] = math.nan
            yield f"{name}=nan", args, {**kwargs, name: bad}, False
            yield f"{name}.float64", args, {**kwargs, name: t.double()}, False
    for i, a in items:
        if isinstance(a, float):
            for label, value in (("nan", math.nan), ("inf", math.inf), ("-1", -1.0)):
                yield f"arg{i}={label}", replaced(i, value), kwargs, False
        elif isinstance(a, int) and not isinstance(a, bool):
            yield f"arg{i}=-1", replaced(i, -1), kwargs, False
            yield f"arg{i}=huge", replaced(i, 2**40), kwargs, False


def _paged_prefill_mutations(args, kwargs):
    """attention.prefill_paged: whole block tables and lengths that are hostile, beyond the
    first-element -1/huge of the generic mutations (value mutations: checks on and off)."""
    import torch

    q, key_cache, value_cache, table, cu_q, seq_lens, max_q = args
    capacity = table.shape[1] * key_cache.shape[1]

    def with_(**changes):
        values = dict(table=table, cu_q=cu_q, seq_lens=seq_lens)
        values.update(changes)
        return (q, key_cache, value_cache, values["table"], values["cu_q"], values["seq_lens"], max_q)

    yield "block_tables all -1", with_(table=torch.full_like(table, -1)), kwargs, True
    yield "block_tables past num_blocks", with_(table=table + key_cache.shape[0]), kwargs, True
    yield "block_tables int32 max", with_(table=torch.full_like(table, 2**31 - 1)), kwargs, True
    yield "seq_lens past capacity", with_(seq_lens=seq_lens + capacity), kwargs, True
    yield "seq_lens negative", with_(seq_lens=-seq_lens - 1), kwargs, True
    yield "seq_lens shorter than the queries", with_(seq_lens=torch.zeros_like(seq_lens)), kwargs, True
    yield "cu_seqlens_q decreasing", with_(cu_q=cu_q.flip(0).contiguous()), kwargs, True


# Hostile inputs specific to an op, run after the generic ones.
EXTRA_MUTATIONS = {"attention.prefill_paged": _paged_prefill_mutations}


def _outcome(run, reference, case, args, kwargs, nonfinite_input=False):
    """('error' | 'match' | 'mismatch' | 'exception', detail)."""
    import torch

    from graft.conformance.compare import compare
    from graft.conformance.tolerances import tolerance_for
    from graft.errors import GraftError

    try:
        got = run()
    except GraftError as exc:
        return "error", f"{type(exc).__name__}: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - anything else is a finding
        return "exception", f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        want = reference()
    except Exception as exc:  # noqa: BLE001
        return "exception", f"the op returned a result but its reference raised {type(exc).__name__}: {exc}"
    if case.normalize is not None:
        got, want = case.normalize(got), case.normalize(want)
    key = next((a for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point), None)
    dtype = key.dtype if key is not None else torch.float32
    reduction = None
    if case.reduction is not None:
        try:
            reduction = int(case.reduction(args, kwargs))
        except Exception:  # noqa: BLE001 - a mutated shape may not fit the case's formula
            reduction = None
    def tol(d):
        return tolerance_for(d, reduction_len=reduction, atol=case.atol, rtol=case.rtol, compute_dtype=dtype)

    result = compare(got, want, tol)
    if not result.ok and nonfinite_input:
        # A NaN/inf input: which non-finite value comes out (NaN or inf) may depend on the
        # order of operations; where the outputs are non-finite and where they are finite
        # (and there, their values) must still match.
        result = compare(_nonfinite_as_nan(got), _nonfinite_as_nan(want), tol)
    return ("match", "") if result.ok else ("mismatch", result.describe()[:400])


def _nonfinite_as_nan(value):
    import torch

    if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
        return torch.where(torch.isfinite(value), value, torch.full_like(value, math.nan))
    if isinstance(value, (tuple, list)):
        return type(value)(_nonfinite_as_nan(v) for v in value)
    return value


def _child(op: str) -> None:
    import torch

    import graft
    from graft.config import op_env_var
    from graft.conformance.cases import all_cases
    from graft.plugins import get_host

    host = get_host()
    registry = host.registry
    spec = registry.op(op)
    cases = [c for c in all_cases(host, registry) if c.op == op and "quick" in c.tags]
    sized = []
    for case in cases:
        args, kwargs = case.inputs("cpu", torch.float32 if torch.float32 in case.dtypes else case.dtypes[0])
        size = sum(a.numel() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
        sized.append((size, case.name, case))
    chosen = [c for _, _, c in sorted(sized, key=lambda s: s[:2])[:CASES_PER_OP]]
    chosen += [c for c in cases if c.name in EXTRA_CASES.get(op, ()) and c not in chosen]
    backends = sorted({i.backend for i in registry.impls[op]
                       if i.static_reason("cpu", None, "cpu") is None})
    for case in chosen:
        dtype = torch.float32 if torch.float32 in case.dtypes else case.dtypes[0]
        args, kwargs = case.inputs("cpu", dtype)
        extra = EXTRA_MUTATIONS.get(op, lambda a, k: ())(args, kwargs)
        for label, m_args, m_kwargs, reads_values in [*_mutations(args, kwargs), *extra]:
            for backend, checks in [(b, c) for b in backends for c in (("1", "0") if reads_values else ("1",))]:
                name = f"{case.id} {label} backend={backend} GRAFT_CHECK_VALUES={checks}"
                print(json.dumps({"case": name, "started": True}), flush=True)
                with graft.override_config({op_env_var(op): backend, "GRAFT_CHECK_VALUES": checks}):
                    def run():
                        return graft.call(op, *[a.clone() if isinstance(a, torch.Tensor) else a for a in m_args],
                                          **m_kwargs)

                    def reference():
                        return spec.reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in m_args],
                                              **m_kwargs)

                    outcome, detail = _outcome(run, reference, case, m_args, m_kwargs,
                                               nonfinite_input="nan" in label or "inf" in label)
                print(json.dumps({"case": name, "outcome": outcome, "detail": detail}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
