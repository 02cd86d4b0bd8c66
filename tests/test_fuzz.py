"""Hostile inputs through every op's public entry point, on every backend that runs here,
with value checks on and off.

Each op's inputs start from its quick conformance cases and are then mutated: non-contiguous
copies, index tensors holding -1 or a huge value, NaN/inf scalars, NaN/inf tensor values, a
wrong dtype, a wrong last dimension. Every outcome must be a clear GraftError (GraftInputError
for bad input) or the torch reference's result (within the conformance tolerance; NaN/inf at
the same places): never a crash, another exception, or a different number.

Each op runs in a child process, so a segfault or abort fails that test (naming the last
case started) instead of killing the run. Mutations of values run with GRAFT_CHECK_VALUES=1
and =0; the others (shapes, dtypes, strides) do not depend on value checks and run once.

Collectives run on 2 gloo ranks (spawned processes, bounded): every collective op on every
algorithm, validation in its default mode and ``always`` (value checks on and off), with
non-contiguous, NaN/Inf, empty, other-dtype and wrong-rank inputs and shapes or dtypes that
differ across ranks. Each outcome must be a clear GraftError on every rank or, on every
rank, torch.distributed's result (the int8 gather: within its documented bound, NaN/Inf
exact); never a hang, an abort or uninitialised memory.
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

    from graft.tools.conformance.compare import compare
    from graft.tools.conformance.tolerances import tolerance_for
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
    from graft.tools.conformance.cases import all_cases
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


# ------------------------------------------------------------------------------ collectives

COLLECTIVE_BACKENDS = {  # op -> algorithms that run on the CPU when named
    "all_reduce": ("torch", "oneshot", "twoshot"),
    "all_gather": ("torch",),
    "reduce_scatter": ("torch",),
    "all_gather_quantized": ("torch", "int8"),
    "gemm_reduce_scatter": ("torch", "overlap"),
    "all_gather_gemm": ("torch", "overlap"),
}
# (validation mode, value checks): default validation with checks on, `always` with them off
COLLECTIVE_MODES = (("signature", "1"), ("always", "0"))


def _collective_inputs(op, rank):
    """The op's valid arguments on ``rank`` (tensors first)."""
    import torch

    gen = torch.Generator().manual_seed(101 + rank)
    if op in ("gemm_reduce_scatter", "all_gather_gemm"):
        return [torch.randn(4, 6, generator=gen), torch.randn(6, 3, generator=gen)]
    return [torch.randn(4, 8, generator=gen) * 10]


def _collective_mutations(op, rank):
    """(label, args, must_fail) for one rank; must_fail: the ranks' calls are incompatible."""
    import torch

    def strided(t):
        base = t.new_empty(tuple(t.shape) + (2,))
        base[..., 0] = t
        return base[..., 0]

    args = _collective_inputs(op, rank)
    x = args[0]
    yield "valid", args, False
    yield "noncontiguous", [strided(a) for a in args], False
    yield "transposed", [x.t()] + args[1:], False  # another (valid or clearly invalid) shape, strided
    for label, value in (("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)):
        bad = x.clone()
        bad[1, 2 + rank] = value
        yield f"x[1, 2 + rank]={label}", [bad] + args[1:], False
    yield "empty", [x[:0]] + args[1:], False
    yield "float64", [a.double() for a in args], False
    yield "int64", [(a * 4).round().long() for a in args], False
    yield "0-dim", [x[0, 0]] + args[1:], False
    # Calls that differ across ranks, each a signature neither rank has used (the default
    # validation agrees on every new signature; see the README for what needs `always`).
    yield "rank1-more-rows", [torch.cat([x, x[:2 + 2 * rank]])] + args[1:], True
    yield "rank1-bfloat16", [a.bfloat16() if rank == 1 else a.half() for a in args], True
    yield "rank1-other-ndim", [x[:2].reshape(-1) if rank == 1 else x[:2]] + args[1:], True


def _torch_distributed_result(op, args):
    """What torch.distributed gives for the op on these arguments (the semantics graft must keep)."""
    import torch
    import torch.distributed as dist

    ws = dist.get_world_size()

    def gather(t):
        t = t.contiguous()
        out = t.new_empty((ws * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t)
        return out

    def scatter(t):
        t = t.contiguous()
        out = t.new_empty((t.shape[0] // ws,) + tuple(t.shape[1:]))
        dist.reduce_scatter_tensor(out, t)
        return out

    if op == "all_reduce":
        out = args[0].contiguous().clone()
        dist.all_reduce(out)
        return out
    if op in ("all_gather", "all_gather_quantized"):
        return gather(args[0])
    if op == "reduce_scatter":
        return scatter(args[0])
    if op == "gemm_reduce_scatter":
        return scatter(args[0] @ args[1])
    return gather(args[0]) @ args[1]


def _collective_outcome(op, backend, args):
    """('error' | 'match' | 'mismatch' | 'exception', detail) on this rank."""
    import torch

    from graft.errors import GraftError
    from graft.ops import collectives as C

    try:
        got = getattr(C, op)(*[a.clone() for a in args])
    except GraftError as exc:
        return "error", f"{type(exc).__name__}: {str(exc)[:160]}"
    except Exception as exc:  # noqa: BLE001 - anything else is a finding
        return "exception", f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        want = _torch_distributed_result(op, args)
    except Exception as exc:  # noqa: BLE001
        return "exception", f"graft returned a result but torch.distributed raised {type(exc).__name__}: {exc}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return "mismatch", f"graft gave {tuple(got.shape)} {got.dtype}, torch.distributed {tuple(want.shape)} {want.dtype}"
    if backend == "int8" and want.dtype.is_floating_point:
        from graft.kernels.collectives.all_gather_quantized import error_bound

        # the bound is per rank's shard (each quantizes its own blocks); NaN/+-Inf exact
        bound = torch.cat([error_bound(shard, 128) for shard in want.chunk(ws_of_result(), 0)])
        finite = torch.isfinite(want)
        ok = all(torch.equal(f(got), f(want)) for f in (torch.isnan, torch.isposinf, torch.isneginf)) and bool(
            ((got[finite] - want[finite]).abs() <= bound[finite]).all())
    elif backend == "overlap" or want.dtype == torch.bfloat16:
        ok = torch.allclose(got, want, rtol=1e-5 if want.dtype != torch.bfloat16 else 2e-2, atol=1e-5, equal_nan=True)
    else:
        ok = torch.equal(got, want) or (want.dtype.is_floating_point and torch.allclose(
            got, want, rtol=0, atol=0, equal_nan=True))
    return ("match", "") if ok else ("mismatch", f"max diff {(got.double() - want.double()).abs().nan_to_num(0).max()}")


def ws_of_result():
    import torch.distributed as dist

    return dist.get_world_size()


def w_fuzz_collectives(rank, ws):
    """Every (mode, op, backend, mutation) on this rank: a list of (case, outcome, detail)."""
    import graft
    from graft.config import op_env_var
    from graft import plugins

    results = []
    for validate, checks in COLLECTIVE_MODES:
        for op, backends in COLLECTIVE_BACKENDS.items():
            for backend in backends:
                for key in [k for k in os.environ if k.startswith("GRAFT_")]:
                    if key not in ("GRAFT_LOG_LEVEL", "GRAFT_DISABLE_PLUGINS"):
                        del os.environ[key]
                os.environ.update({op_env_var(f"collectives.{op}"): backend, "GRAFT_STRICT": "0",
                                   "GRAFT_COLLECTIVES_VALIDATE": validate, "GRAFT_CHECK_VALUES": checks,
                                   "GRAFT_COLLECTIVES_TIMEOUT": "5", "GRAFT_OVERLAP_MIN_BYTES": "0",
                                   "GRAFT_QUANTIZED_GATHER_MIN_BYTES": "0"})
                graft.reload_config()
                plugins.reset()
                for label, args, must_fail in _collective_mutations(op, rank):
                    outcome, detail = _collective_outcome(op, backend, args)
                    if must_fail and outcome == "match":
                        outcome, detail = "mismatch", "ranks called with incompatible inputs and got a result"
                    results.append((f"{op} {backend} {label} VALIDATE={validate} CHECK_VALUES={checks}",
                                    outcome, detail))
    return results


def test_hostile_collective_inputs_2_ranks():
    from _dist_helpers import run_ranks
    from datetime import timedelta

    per_rank = run_ranks(w_fuzz_collectives, 2, timeout=150, pg_timeout=timedelta(seconds=20))
    assert per_rank[0], "no case ran"
    problems = []
    for (case, o0, d0), (case1, o1, d1) in zip(*per_rank):
        assert case == case1, (case, case1)
        if o0 != o1:
            problems.append(f"{case}: rank 0 {o0} ({d0}), rank 1 {o1} ({d1})")
        elif o0 not in ("error", "match"):
            problems.append(f"{case}: {o0}: rank 0: {d0}; rank 1: {d1}")
    assert not problems, f"{len(problems)} of {len(per_rank[0])} cases:\n" + "\n".join(problems)
    # errors everywhere would pass the above: the valid and hostile-but-legal inputs must run
    for case, outcome, detail in per_rank[0]:
        if case.split()[2] in ("valid", "noncontiguous") or "=nan" in case or "inf " in case:
            assert outcome == "match", (case, outcome, detail)


# ------------------------------------------------------------------------------ graft fuzz (issue #25)
# The classes of `graft fuzz` (graft/fuzz.py): layouts, reload races, double backward,
# gradcheck, each in its own child process and time bound. Fast runs cover a few ops; the
# slow ones every op. tests/_fuzz_plants.py holds broken implementations they must catch.

def _graft_fuzz(tmp_path, *argv, env=None, timeout=400):
    out = tmp_path / "fuzz.json"
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    full.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "graft", "fuzz", "--json", str(out), *argv],
                          capture_output=True, text=True, env=full, timeout=timeout)
    results = json.loads(out.read_text())["results"] if out.exists() else []
    return proc, results


def _by_outcome(results):
    found: dict = {}
    for r in results:
        found.setdefault(r["outcome"], []).append(r)
    return found


def _assert_clean(proc, results, cls):
    found = _by_outcome(results)
    bad = {o: rs for o, rs in found.items() if o not in ("error", "match", "skip")}
    assert proc.returncode == 0 and not bad, (proc.returncode, {o: [(r["case"], r["detail"]) for r in rs[:5]]
                                                                for o, rs in bad.items()}, proc.stderr[-2000:])
    assert f"[{cls}] running (time bound" in proc.stdout, proc.stdout[-2000:]  # progress output
    assert f"{cls}: " in proc.stdout.splitlines()[-2]  # the per-class summary
    return found


def _check_layouts(found):
    errors = [r for r in found.get("error", []) if any(f" {k}" in r["case"] for k in ("sparse_csr", "mkldnn", "nested"))]
    assert errors and all("layout" in r["detail"] for r in errors), errors[:3]
    # strided views of dense tensors are values like any other: some are served, and right
    served = [r["case"] for r in found.get("match", []) if "non_contiguous" in r["case"] or "expanded" in r["case"]]
    assert served, found.get("match", [])[:5]


def test_fuzz_layouts(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "layouts", "--time-budget", "120",
                                "--ops", "fused.rms_norm,gemm.linear,loss.fused_linear_cross_entropy")
    found = _assert_clean(proc, results, "layouts")
    _check_layouts(found)
    kinds = {r["case"].split(" ")[2] for r in results if " arg" in r["case"]}
    assert {"sparse_csr", "sparse_csc", "sparse_bsr", "sparse_coo", "mkldnn", "nested", "non_contiguous",
            "expanded_stride0"} <= kinds, kinds
    assert any("(warm)" in r["case"] for r in results), "no case ran with the dense signature remembered"


def test_fuzz_hostile_tuning_tables(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "tables", "--time-budget", "120",
                                "--ops", "fused.rms_norm,attention.prefill")
    found = _assert_clean(proc, results, "tables")
    labels = {r["case"].split(" [", 1)[1].rstrip("]") for r in results}
    assert {"valid", "truncated", "not utf-8", "NaN ratio", "unknown backend", "no backend"} <= labels, labels
    errors = {r["case"] for r in found.get("error", [])}
    assert "fused.rms_norm [truncated]" in errors and "fused.rms_norm [valid]" not in errors, errors


def test_fuzz_hostile_command_lines(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "clis", "--time-budget", "400", timeout=500)
    found = _assert_clean(proc, results, "clis")
    labels = {r["case"] for r in found.get("error", [])}
    assert {"tune --device foo", "profile --compare binary", "fuzz --time-budget nan", "info --shape nonsense",
            "bench-kernels --device foo"} <= labels, labels


def test_fuzz_usage_errors_come_before_the_run(tmp_path):
    """An unknown op is a usage error (exit 2), not a false finding; a --json folder that does
    not exist is said before the run, not after it."""
    for argv, message in ((("--ops", "fused.nope"), "--ops: unknown op(s) fused.nope"),
                          (("--json", str(tmp_path / "missing" / "f.json")), "does not exist")):
        proc = subprocess.run([sys.executable, "-m", "graft", "fuzz", "--time-budget", "600", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr[-1500:])
        assert "running (time bound" not in proc.stdout


@pytest.mark.slow
def test_fuzz_layouts_every_op(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "layouts", "--time-budget", "400", timeout=500)
    _check_layouts(_assert_clean(proc, results, "layouts"))
    assert not [r for r in results if r["outcome"] == "not run"], "the time bound cut the run short"


def test_fuzz_an_abort_is_a_finding_naming_its_case_and_the_run_goes_on(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "layouts", "--time-budget", "90", "--ops",
                                "fused.silu_and_mul", "--import", "_fuzz_plants",
                                env={"GRAFT_FUSED_SILU_AND_MUL": "plant,torch"})
    assert proc.returncode == 1, proc.stdout[-2000:]
    aborts = _by_outcome(results).get("abort", [])
    assert aborts and all("non_contiguous" in r["case"] for r in aborts), aborts
    assert "SIGABRT" in aborts[0]["detail"], aborts[0]
    after = results.index(aborts[0]) + 1
    assert results[after:] and any(r["outcome"] == "error" for r in results[after:]), "the run stopped at the abort"
    assert "1 finding" in proc.stdout or f"{len(aborts)} finding" in proc.stdout


def test_fuzz_reload_races(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "reloads", "--time-budget", "15", "--ops", "fused.rms_norm")
    found = _assert_clean(proc, results, "reloads")
    detail = found["match"][0]["detail"]  # "N calls, M reloads"
    calls, reloads = (int(w) for w in detail.replace(",", "").split()[::2][:2])
    assert calls > 100 and reloads > 50, detail


@pytest.mark.slow
def test_fuzz_reload_races_every_op(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "reloads", "--time-budget", "100", timeout=200)
    found = _assert_clean(proc, results, "reloads")
    assert len(found["match"]) >= 10, [r["case"] for r in results]


def test_fuzz_double_backward(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "double_backward", "--time-budget", "90",
                                "--ops", "fused.rms_norm,loss.fused_linear_cross_entropy,attention.prefill")
    found = _assert_clean(proc, results, "double_backward")
    backends = {r["case"].split(" ")[1].split(":")[0] for r in found.get("match", []) + found.get("error", [])}
    assert {"torch", "triton"} <= backends, backends
    # triton's backward kernels and torch's SDPA: a named error; the references: the right number
    assert all("no double backward for" in r["detail"] for r in found["error"])
    assert any(r["case"].split(" ")[1] == "torch:torch" for r in found["match"])


def test_fuzz_double_backward_catches_a_silent_second_derivative(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "double_backward", "--time-budget", "60", "--ops",
                                "fused.silu_and_mul", "--import", "_fuzz_plants", env={"GRAFT_FUZZ_PLANT": "zero"})
    assert proc.returncode == 1, proc.stdout[-2000:]
    bad = [r for r in results if r["outcome"] not in ("error", "match", "skip")]
    assert [r["case"].split(" ")[1] for r in bad] == ["plant:plant"], bad


def test_fuzz_gradcheck(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--classes", "gradcheck", "--time-budget", "90",
                                "--ops", "gemm.linear,fused.silu_and_mul")
    found = _assert_clean(proc, results, "gradcheck")
    details = {r["detail"] for r in found["match"]}
    assert {"float64 gradcheck", "fp32 gradients against the float64 reference"} <= details, details


@pytest.mark.slow
def test_fuzz_every_class_every_op(tmp_path):
    proc, results = _graft_fuzz(tmp_path, "--time-budget", "200", timeout=320)
    for cls in ("layouts", "reloads", "double_backward", "gradcheck"):
        assert any(r["class"] == cls for r in results), cls
    _assert_clean(proc, [r for r in results if r["outcome"] != "not run"], "gradcheck")


def test_fuzz_usage_errors_exit_2(tmp_path):
    proc, _ = _graft_fuzz(tmp_path, "--classes", "layouts,bogus", timeout=60)
    assert proc.returncode == 2 and "unknown fuzz class(es) bogus" in proc.stderr, proc.stderr


if __name__ == "__main__":
    _child(sys.argv[1])
