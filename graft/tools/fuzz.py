"""``graft fuzz``: hostile use of graft's ops, in bounded time, one child process per class.

Classes (``--classes``, default all):

- ``layouts``: every op's smallest case with each tensor argument in turn sparse (CSR, CSC,
  BSR, COO), mkldnn, nested, non-contiguous or expanded (zero strides), cold and with the
  dense signature remembered. Each call must raise a GraftError or return the reference's
  result on the same values (dense and contiguous); never abort or raise anything else.
- ``reloads``: threads call ops through the C and the Python entry while the main thread
  flips ``GRAFT_DISABLE`` with ``reload_config()``; a call made wholly under one settled
  configuration must never be served by an implementation it excludes, nor any call after
  the last reload.
- ``double_backward``: every implementation of every op with a backward that runs here,
  ``create_graph=True`` then a second derivative: it must equal the float64 reference's or
  raise "no double backward for <op> ... on <backend>".
- ``gradcheck``: ``torch.autograd.gradcheck`` in float64 on the torch backend over the op's
  quick cases; other backends (fp32 kernels): their gradients against the float64
  reference's autograd gradients.
- ``tables``: every op's smallest case under hostile tuning tables (``GRAFT_TUNING_TABLE``):
  wrong schema, truncated, not UTF-8, NaN or infinite ratios, unknown ops, backends and
  dtypes. A call must match the reference or raise GraftConfigError naming the table.
- ``clis``: the command lines (``graft tune``, ``profile``, ``fuzz``, ``info``,
  ``bench-kernels``) with hostile arguments: devices that do not exist, folders where files
  go, missing folders, binary and truncated input files, negative and non-numeric counts,
  unknown ops. Each must exit 2 with a one-line error, never a traceback (``--ops`` limits
  nothing here).

Each class runs in a child process (``python -m graft.tools.fuzz CLASS``) with its share of the time
budget; the child prints one JSON line when a case starts and one with its outcome, the parent
prints progress. An abort (a signal, a C++ exception) is a finding naming the case that was
running; the parent then restarts the child past it while time remains.
Exit status: 0 no findings, 1 findings, 2 usage error.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

CLASSES = ("layouts", "reloads", "double_backward", "gradcheck", "tables", "clis")
OK_OUTCOMES = ("error", "match", "skip")


def add_arguments(parser) -> None:
    parser.add_argument("--classes", default=",".join(CLASSES),
                        help=f"comma-separated classes to run (default: all of {', '.join(CLASSES)})")
    parser.add_argument("--time-budget", type=float, default=120.0, metavar="SECONDS",
                        help="wall-clock bound for all classes together (default 120); cases not started "
                             "in time are reported as not run")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: every op but collectives)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE in each child first (e.g. one that registers a vendor's "
                             "implementations to fuzz); repeatable")
    parser.add_argument("--json", dest="json_out", default=None, metavar="PATH",
                        help="write every case's outcome to PATH")
    parser.add_argument("--quiet", action="store_true", help="print findings and the summary only")


def run(args) -> int:
    from graft.errors import GraftConfigError

    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    unknown = [c for c in classes if c not in CLASSES]
    if unknown or not classes:
        raise GraftConfigError(f"unknown fuzz class(es) {', '.join(unknown) or '(none)'}; known: {', '.join(CLASSES)}")
    if not math.isfinite(args.time_budget) or args.time_budget <= 0:
        raise GraftConfigError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    _check_json_out(args.json_out)
    if args.ops:  # in the parent, before any child: an unknown op is a usage error, not a finding
        import importlib

        for module in args.imports:
            importlib.import_module(module)
        _op_names(args.ops)
    deadline = time.monotonic() + args.time_budget
    results: list = []
    for i, cls in enumerate(classes):
        left = deadline - time.monotonic()
        share = left / (len(classes) - i)
        results.extend(_run_class(cls, share, args))
    findings = [r for r in results if r["outcome"] not in OK_OUTCOMES and r["outcome"] != "not run"]
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"classes": classes, "results": results}, f, indent=1)
    counts: dict = {}
    for r in results:
        key = (r["class"], r["outcome"])
        counts[key] = counts.get(key, 0) + 1
    print("graft fuzz: " + "; ".join(
        f"{cls}: " + ", ".join(f"{n} {o}" for (c, o), n in sorted(counts.items()) if c == cls) for cls in classes))
    print(f"graft fuzz: {len(findings)} finding(s)")
    return 1 if findings else 0


def _check_json_out(path: str | None) -> None:
    """--json's folder must exist and be writable now, not after the whole run."""
    from graft.errors import GraftConfigError

    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise GraftConfigError(f"--json {path!r} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise GraftConfigError(f"--json {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise GraftConfigError(f"--json {path!r}: folder {folder!r} is not writable")


def _run_class(cls: str, seconds: float, args) -> list:
    """Run one class's child (restarted past an abort) for at most ``seconds``."""
    end = time.monotonic() + seconds
    results: list = []
    skip = 0
    print(f"[{cls}] running (time bound {seconds:.0f} s)", flush=True)
    while True:
        left = end - time.monotonic()
        if left <= 1:
            break
        cmd = [sys.executable, "-m", "graft.tools.fuzz", cls, "--seconds", f"{max(left - 5, 1):.1f}", "--skip", str(skip)]
        if args.ops:
            cmd += ["--ops", args.ops]
        for module in args.imports:
            cmd += ["--import", module]
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        started, done = None, set()
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(killed: the class's time bound ran out)"
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec.get("started"):
                started = rec["case"]
                skip += 1
                continue
            rec["class"] = cls
            results.append(rec)
            done.add(rec["case"])
            if not args.quiet or rec["outcome"] not in OK_OUTCOMES:
                print(f"[{cls}] {len(results)} {rec['outcome']}: {rec['case']}"
                      + (f": {rec['detail']}" if rec["outcome"] not in OK_OUTCOMES else ""), flush=True)
            if rec["outcome"] == "not run":
                skip = -1
        lines = err.strip().splitlines()
        tail = [ln for ln in lines if ln.startswith(("Fatal Python error", "terminate called"))][:2] + lines[-3:]
        if proc.returncode == 0 or skip < 0:
            break
        if started is not None and started not in done:
            code = proc.returncode
            name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
            detail = f"the child died (exit {code}{name}) in this case: " + " | ".join(tail)
            results.append({"class": cls, "case": started, "outcome": "abort", "detail": detail[-1500:]})
            print(f"[{cls}] {len(results)} abort: {started}: {detail[-600:]}", flush=True)
            continue  # restart past it
        results.append({"class": cls, "case": "(start-up)", "outcome": "exception",
                        "detail": f"the child exited {proc.returncode}: " + " | ".join(tail)})
        break
    return results


# ------------------------------------------------------------------------------ the child


def _emit(case: str, outcome: str | None = None, detail: str = "") -> None:
    if outcome is None:
        print(json.dumps({"case": case, "started": True}), flush=True)
    else:
        print(json.dumps({"case": case, "outcome": outcome, "detail": detail[:600]}), flush=True)


class _Cases:
    """Runs ``(name, fn)`` cases in order, past ``skip`` already started ones, until ``end``;
    ``fn() -> (outcome, detail)``; an exception from ``fn`` is itself the finding."""

    def __init__(self, skip: int, end: float):
        self.index, self.skip, self.end, self.stopped = 0, skip, end, False

    def run(self, name: str, fn) -> None:
        self.index += 1
        if self.index <= self.skip or self.stopped:
            return
        if time.monotonic() > self.end:
            self.stopped = True
            _emit("(time bound)", "not run", f"cases from #{self.index} on were not started: time bound reached")
            return
        _emit(name)
        try:
            outcome, detail = fn()
        except Exception as exc:  # noqa: BLE001 - anything escaping a case is a finding
            outcome, detail = "exception", f"{type(exc).__name__}: {exc}"
        _emit(name, outcome, detail)


def _op_names(wanted: str) -> list:
    from graft.plugins import get_registry

    registry = get_registry()
    if wanted:
        names = [o.strip() for o in wanted.split(",") if o.strip()]
        unknown = [o for o in names if o not in registry.ops]
        if unknown:
            from graft.errors import GraftConfigError

            raise GraftConfigError(f"--ops: unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(registry.ops))}")
        return names
    return sorted(o for o in registry.ops if not o.startswith("collectives."))


def _cases_of(op: str) -> list:
    """The op's quick cases, smallest first."""
    import torch

    from graft.tools.conformance.cases import all_cases
    from graft.plugins import get_host

    host = get_host()
    sized = []
    for case in all_cases(host, host.registry):
        if case.op != op or "quick" not in case.tags:
            continue
        args, kwargs = case.inputs("cpu", _dtype(case))
        size = sum(a.numel() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
        sized.append((size, case.name, case))
    return [c for _, _, c in sorted(sized, key=lambda s: s[:2])]


def _smallest(op: str):
    """The op's smallest quick case whose tensors are not empty (None: no case)."""
    import torch

    found = _cases_of(op)
    for case in found:
        args, kwargs = case.inputs("cpu", _dtype(case))
        if all(a.numel() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)):
            return case
    return found[0] if found else None


def _dtype(case):
    import torch

    return torch.float32 if torch.float32 in case.dtypes else case.dtypes[0]


def _compare(case, got, want, dtype):
    from graft.tools.conformance.compare import compare
    from graft.tools.conformance.tolerances import tolerance_for

    if case.normalize is not None:
        got, want = case.normalize(got), case.normalize(want)
    result = compare(got, want, lambda d: tolerance_for(d, atol=case.atol, rtol=case.rtol, compute_dtype=dtype))
    return ("match", "") if result.ok else ("mismatch", result.describe()[:400])


def _clone(value):
    import torch

    return value.clone() if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------- layouts

NON_STRIDED = ("sparse_csr", "sparse_csc", "sparse_bsr", "sparse_coo", "mkldnn", "nested")


def _layout_variants(t):
    """(label, hostile tensor, the dense contiguous tensor of the same values or None)."""
    import torch

    def attempt(label, make):
        try:
            bad = make()
        except Exception:  # noqa: BLE001 - this layout does not exist for this tensor
            return None
        dense = None
        try:
            if bad.layout is torch.strided and not bad.is_nested:
                dense = bad.contiguous()
            elif not bad.is_nested:
                dense = bad.to_dense()
        except Exception:  # noqa: BLE001
            dense = None
        return label, bad, dense

    out = [
        attempt("sparse_csr", lambda: t.to_sparse_csr()),
        attempt("sparse_csc", lambda: t.to_sparse_csc()),
        attempt("sparse_bsr", lambda: t.to_sparse_bsr((1, 1))),
        attempt("sparse_coo", lambda: t.to_sparse()),
        attempt("mkldnn", lambda: t.to_mkldnn()),
        attempt("nested", lambda: torch.nested.nested_tensor(list(t) if t.dim() >= 2 else [t])),
    ]
    if t.numel() > 1:
        def strided():
            base = t.new_empty(tuple(t.shape) + (2,))
            view = base[..., 0]
            view.copy_(t)
            return view
        out.append(attempt("non_contiguous", strided))
    if t.dim() >= 1 and t.shape[0] > 1:
        out.append(attempt("expanded_stride0", lambda: t[:1].expand(t.shape)))
    return [v for v in out if v is not None]


def _child_layouts(ops, cases: _Cases) -> None:
    import warnings

    import torch

    import graft
    from graft.errors import GraftError
    from graft.plugins import get_registry

    warnings.filterwarnings("ignore")
    registry = get_registry()
    for op in ops:
        case = _smallest(op)
        if case is None:
            continue
        spec = registry.op(op)
        dtype = _dtype(case)
        args, kwargs = case.inputs("cpu", dtype)
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() >= 1]
        for warm in (False, True):
            if warm:
                def remember():
                    for _ in range(3):
                        graft.call(op, *[_clone(a) for a in args], **kwargs)
                    return "match", ""
                cases.run(f"{case.id} dense x3 (remember its signature)", remember)
            for i in positions:
                for label, bad, dense in _layout_variants(args[i]):
                    call_args = list(args)
                    call_args[i] = bad

                    def one(call_args=call_args, i=i, label=label, dense=dense, bad=bad):
                        try:
                            got = graft.call(op, *[a if j == i else _clone(a) for j, a in enumerate(call_args)],
                                             **kwargs)
                        except GraftError as exc:
                            text = f"{type(exc).__name__}: {str(exc)[:200]}"
                            if label in NON_STRIDED and "layout" not in str(exc):
                                return "unclear", f"the error does not name the {label} layout: {text}"
                            return "error", text
                        if dense is None:
                            return "mismatch", f"returned a result for a {label} argument (no dense form to compare)"
                        ref_args = [dense.clone() if j == i else _clone(a) for j, a in enumerate(args)]
                        want = spec.reference(*ref_args, **kwargs)
                        return _compare(case, got, want, dtype)

                    cases.run(f"{case.id} arg{i} {label}{' (warm)' if warm else ''}", one)


# ---------------------------------------------------------------- reloads

def _child_reloads(ops, cases: _Cases) -> None:
    """Per op with a case: a vendor's implementation (the op's reference, backend
    ``fuzzvendor``) registered here; threads call the op over the case's inputs through both
    entries while GRAFT_DISABLE flips between excluding it and not."""
    import threading

    import graft
    from graft import config, dispatch, settings
    from graft.plugins import get_registry
    from graft.registry import Implementation

    registry = get_registry()
    chosen = []
    for op in ops:
        case = _smallest(op)
        spec = registry.op(op)
        if case is None or any(i.backend == "fuzzvendor" for i in registry.impls[op]):
            continue
        registry.add_impl(Implementation(op=op, backend="fuzzvendor", fn=spec.reference, provider="fuzz",
                                         devices=frozenset({"cpu"}), priority=10**6))
        chosen.append((op, case))
    if not chosen:
        return
    keep_out = "triton,hip"  # interpreted Triton would rank above a vendor on the CPU
    other = settings.raw("GRAFT_DISABLE") or ""
    base = ",".join(x for x in (other, keep_out) if x)
    os.environ["GRAFT_DISABLE"] = base
    graft.reload_config()
    per_op = max(cases.end - time.monotonic(), 1.0) / max(len(chosen), 1)

    for op, case in chosen:
        def stress(op=op, case=case):
            args, kwargs = case.inputs("cpu", _dtype(case))
            entries = (graft.run, dispatch._python_run)
            first = {e(op, *[_clone(a) for a in args], **kwargs)[1].backend for e in entries}
            if first != {"fuzzvendor"}:
                return "skip", f"the vendor's implementation does not serve this case ({sorted(first)})"
            bad, failed, calls, stop = [], [], [0], threading.Event()
            settled = [config.current()]

            def reader(run):
                while not stop.is_set():
                    start, before = settled[0], config.current()
                    try:
                        _, impl = run(op, *args, **kwargs)
                    except Exception as exc:  # noqa: BLE001 - a call that fails under reloads is a finding
                        failed.append(f"{type(exc).__name__}: {exc}")
                        return
                    calls[0] += 1
                    if (start is before is config.current() is settled[0] and impl.backend == "fuzzvendor"
                            and "fuzzvendor" in (before.get("GRAFT_DISABLE") or "")):
                        bad.append(before.generation)

            threads = [threading.Thread(target=reader, args=(entries[k % 2],), daemon=True) for k in range(8)]
            old = sys.getswitchinterval()
            sys.setswitchinterval(1e-5)
            for t in threads:
                t.start()
            reloads = 0
            stop_at = time.monotonic() + min(per_op, 20.0)
            try:
                while time.monotonic() < stop_at or reloads % 2 == 0:
                    os.environ["GRAFT_DISABLE"] = base + (",fuzzvendor" if reloads % 2 == 0 else "")
                    settled[0] = graft.reload_config()
                    reloads += 1
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=30)
                sys.setswitchinterval(old)
            # The last reload excluded the vendor: nothing may still serve it.
            after = {e(op, *[_clone(a) for a in args], **kwargs)[1].backend for e in entries for _ in range(2)}
            os.environ["GRAFT_DISABLE"] = base
            graft.reload_config()
            if failed:
                return "exception", f"{len(failed)} of 8 threads' calls raised during {reloads} reloads: {failed[0]}"
            if bad or "fuzzvendor" in after:
                return "mismatch", (f"{len(bad)} of {calls[0]} calls during {reloads} reloads served by an excluded "
                                    f"implementation; after the last reload: {sorted(after)}")
            return "match", f"{calls[0]} calls, {reloads} reloads"

        cases.run(f"{case.id} 8 threads x reloads (C and Python entries)", stress)


# ---------------------------------------------------------------- gradients

def grad_function(impl_fn, case, spec, args, kwargs):
    """(fn of the differentiable inputs -> tuple of floating outputs, leaves)."""
    import torch

    from graft.tools.conformance.compare import flatten

    positions = [i for i in spec.grad_inputs
                 if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].is_floating_point()]
    leaves = tuple(args[i].detach().clone().requires_grad_(True) for i in positions)

    def fn(*tensors):
        call = list(args)
        for i, t in zip(positions, tensors):
            call[i] = t
        out = impl_fn(*call, **kwargs)
        out = case.normalize(out) if case.normalize is not None else out
        return tuple(v for _, v in flatten(out) if isinstance(v, torch.Tensor) and v.is_floating_point())

    return fn, leaves


def _to64(args):
    import torch

    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _grad_impls(op):
    from graft.plugins import get_registry

    return [i for i in get_registry().implementations(op)
            if not i.framework and i.static_reason("cpu", None, "cpu") is None]


def _second_derivative(fn, leaves, seed=1):
    """d/d(leaves) of sum(grad(<outputs, c>)^2): a vector-Hessian-style product."""
    import torch

    outputs = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() for o in outputs)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return None
    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    live = [g for g in grads if g is not None and g.requires_grad]
    if not live:
        return None
    second = torch.autograd.grad(sum(g.pow(2).sum() for g in live), leaves, allow_unused=True)
    return [torch.zeros_like(x) if s is None else s for x, s in zip(leaves, second)]


def _child_double_backward(ops, cases: _Cases) -> None:
    import torch

    from graft.plugins import get_registry

    registry = get_registry()
    for op in ops:
        spec = registry.op(op)
        if not spec.grad_inputs:
            continue
        case = _smallest(op)
        if case is None:
            continue
        for impl in _grad_impls(op):
            dtype = torch.float32 if impl.dtypes is None or torch.float32 in impl.dtypes else None
            if dtype is None:
                continue

            def one(impl=impl, case=case, spec=spec):
                args, kwargs = case.inputs("cpu", torch.float32)
                fn, leaves = grad_function(impl.fn, case, spec, args, kwargs)
                try:
                    got = _second_derivative(fn, leaves)
                except RuntimeError as exc:
                    named = f"no double backward for {op}"
                    if named in str(exc) and f"on {impl.backend}" in str(exc):
                        return "error", str(exc)[:200]
                    return "exception", f"unclear double-backward error: {type(exc).__name__}: {str(exc)[:300]}"
                ref_fn, ref_leaves = grad_function(spec.reference, case, spec, _to64(args), kwargs)
                want = _second_derivative(ref_fn, ref_leaves)
                if got is None:
                    return ("match", "no differentiable gradient") if want is None else (
                        "mismatch", "create_graph=True gave gradients that cannot be differentiated")
                for leaf, g, w in zip(leaves, got, want or []):
                    scale = max(w.abs().max().item() if w.numel() else 0.0, 1e-6)
                    err = (g.double() - w).abs().max().item() if w.numel() else 0.0
                    if err > 2e-3 * scale + 1e-5:
                        return "mismatch", f"second derivative off by {err:.3g} (reference max {scale:.3g})"
                return "match", ""

            cases.run(f"{case.id} {impl.backend}:{impl.provider or '-'} double backward", one)


def _child_gradcheck(ops, cases: _Cases) -> None:
    import torch

    from graft.plugins import get_registry

    registry = get_registry()
    for op in ops:
        spec = registry.op(op)
        if not spec.grad_inputs:
            continue
        for case in _cases_of(op)[:3]:
            for impl in _grad_impls(op):
                def one(impl=impl, case=case, spec=spec):
                    if impl.dtypes is None or torch.float64 in impl.dtypes or impl.backend == "torch":
                        args, kwargs = case.inputs("cpu", torch.float64)
                        fn, leaves = grad_function(impl.fn, case, spec, _to64(args), kwargs)
                        if not leaves:
                            return "skip", "no differentiable input"
                        ok = torch.autograd.gradcheck(fn, leaves, fast_mode=True, raise_exception=False)
                        return ("match", "float64 gradcheck") if ok else ("mismatch", "float64 gradcheck failed")
                    args, kwargs = case.inputs("cpu", torch.float32)
                    fn, leaves = grad_function(impl.fn, case, spec, args, kwargs)
                    if not leaves:
                        return "skip", "no differentiable input"
                    outputs = fn(*leaves)
                    if not any(o.numel() for o in outputs):
                        return "skip", "empty outputs: no gradient to compare"
                    gen = torch.Generator().manual_seed(1)
                    cot = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]
                    got = torch.autograd.grad(outputs, leaves, [c.float() for c in cot], allow_unused=True)
                    ref_fn, ref_leaves = grad_function(spec.reference, case, spec, _to64(args), kwargs)
                    want = torch.autograd.grad(ref_fn(*ref_leaves), ref_leaves, cot, allow_unused=True)
                    for leaf, g, w in zip(leaves, got, want):
                        w = torch.zeros_like(leaf, dtype=torch.float64) if w is None else w
                        g = torch.zeros_like(leaf) if g is None else g
                        rms = w.pow(2).mean().sqrt().item() if w.numel() else 0.0
                        err = (g.double() - w).abs().max().item() if w.numel() else 0.0
                        peak = w.abs().max().item() if w.numel() else 0.0
                        if err > 1e-4 * max(rms, 1e-6) + 1e-4 * peak:
                            return "mismatch", f"fp32 gradient off the float64 reference's by {err:.3g} (rms {rms:.3g})"
                    return "match", "fp32 gradients against the float64 reference"

                cases.run(f"{case.id} {impl.backend}:{impl.provider or '-'} gradcheck", one)


# ---------------------------------------------------------------- tuning tables


def _table_mutations(valid: dict) -> list:
    """(label, file bytes) of hostile tuning tables derived from ``valid``."""
    def with_entry(**change):
        entry = dict(valid["entries"][0], **change)
        return dict(valid, entries=[entry])

    def drop(key):
        entry = {k: v for k, v in valid["entries"][0].items() if k != key}
        return dict(valid, entries=[entry])

    dumps = lambda d: json.dumps(d).encode()  # noqa: E731
    text = dumps(valid)
    out = [("valid", text), ("empty file", b""), ("truncated", text[: len(text) // 2]), ("not utf-8", b"\xff\xfe\x00{"),
           ("a list", b"[]"), ("null", b"null"), ("wrong format", dumps(dict(valid, format="graft-tuning/0"))),
           ("entries an object", dumps(dict(valid, entries={"a": 1}))), ("entries null", dumps(dict(valid, entries=None))),
           ("entry a number", dumps(dict(valid, entries=[3]))), ("device a list", dumps(dict(valid, device=["cpu"]))),
           ("versions numbers", dumps(dict(valid, versions={"torch": 2.13}))),
           ("NaN ratio", text.replace(b'"ratio": 1.5', b'"ratio": NaN')),
           ("infinite ratio", text.replace(b'"ratio": 1.5', b'"ratio": Infinity')),
           ("huge ratio", dumps(with_entry(ratio=1e308))), ("ratio a string", dumps(with_entry(ratio="1.5"))),
           ("unknown backend", dumps(with_entry(backend="nosuchbackend"))), ("unknown op", dumps(with_entry(op="fused.nope"))),
           ("unknown dtype", dumps(with_entry(dtype="float7"))), ("bucket a number", dumps(with_entry(bucket=16))),
           ("median_us strings", dumps(with_entry(median_us={"torch": "x"}))),
           ("median_us a list", dumps(with_entry(median_us=[1, 2]))),
           ("spread bad", dumps(with_entry(spread={"torch": [1]}))), ("duplicate entries", dumps(dict(
               valid, entries=valid["entries"] * 2))), ("deeply nested", b"[" * 50000)]
    out += [(f"no {key}", dumps(drop(key))) for key in ("op", "dtype", "bucket", "backend")]
    return out


def _child_tables(ops, cases: _Cases) -> None:
    """Per op with a case: hostile tuning tables (wrong schema, truncated, not UTF-8, NaN,
    unknown names) named by GRAFT_TUNING_TABLE. Each call must either match the reference or
    raise GraftConfigError naming the table; anything else (another exception, a wrong
    number) is a finding. ``graft info`` must not crash either (checked once per table)."""
    import tempfile

    import graft
    from graft import tuning
    from graft.errors import GraftConfigError

    folder = tempfile.mkdtemp(prefix="graft-fuzz-tables-")
    for op in ops:
        case = _smallest(op)
        if case is None:
            continue
        dtype = _dtype(case)
        args, kwargs = case.inputs("cpu", dtype)
        spec = graft.get_registry().op(op)
        want = spec.reference(*[_clone(a) for a in args], **kwargs)
        valid = {"format": tuning.FORMAT, "device": tuning.device_key("cpu"), "versions": tuning.versions(),
                 "entries": [{"op": op, "dtype": str(dtype).replace("torch.", ""), "backend": "torch",
                              "bucket": tuning.bucket(op, args, kwargs), "provider": "torch", "ratio": 1.5,
                              "median_us": {"torch": 1.0, "graft": 1.5}}]}
        for label, content in _table_mutations(valid):
            def attempt(label=label, content=content):
                path = os.path.join(folder, "table.json")
                with open(path, "wb") as f:
                    f.write(content)
                with graft.override_config(GRAFT_TUNING_TABLE=path):
                    try:
                        got = graft.call(op, *[_clone(a) for a in args], **kwargs)
                    except GraftConfigError as exc:
                        if "table" not in str(exc):
                            return "mismatch", f"a GraftConfigError that does not name the table: {exc}"
                        return "error", str(exc)[:200]
                    return _compare(case, got, want, dtype)

            cases.run(f"{op} [{label}]", attempt)


# ---------------------------------------------------------------- command lines


def _cli_cases(folder: str) -> list:
    """(label, argv) of hostile command lines; every one must be a usage error (exit 2)."""
    binary = os.path.join(folder, "binary.json")
    truncated = os.path.join(folder, "truncated.json")
    shapes = os.path.join(folder, "shapes.json")
    with open(binary, "wb") as f:
        f.write(b"\xff\xfe\x00\x01garbage")
    with open(truncated, "w") as f:
        f.write('{"format": "graft-shapes/1", "shapes": [{"op": "fused.rms_norm", "args": [{"sha')
    with open(shapes, "w") as f:
        json.dump({"format": "graft-shapes/1", "shapes": [
            {"op": "fused.rms_norm", "dtype": "float32", "args": [{"shape": [4, 8]}, {"shape": [8]}, 1e-6, None]}]}, f)
    missing = os.path.join(folder, "no", "such", "folder", "file.json")
    run = [sys.executable, "-c", "pass"]
    return [
        ("tune --device foo", ["tune", "--shapes", shapes, "--device", "foo", "--out", os.path.join(folder, "t.json")]),
        ("tune --device cuda:7", ["tune", "--shapes", shapes, "--device", "cuda:7", "--out", os.path.join(folder, "t.json")]),
        ("tune --out a folder", ["tune", "--shapes", shapes, "--out", folder]),
        ("tune --out a missing folder", ["tune", "--shapes", shapes, "--out", missing]),
        ("tune --shapes binary", ["tune", "--shapes", binary, "--out", os.path.join(folder, "t.json")]),
        ("tune --shapes truncated", ["tune", "--shapes", truncated, "--out", os.path.join(folder, "t.json")]),
        ("tune --shapes missing", ["tune", "--shapes", missing]),
        ("tune --model binary", ["tune", "--model", binary, "--out", os.path.join(folder, "t.json")]),
        ("tune --rounds -3", ["tune", "--shapes", shapes, "--rounds", "-3", "--out", os.path.join(folder, "t.json")]),
        ("tune --tokens x", ["tune", "--model", folder, "--tokens", "x,y"]),
        ("tune --ops unknown", ["tune", "--shapes", shapes, "--ops", "fused.nope", "--out", os.path.join(folder, "t.json")]),
        ("profile --out a file", ["profile", "--out", shapes, "--", *run]),
        ("profile --out a missing folder's child", ["profile", "--out", os.path.join(binary, "x"), "--", *run]),
        ("profile --compare binary", ["profile", "--compare", binary, binary]),
        ("profile --compare missing", ["profile", "--compare", missing, missing]),
        ("profile --steps -1", ["profile", "--steps", "-1", "--", *run]),
        ("fuzz --json missing folder", ["fuzz", "--json", missing, "--time-budget", "5"]),
        ("fuzz --ops unknown", ["fuzz", "--ops", "fused.nope", "--time-budget", "5"]),
        ("fuzz --time-budget nan", ["fuzz", "--time-budget", "nan"]),
        ("fuzz --classes unknown", ["fuzz", "--classes", "nope"]),
        ("info --device foo", ["info", "--device", "foo"]),
        ("info --op unknown", ["info", "--op", "fused.nope"]),
        ("info --dtype nonsense", ["info", "--dtype", "float7"]),
        ("info --shape nonsense", ["info", "--op", "fused.rms_norm", "--shape", "axb"]),
        ("bench-kernels --device foo", ["bench-kernels", "--device", "foo"]),
    ]


def _child_clis(ops, cases: _Cases) -> None:
    import tempfile

    folder = tempfile.mkdtemp(prefix="graft-fuzz-clis-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    for label, argv in _cli_cases(folder):
        def attempt(argv=argv):
            try:
                proc = subprocess.run([sys.executable, "-m", "graft", *argv], capture_output=True, text=True,
                                      env=env, timeout=120, cwd=folder)
            except subprocess.TimeoutExpired:
                return "hang", f"graft {' '.join(argv)} ran past 120 s"
            tail = proc.stderr.strip().splitlines()[-1:] or [""]
            if "Traceback (most recent call last)" in proc.stderr:
                return "exception", f"exit {proc.returncode}, a traceback: {proc.stderr[-400:]}"
            if proc.returncode != 2:
                return "mismatch", f"exit {proc.returncode} (want 2, a usage error): {tail[0][:300]}"
            return "error", tail[0][:300]

        cases.run(label, attempt)


CHILDREN = {"layouts": _child_layouts, "reloads": _child_reloads,
            "double_backward": _child_double_backward, "gradcheck": _child_gradcheck, "tables": _child_tables,
            "clis": _child_clis}


def child_main(argv) -> int:
    import argparse
    import importlib

    parser = argparse.ArgumentParser(prog="python -m graft.tools.fuzz")
    parser.add_argument("cls", choices=CLASSES)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--ops", default="")
    parser.add_argument("--import", dest="imports", action="append", default=[])
    ns = parser.parse_args(argv)
    end = time.monotonic() + ns.seconds
    for module in ns.imports:
        importlib.import_module(module)
    cases = _Cases(ns.skip, end)
    CHILDREN[ns.cls](_op_names(ns.ops), cases)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
