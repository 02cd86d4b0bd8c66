"""Run every registered implementation of each op on its cases, against its baselines.

For each (case, dtype) the runner builds the inputs, runs the torch reference, then runs
every registered implementation directly (``impl.fn``, not through selection, so that a
lower-priority backend is checked too) on fresh inputs and compares. Implementations
that cannot serve the case (static device/dtype/arch/availability check, or their
per-call check) are recorded as skipped with the reason. What graft's selection would
pick for the same call is recorded alongside.

Timing (optional): the reference, each upstream baseline and each implementation are
timed on the same inputs in the same process; ratios are ``baseline / impl`` medians.
Implementations running in the Triton CPU interpreter are not timed by default: the
interpreter executes a kernel element by element in Python, so its time says nothing
about the kernel (``time_interpreted=True`` times them anyway, labelled as such).
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from graft import __version__
from graft import baselines as baselines_mod
from graft.tools.conformance import grad as grad_mod
from graft.tools.conformance.cases import MULTI_PROCESS_FAMILIES, all_cases, select_cases
from graft.tools.conformance.compare import Comparison, compare, flatten
from graft.tools.conformance.timing import Timing, speedup, time_call
from graft.tools.conformance.tolerances import tolerance_for
from graft.errors import GraftError
from graft.platform import device_info, dtype_name, triton_interpret
from graft.registry import key_tensor

PASS, FAIL, ERROR, SKIPPED = "pass", "fail", "error", "skipped"
INTERPRETER_NOTE = "not timed: runs in the Triton CPU interpreter, whose speed says nothing about the kernel"
INTERPRETER_TIMED_NOTE = "timed in the Triton CPU interpreter: NOT a performance number"


@dataclass
class Options:
    device: str = "cpu"
    ops: tuple = ()
    families: tuple = ()
    impls: tuple = ()  # backend names to run; empty: all
    tags: tuple = ("quick",)
    dtypes: tuple = ()  # torch dtypes; empty: each case's own
    timing: bool = True
    warmup: int | None = None  # None: by device (see resolved())
    repeats: int | None = None
    time_interpreted: bool = False
    upstream: bool = True  # framework/library baselines besides the torch reference
    seed: int = 0
    grad: bool = False  # also check gradients of implementations with a backward (conformance/grad.py)

    def resolved(self) -> "Options":
        cuda = torch.device(self.device).type == "cuda"
        # CPU: few repeats keep the default run short; GPU kernels are microseconds, so more
        # repeats are cheap and tighten the median.
        return dataclasses.replace(
            self,
            warmup=self.warmup if self.warmup is not None else (5 if cuda else 1),
            repeats=self.repeats if self.repeats is not None else (25 if cuda else 5),
        )



def _constant(timing: Timing) -> Callable[[], Timing]:
    return lambda: timing

@dataclass
class ImplResult:
    backend: str
    provider: str
    status: str
    reason: str | None = None  # skipped/error: why
    message: str | None = None  # fail/error: the full message
    comparison: dict | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    timing: dict | None = None
    timing_note: str | None = None
    speedups: dict = field(default_factory=dict)  # baseline name -> baseline_median / impl_median
    selected: bool = False
    grad: dict | None = None  # --grad: status, reason, message, per-input max abs/rel error (conformance/grad.py)

    @property
    def name(self) -> str:
        return f"{self.backend} ({self.provider})" if self.provider else self.backend


@dataclass
class BaselineResult:
    name: str
    status: str  # "ok", "unavailable", "not applicable", "mismatch", "error"
    reason: str | None = None
    timing: dict | None = None
    speedup_vs_reference: float | None = None
    max_abs: float | None = None


@dataclass
class CaseResult:
    op: str
    family: str
    case: str
    dtype: str
    status: str  # "ran", "skipped" (multi-process), "error" (case or reference broken)
    reason: str | None = None
    flops: float | None = None
    selected: str | None = None  # what graft's selection picks for this call, or why nothing
    reference_timing: dict | None = None
    baselines: list = field(default_factory=list)
    impls: list = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.op}[{self.case}] {self.dtype}"


@dataclass
class Report:
    meta: dict
    cases: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def impl_rows(self):
        for case in self.cases:
            for impl in case.impls:
                yield case, impl

    @property
    def failures(self) -> list:
        """(case, impl_or_None, message) for every numerics failure or error."""
        out = []
        for case in self.cases:
            if case.status == ERROR:
                out.append((case, None, case.reason))
            for impl in case.impls:
                if impl.status in (FAIL, ERROR):
                    out.append((case, impl, impl.message))
                if impl.grad is not None and impl.grad["status"] in (FAIL, ERROR):
                    out.append((case, impl, impl.grad["message"]))
        return out

    def grad_counts(self) -> dict | None:
        """pass/fail/error/skipped counts of the gradient checks, or None when none ran."""
        grads = [i.grad for c in self.cases for i in c.impls if i.grad is not None]
        if not grads:
            return None
        counts = {PASS: 0, FAIL: 0, ERROR: 0, SKIPPED: 0}
        for g in grads:
            counts[g["status"]] += 1
        return counts

    def counts(self) -> dict:
        counts = {PASS: 0, FAIL: 0, ERROR: 0, SKIPPED: 0}
        for case in self.cases:
            if case.status == ERROR:
                counts[ERROR] += 1
            elif case.status == SKIPPED:
                counts[SKIPPED] += 1
            for impl in case.impls:
                counts[impl.status] += 1
        return counts

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def as_dict(self) -> dict:
        summary = self.counts()
        if self.grad_counts() is not None:
            summary = dict(summary, grad=self.grad_counts())
        return {"meta": self.meta, "summary": summary, "notes": list(self.notes),
                "cases": [dataclasses.asdict(c) for c in self.cases]}



def failure_message(op, case_name, dtype, impl_name, comparison: Comparison) -> str:
    return f"{op} [{case_name}] dtype={dtype} impl={impl_name}: numerics mismatch\n" + comparison.describe()


def is_reference(impl, spec) -> bool:
    return impl.backend == "torch" and impl.fn is spec.reference


def is_interpreted(impl, device: torch.device) -> bool:
    """Triton kernels on the CPU run in the interpreter (the only way Triton runs on a CPU)."""
    return impl.backend == "triton" and device.type == "cpu" and triton_interpret()


def _normalize(case, out):
    return case.normalize(out) if case.normalize is not None else out


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class Runner:
    """Holds the registry, options and the report being built."""

    def __init__(self, host=None, options: Options | None = None, log=None):
        if host is None:
            from graft.plugins import get_host

            host = get_host()
        self.host = host
        self.registry = host.registry
        self.options = (options or Options()).resolved()
        self.device = torch.device(self.options.device)
        self.info = device_info(self.device)
        self.log = log or (lambda msg: None)

    # ----------------------------------------------------------------- case enumeration

    def cases(self) -> list:
        o = self.options
        return select_cases(all_cases(self.host, self.registry), self.registry, o.ops, o.families, o.tags)

    def case_dtypes(self, case) -> list:
        return [d for d in case.dtypes if not self.options.dtypes or d in self.options.dtypes]

    def impls_for(self, op: str) -> list:
        spec = self.registry.op(op)
        impls = [i for i in self.registry.implementations(op) if not is_reference(i, spec)]
        if self.options.impls:
            impls = [i for i in impls if i.backend in self.options.impls]
        return impls

    # ----------------------------------------------------------------- running

    def run(self) -> Report:
        o = self.options
        report = Report(meta=self._meta())
        started = time.perf_counter()
        for case in self.cases():
            for dtype in self.case_dtypes(case):
                result = self.run_case(case, dtype)
                report.cases.append(result)
                self.log(_progress_line(result))
        report.meta["wall_s"] = time.perf_counter() - started
        if any(c.status == SKIPPED and c.family in MULTI_PROCESS_FAMILIES for c in report.cases):
            for family, note in MULTI_PROCESS_FAMILIES.items():
                report.notes.append(f"{family}: {note}")
        if o.timing and self.device.type == "cpu" and triton_interpret():
            report.notes.append(
                "Triton kernels run in the CPU interpreter here: " + (INTERPRETER_TIMED_NOTE if o.time_interpreted
                                                                     else INTERPRETER_NOTE)
                + ". Ratios of the upstream baselines against the torch reference are still measured.")
        report.notes.append("Absolute times are device-specific (this machine, its load and clocks); "
                            "only ratios measured in the same run are comparable.")
        return report

    def run_case(self, case, dtype, impls=None) -> CaseResult:
        """Run one (case, dtype): reference, baselines, and ``impls`` (default: all of the op's)."""
        spec = self.registry.op(case.op)
        result = CaseResult(case.op, spec.family, case.name, dtype_name(dtype), "ran")
        if spec.family in MULTI_PROCESS_FAMILIES:
            result.status, result.reason = SKIPPED, MULTI_PROCESS_FAMILIES[spec.family]
            return result
        make = lambda: case.inputs(self.device, dtype, self.options.seed)  # noqa: E731  fresh inputs per run
        try:
            args, kwargs = make()
            if spec.validate is not None:
                spec.validate(*args, **kwargs)
            expected = _normalize(case, spec.reference(*args, **kwargs))
        except Exception as exc:
            result.status = ERROR
            result.reason = f"{case.op} [{case.name}] dtype={dtype_name(dtype)}: case inputs or reference failed: " \
                            f"{_short_error(exc)}"
            return result
        if case.flops is not None:
            try:
                result.flops = float(case.flops(args, kwargs))
            except Exception:
                result.flops = None
        reduction = None
        if case.reduction is not None:
            reduction = int(case.reduction(args, kwargs))
        compute_dtype = dtype if dtype.is_floating_point else None

        def tol(out_dtype):
            return tolerance_for(out_dtype, reduction_len=reduction, device_type=self.device.type,
                                 atol=case.atol, rtol=case.rtol, compute_dtype=compute_dtype)

        key = key_tensor(spec, args, kwargs)
        key_dtype = key.dtype if key is not None else None
        arch = self.info.arch if self.device.type == "cuda" else self.device.type
        result.selected, selected_impl = self._selection(case.op, key_dtype, arch, args, kwargs)

        # The reference is timed only once something is to be compared with it (on a CPU with
        # interpreted kernels and no applicable upstream baseline, nothing is).
        ref_cache: list[Timing] = []

        def ref_timing():
            if not ref_cache:
                ref_cache.append(self._time(spec.reference, make))
                result.reference_timing = ref_cache[0].as_dict()
            return ref_cache[0]

        baseline_timings: dict[str, Callable[[], Timing]] = {baselines_mod.REFERENCE: ref_timing}
        for baseline in baselines_mod.baselines_for(case.op, self.options.upstream):
            b = self._run_baseline(baseline, make, expected, tol, ref_timing)
            result.baselines.append(b)
            if b.timing is not None:
                timing = Timing(**{k: v for k, v in b.timing.items() if k != "iqr_rel"})
                baseline_timings[b.name] = _constant(timing)

        for impl in self.impls_for(case.op) if impls is None else impls:
            r = self._run_impl(impl, case, dtype, make, expected, tol, key_dtype, arch, baseline_timings)
            r.selected = selected_impl is impl
            result.impls.append(r)
        return result

    def _selection(self, op, key_dtype, arch, args, kwargs):
        from graft.selection import decide

        try:
            decision = decide(self.registry, op, self.device.type, key_dtype, arch, args, kwargs)
        except GraftError as exc:
            return f"nothing: {_short_error(exc)}", None
        impl = decision.selected
        name = f"{impl.backend} ({impl.provider})" if impl.provider else impl.backend
        return name, impl

    def _time(self, fn, make_args) -> Timing:
        o = self.options  # resolved in __init__: warmup and repeats are set
        return time_call(fn, make_args, self.device, warmup=int(o.warmup or 0), repeats=int(o.repeats or 1))

    def _run_baseline(self, baseline, make, expected, tol, ref_timing) -> BaselineResult:
        args, kwargs = make()
        prepared = baseline.prepare(args, kwargs)
        if isinstance(prepared, str):
            prefix = baselines_mod.UNAVAILABLE + ": "
            if prepared.startswith(prefix):
                return BaselineResult(baseline.name, baselines_mod.UNAVAILABLE, prepared[len(prefix):])
            return BaselineResult(baseline.name, "not applicable", prepared)
        fn, b_args, b_kwargs, post = prepared
        result = BaselineResult(baseline.name, "ok")
        try:
            out = fn(*b_args, **b_kwargs)
            out = post(out) if post is not None else out
            cmp = compare(out, expected, tol)
        except Exception as exc:
            return BaselineResult(baseline.name, ERROR, _short_error(exc))
        result.max_abs = cmp.max_abs
        if not cmp.ok:
            # Not graft's failure: the upstream path disagrees with graft's reference semantics
            # (or the adapter is wrong), so its ratio would compare different computations.
            result.status, result.reason = "mismatch", cmp.describe().splitlines()[0]
            return result
        if self.options.timing:

            def make_prepared():
                a, k = make()
                p = baseline.prepare(a, k)
                return p[1], p[2]

            timing = self._time(fn, make_prepared)
            result.timing = timing.as_dict()
            result.speedup_vs_reference = speedup(ref_timing(), timing)
        return result

    def _run_impl(self, impl, case, dtype, make, expected, tol, key_dtype, arch, baseline_timings) -> ImplResult:
        r = ImplResult(impl.backend, impl.provider, PASS)
        args, kwargs = make()
        reason = impl.reason(self.device.type, key_dtype, arch, args, kwargs)
        if reason:
            r.status, r.reason = SKIPPED, reason
            return r
        try:
            got = _normalize(case, impl.fn(*args, **kwargs))
        except Exception as exc:
            r.status, r.reason = ERROR, _short_error(exc)
            r.message = (f"{case.op} [{case.name}] dtype={dtype_name(dtype)} impl={r.name}: raised "
                         f"{_short_error(exc)}\n{_last_frames(exc)}")
            return r
        cmp = compare(got, expected, tol)
        r.comparison = cmp.as_dict()
        r.max_abs, r.max_rel = cmp.max_abs, cmp.max_rel
        if self.options.grad and grad_mod.differentiable(case.op):
            r.grad = grad_mod.run_grad(impl, self.registry.op(case.op), case, make, dtype,
                                       self.device.type, self.options.seed)
        if not cmp.ok:
            r.status = FAIL
            r.message = failure_message(case.op, case.name, dtype_name(dtype), r.name, cmp)
            return r
        if not self.options.timing:
            return r
        if is_interpreted(impl, self.device) and not self.options.time_interpreted:
            r.timing_note = INTERPRETER_NOTE
            return r
        timing = self._time(impl.fn, make)
        r.timing = timing.as_dict()
        if is_interpreted(impl, self.device):
            r.timing_note = INTERPRETER_TIMED_NOTE
        for name, base in baseline_timings.items():
            ratio = speedup(base(), timing)
            if ratio is not None:
                r.speedups[name] = ratio
        return r

    def _meta(self) -> dict:
        o = self.options
        return {
            "graft_version": __version__,
            "torch_version": torch.__version__,
            "device": self.info.as_dict(),
            "triton_interpret": triton_interpret(),
            "options": {
                "device": o.device, "ops": list(o.ops), "families": list(o.families), "impls": list(o.impls),
                "tags": list(o.tags), "dtypes": [dtype_name(d) for d in o.dtypes], "timing": o.timing,
                "warmup": o.warmup, "repeats": o.repeats, "time_interpreted": o.time_interpreted,
                "upstream": o.upstream, "seed": o.seed, "grad": o.grad,
            },
            "times_are_device_specific": True,
            "speedup_definition": "baseline median time / implementation median time (>1: implementation faster)",
            "plugins": {name: rec.status for name, rec in self.host.records.items()},
            "hook_errors": list(self.host.hook_errors),
        }


def enable_cpu_interpreter(device: str) -> bool:
    """On the CPU, run Triton kernels in the interpreter unless the user chose otherwise.

    Triton runs on a CPU only interpreted, and TRITON_INTERPRET must be set before triton
    is imported; without it every Triton implementation would just be skipped. An explicit
    TRITON_INTERPRET (e.g. 0) is respected. Returns True when it was set here.
    """
    import os
    import sys

    if torch.device(device).type != "cpu" or "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _last_frames(exc: BaseException, limit: int = 3) -> str:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(frames[-limit - 1:]).rstrip()


def _progress_line(case: CaseResult) -> str:
    if case.status != "ran":
        return f"  {case.id}: {case.status} ({case.reason})"
    parts = [f"{i.backend}={i.status}" + (f" grad={i.grad['status']}" if i.grad else "") for i in case.impls] or ["no implementations besides the reference"]
    return f"  {case.id}: " + ", ".join(parts)


def run_conformance(options: Options | None = None, host=None, log=None) -> Report:
    return Runner(host=host, options=options, log=log).run()


__all__ = ["Options", "Report", "Runner", "run_conformance", "flatten"]
