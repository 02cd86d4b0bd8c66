"""Per-op dispatch cost: what ``graft.dispatch.call(op, ...)`` (validation, selection, the
call of the selected implementation) costs on top of that implementation, on each op's
first quick case.

Three measurements per op, each interleaved (medians of per-round differences):

* ``overhead_us``, graft's own cost: the selected implementation's function is swapped,
  for the measurement only, for a stub that returns a precomputed output, and
  ``dispatch.call`` is timed against calling that stub directly. The kernel's time (and its
  noise, tens to thousands of us on a shared CPU) drops out, so the difference is what
  graft adds, to a fraction of a microsecond. All ops are stubbed at once and their rounds
  interleaved (op after op, graft and stub back to back): an op's rounds are spread over the
  whole measurement (a few seconds), so a short spell in which the shared machine runs at
  half speed slows a minority of an op's rounds, which the median drops, instead of all of
  them (a spell longer than the measurement slows every op alike: on this 2-core VM, whose
  host takes back up to a third of its time, figures vary by up to 2x between runs).
  Measured with value checks off (the GPU default: each is a device sync there) and, as
  ``overhead_with_value_checks_us``, on (the CPU default: checks that read tensor values,
  such as cu_seqlens or expert ids, run on every call: only those, an op's ``check_values``,
  once its signature is remembered).
* ``overhead_cold_us``, graft's own cost after the kernel: the same stub, but each timed
  call comes right after the real implementation ran (untimed), as on the real call, where
  the kernel has pushed graft's code and data out of the caches (see :func:`cold_cost`):
  several times the warm figure for the ops with many tensors, and read to a few
  nanoseconds where the real-call delta below, bound by the kernel's noise, is read to a
  microsecond or two;
* ``real_overhead_us``: the real ``dispatch.call`` against the real implementation called
  directly (``graft_us``, ``direct_us``), value checks off: the end-to-end view, bound by
  the kernel's noise. The rounds of the real calls hold a few calls each (one for calls of
  50 us and more), in a random order each round: the public op and the implementation it
  selected run a call or two apart, so that the host's speed, which swings within
  milliseconds here, is the same for both sides of a difference (with 20 calls a side, half
  the noise of a 300 us call's delta was the host's speed changing between two batches),
  and each runs after each other variant alike (see ``timing.interleaved``); before each, a
  cheap other op runs through graft, untimed, as the op before it would in a model where
  graft serves the ops (:func:`neighbour_call`). Rounds are
  added until the delta is known to a fraction of a microsecond, or is two standard errors
  away from the 2 us target, or the op's budget is spent.

Collectives need a process group: their rows are measured on every rank of one
(``collectives=True``, from :mod:`graft.tools.bench.distributed`)."""
from __future__ import annotations

import contextlib
import math
import time

import torch

from graft.tools.bench.overhead import TARGETS, side
from graft.tools.bench.timing import fastest, interleaved, interleaved_until
from graft.platform import dtype_name


def first_quick_cases() -> dict:
    """op name -> its first ``quick`` case (op modules' CASES order)."""
    from graft.ops import family_modules

    cases = {}
    for module in family_modules():
        for case in getattr(module, "CASES", ()):
            if "quick" in case.tags and case.op not in cases:
                cases[case.op] = case
    return cases


@contextlib.contextmanager
def stubbed(impl, output):
    """``impl.fn`` returns ``output`` without computing, inside the block (bench only:
    Implementation is frozen for everyone else). Dispatch's remembered signatures hold the
    function they call, so they are forgotten on the way in and out: the next calls
    remember them again with the function in force."""
    from graft import selection

    real = impl.fn

    def stub(*args, **kwargs):
        return output

    object.__setattr__(impl, "fn", stub)
    selection.forget()
    try:
        yield stub
    finally:
        object.__setattr__(impl, "fn", real)
        selection.forget()


def public_entry(op: str):
    """The op's public function (``graft.ops.fused.rms_norm``), or None."""
    import importlib

    family, name = op.split(".", 1)
    try:
        return getattr(importlib.import_module(f"graft.ops.{family}"), name, None)
    except ImportError:
        return None


def framework_call(op: str, args, kwargs):
    """``(name, call)`` of the first baseline (``graft.baselines``: torch's own
    function, a framework's) that can run this case, or None."""
    from graft.baselines import baselines_for

    for baseline in baselines_for(op):
        prepared = baseline.prepare(args, kwargs)
        if isinstance(prepared, str):
            continue
        fn, b_args, b_kwargs, _ = prepared
        return baseline.name, (lambda fn=fn, a=b_args, k=b_kwargs: fn(*a, **k))
    return None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def custom_op_cost(rounds: int, inner: int) -> dict:
    """What a ``torch.ops.graft.*`` custom op costs an eager call: through torch's dispatcher,
    and as graft's op objects call it (directly where nothing needs the dispatcher: see
    ``graft.custom_ops``), each against the plain function (us a call)."""
    from graft.custom_ops import define_op

    op = getattr(custom_op_cost, "op", None)
    if op is None:
        op = custom_op_cost.op = define_op("bench_custom_op_probe", _probe, fake=_probe)  # type: ignore[attr-defined]
    x = torch.randn(8)
    overload = torch.ops.graft.bench_custom_op_probe.default
    t = interleaved({"dispatcher": lambda: overload(x), "graft": lambda: op(x), "plain": lambda: _probe(x)},
                    rounds=rounds, inner=inner)
    return {"dispatcher_us": t.difference("dispatcher", "plain") * 1e6, "graft_us": t.difference("graft", "plain") * 1e6}


ROUND_SPAN_S = 50e-6  # a round's calls of one variant take about this long (at least one call)


def calls_per_round(fn, most: int, sync=None) -> int:
    """How many back-to-back calls of ``fn`` a round times: enough to span ``ROUND_SPAN_S``
    (a clock read is ~50 ns, so a single call of a few microseconds is read to a few percent),
    one for calls that long or longer, ``most`` at most. From the fastest of a few calls."""
    fn()
    if sync is not None:  # collectives: every rank must make the same calls (and choose alike)
        return most
    best = fastest(fn, 3)
    return max(1, min(most, math.ceil(ROUND_SPAN_S / max(best, 1e-9))))


NEIGHBOURS = ("fused.silu_and_mul", "fused.rms_norm")  # cheap ops a model calls between the others


def neighbour_call(op: str, cases: dict):
    """An untimed call of another op through graft (its public function, real), run before
    each timed real call: in a model where graft serves the ops, the call before this one
    went through graft too, so graft's code is warm while the op's own remembered
    signature and tensors are not. Without it, the real calls of one op alternate with
    direct calls that never run graft's code, and it is colder than in any model (the
    public op's delta read about 1.5 us more for the paged decode). None where no
    neighbour has a quick case."""
    for other in NEIGHBOURS:
        fn = public_entry(other) if other != op and other in cases else None
        if fn is not None:
            case = cases[other]
            args, kwargs = case.inputs("cpu", torch.float32 if torch.float32 in case.dtypes else case.dtypes[0])
            return lambda *_: fn(*args, **kwargs)
    return None


def cold_cost(op: str, impl, real, public, args, kwargs, output, budget_s: float, neighbour=None, sync=None,
              rounds: int = 100) -> dict:
    """graft's own cost where the real call pays it: the public op (``dispatch.call`` where the
    op has none, and for the collectives) with its implementation stubbed against the stub,
    each timed call right after the real implementation ran untimed (and then ``neighbour``, as before the real calls),
    so that what graft reads for this op (its remembered signatures, the tensors' metadata)
    is as far out of the caches as the kernel leaves it. The kernel's time is outside the
    timed region, so this reads to a few nanoseconds what the real-call delta reads to a
    microsecond or two; they differ by how graft's reads change the kernel's own time.
    Rounds are added for ``budget_s``; with ``sync`` (a collective: every rank runs the real
    collective before each timed call, in the same order), ``rounds`` rounds, the same on
    every rank."""
    import graft

    # (The collectives' public functions go through their own plan cache, which holds the
    # function it calls; dispatch.call, which the warm figure times too, takes the stub.)
    collective = op.startswith("collectives.")
    entry = public if public is not None and not collective else (lambda *a, **k: graft.dispatch.call(op, *a, **k))

    def before(name):
        real(*args, **kwargs)
        if neighbour is not None:
            neighbour()

    with graft.override_config(GRAFT_CHECK_VALUES="0"), stubbed(impl, output) as stub:
        variants = {"graft": lambda: entry(*args, **kwargs), "stub": lambda: stub(*args, **kwargs)}
        entry(*args, **kwargs)  # the first call of a signature validates in full; the next ones are remembered
        if sync is not None:
            times = interleaved(variants, rounds=rounds, shuffle=True, before=before, sync=sync)
        else:
            times = interleaved_until(variants, "graft", "stub", 0.01e-6, budget_s, rounds=rounds, shuffle=True,
                                      before=before)
    return {"overhead_cold_us": times.difference("graft", "stub") * 1e6,
            "overhead_cold_se_us": times.difference_se("graft", "stub") * 1e6,
            "overhead_cold_rounds": len(times.samples["stub"])}


@contextlib.contextmanager
def one_rank_group():
    """A one-rank gloo default process group for this process, inside the block (True), or
    False where torch.distributed is unavailable or a group already exists. The collectives'
    real calls are measured here too: graft's path is the same as on many ranks (its
    cross-rank agreement runs once per signature), and the communication is a local copy
    whose time varies by a fraction of a microsecond, where across two gloo ranks on this
    machine it varies by tens to hundreds."""
    import os
    import tempfile

    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield False
        return
    with tempfile.TemporaryDirectory(prefix="graft-bench-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield True
        finally:
            dist.destroy_process_group()


def _real_fields(real) -> dict:
    """A row's figures from the real-call rounds (public, direct, again)."""
    fields = {"direct_us": real["direct"] * 1e6, "real_noise_us": real.difference("again", "direct") * 1e6,
              "real_rounds": len(real.samples["direct"])}
    if "public" in real:
        # The real-call delta: the public op against the implementation it selected, both real.
        fields.update(public_us=real["public"] * 1e6, real_call_delta_us=real.difference("public", "direct") * 1e6,
                      real_call_delta_se_us=real.difference_se("public", "direct") * 1e6)
    return fields


def measure(rounds: int, inner: int, progress=print, only=None, collectives=False, sync=None,
            stub_rounds: int = 301, stub_inner: int = 100, delta_se_us: float = 0.2, delta_budget_s: float = 0.0,
            cold_budget_s: float = 0.0, extra_budget_s: float = 0.0) -> list:
    """Per op: the real call against the implementation it selected, and graft's own cost
    (see the module doc). The real call runs batches of ``rounds`` x ``inner`` calls a
    variant, in rounds of :func:`calls_per_round` calls (``inner`` at most), repeated while
    the real-call delta's standard error is above ``delta_se_us``, its side of the target
    undecided and the op's ``delta_budget_s`` left (0: one batch); then the deltas still
    undecided share ``extra_budget_s`` more. With ``cold_budget_s``, each op also gets
    :func:`cold_cost` for up to that long."""
    import graft

    registry = graft.get_registry()
    cases = first_quick_cases()
    call = graft.dispatch.call
    rows, measured = [], []  # measured: (row, args, kwargs, output)
    more: list = []  # the real-call rounds to carry on if the delta is undecided
    target = TARGETS["real_call_delta_us"]

    def delta_rounds(calls, op_rounds, op_inner, neighbour, target_se_us, budget_s, start=None):
        """The public op, the direct call and the A/A control, until the delta is decided."""
        return interleaved_until(calls, "public", "direct", target_se_us * 1e-6, budget_s, op_rounds,
                                 inner=op_inner, sync=sync, shuffle=True, before=neighbour,
                                 threshold=target * 1e-6, start=start)

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
        # "again" is the direct call a second time: the spread of (again - direct) is the noise floor
        # any real-call delta below must be read against (an A/A control, measured in the same rounds).
        public = public_entry(op)
        framework = None if collectives else framework_call(op, args, kwargs)
        neighbour = None if sync is not None else neighbour_call(op, cases)
        with graft.override_config(GRAFT_CHECK_VALUES="0"):
            op_inner = calls_per_round(lambda: direct(*args, **kwargs), inner, sync)
            op_rounds = max(rounds * inner // op_inner, 3)  # the same number of calls a batch
            # The real-call delta's rounds hold only its two sides and the A/A control: with
            # fewer calls a round, the two sides run closer together and more rounds fit.
            calls: dict = {"direct": lambda: direct(*args, **kwargs), "again": lambda: direct(*args, **kwargs)}
            if public is not None:
                calls["public"] = lambda: public(*args, **kwargs)
            if public is not None and delta_budget_s > 0:
                real = delta_rounds(calls, op_rounds, op_inner, neighbour, delta_se_us, delta_budget_s)
            else:
                real = interleaved(calls, rounds=op_rounds, inner=op_inner, sync=sync, shuffle=True,
                                   before=neighbour)
            # Then, for the context, one batch of dispatch.call and of the framework's own
            # function against the direct call (and the public op, to compare within rounds).
            context: dict = {"direct": calls["direct"], "graft": lambda: call(op, *args, **kwargs)}
            if framework is not None:
                context["framework"] = framework[1]
                if public is not None:
                    context["public"] = calls["public"]
            beside = interleaved(context, rounds=op_rounds, inner=op_inner, sync=sync, shuffle=True,
                                 before=neighbour)
            output = direct(*args, **kwargs)
        progress(f"  {op:32s} real call measured ({len(real.samples['direct'])} rounds of {op_inner})")
        row = {"op": op, "case": case.name, "dtype": dtype_name(dtype), "backend": impl.backend,
               "graft_us": beside["graft"] * 1e6, "real_overhead_us": beside.difference("graft", "direct") * 1e6,
               "real_inner": op_inner, **_real_fields(real)}
        if public is not None and delta_budget_s > 0:
            more.append((row, calls, real, op_rounds, op_inner, neighbour))
        if framework is not None:
            # Against the function a framework would have called without graft (its own baseline).
            row["framework"] = framework[0]
            row["framework_us"] = beside["framework"] * 1e6
            row["vs_framework_us"] = beside.difference("public" if public is not None else "graft", "framework") * 1e6
        rows.append(row)
        measured.append((row, args, kwargs, output))
        if cold_budget_s > 0:
            row.update(cold_cost(op, impl, direct, public, args, kwargs, output, cold_budget_s, neighbour, sync))
    # The time left for the deltas the first rounds left undecided, shared among them.
    # (Undecided as the summary reads a delta: within two standard errors of the target, however
    # small they are; the rounds below stop at three, or when this share of the time is spent.)
    undecided = [m for m in more
                 if side(m[0]["real_call_delta_us"], m[0]["real_call_delta_se_us"], target) == "unresolved"]
    extra_end = time.perf_counter() + extra_budget_s
    for i, (row, calls, real, op_rounds, op_inner, neighbour) in enumerate(undecided):
        share = (extra_end - time.perf_counter()) / (len(undecided) - i)
        if share <= 0:
            break
        with graft.override_config(GRAFT_CHECK_VALUES="0"):
            real = delta_rounds(calls, op_rounds, op_inner, neighbour, 0.0, share, start=real)
        row.update(_real_fields(real))
        progress(f"  {row['op']:32s} real call measured further ({row['real_rounds']} rounds in all): "
                 f"{row['real_call_delta_us']:+.2f} +- {row['real_call_delta_se_us']:.2f} us")
    # graft's own cost, every op at once (see the module doc); the value-check mode reads
    # tensor values on every call (up to about 15 us), so it gets fewer rounds.
    for checks, key, n_rounds, n_inner in (("0", "overhead_us", stub_rounds, stub_inner),
                                           ("1", "overhead_with_value_checks_us", max(stub_rounds // 5, 15),
                                            max(stub_inner // 2, 10))):
        if not measured:
            break
        with graft.override_config(GRAFT_CHECK_VALUES=checks), contextlib.ExitStack() as stack:
            variants = {}
            for row, args, kwargs, output in measured:
                op = row["op"]
                # The selection again (a reload rebuilds plans): the stub goes where graft calls.
                served = graft.select(op, *args, **kwargs)
                call(op, *args, **kwargs)  # the first call of a signature validates in full (and agrees)
                stub = stack.enter_context(stubbed(served, output))
                variants[f"{op} graft"] = lambda op=op, args=args, kwargs=kwargs: call(op, *args, **kwargs)
                variants[f"{op} stub"] = lambda stub=stub, args=args, kwargs=kwargs: stub(*args, **kwargs)
            # No sync: the stubbed calls do not communicate, so no rank waits for another.
            progress(f"  graft's own cost, value checks {'on' if checks == '1' else 'off'}: {len(measured)} ops "
                     f"interleaved, {n_rounds} rounds of {n_inner} calls")
            own = interleaved(variants, rounds=n_rounds, inner=n_inner)
            for row, *_ in measured:
                row[key] = own.difference(f"{row['op']} graft", f"{row['op']} stub") * 1e6
    for row, *_ in measured:
        progress(f"  {row['op']:32s} {row['backend']:7s} graft's own cost {row['overhead_us']:5.2f} us "
                 f"(value checks on: {row['overhead_with_value_checks_us']:6.2f} us"
                 + (f"; after the kernel {row['overhead_cold_us']:5.2f} +- {row['overhead_cold_se_us']:.2f} us"
                    if "overhead_cold_us" in row else "")
                 + ")   real call: direct "
                 f"{row['direct_us']:8.1f} us, graft {row['graft_us']:8.1f} us ({row['real_overhead_us']:+6.1f} us)"
                 + (f", public op {row['real_call_delta_us']:+5.2f} +- {row['real_call_delta_se_us']:.2f} us"
                    if "real_call_delta_us" in row else "")
                 + f" (A/A control {row['real_noise_us']:+5.2f} us)"
                 + (f", vs {row['framework']} {row['vs_framework_us']:+5.2f} us" if "framework" in row else ""))
    return rows
