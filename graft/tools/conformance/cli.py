"""``graft conformance``: run the conformance suite and write the report.

Exit status: 0 all numerics passed, 1 any numerics failure or error, 2 usage error
(unknown op/family/backend/dtype/tag, no GPU for --device cuda, nothing selected, an --out
that cannot be written, gpu-sized cases on the CPU without --allow-slow). Usage errors are
found before anything runs.
"""
from __future__ import annotations

import sys

import torch

from graft.errors import GraftConfigError

TAGS = ("quick", "gpu")


def add_arguments(parser) -> None:
    parser.add_argument("--op", action="append", default=[], metavar="OP", help="only this op (repeatable)")
    parser.add_argument("--family", action="append", default=[], metavar="F", help="only this op family (repeatable)")
    parser.add_argument("--impl", action="append", default=[], metavar="BACKEND",
                        help="only implementations of this backend, e.g. triton (repeatable)")
    parser.add_argument("--tags", default="quick",
                        help="comma-separated case tags to run: quick (small, CPU-friendly; default), gpu "
                             "(benchmark sizes), or quick,gpu")
    parser.add_argument("--dtype", action="append", default=[], metavar="DTYPE",
                        help="only this dtype, e.g. float16 (repeatable; default: each case's dtypes)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", default="conformance-report", metavar="DIR", help="report directory")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default: 5 on cpu, 25 on cuda)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls (default: 1 on cpu, 5 on cuda)")
    parser.add_argument("--no-timing", action="store_true", help="check numerics only")
    parser.add_argument("--time-interpreted", action="store_true",
                        help="also time Triton kernels running in the CPU interpreter (labelled: not a performance number)")
    parser.add_argument("--no-upstream", action="store_true",
                        help="skip framework/library baselines (e.g. vLLM, whose import takes a while)")
    parser.add_argument("--seed", type=int, default=0, help="input seed")
    parser.add_argument("--grad", action="store_true",
                        help="also check every input's gradient of implementations with a registered backward "
                             "against torch autograd through the reference")
    parser.add_argument("--json-only", action="store_true", help="write report.json only")
    parser.add_argument("--quiet", action="store_true", help="no per-case progress lines")
    parser.add_argument("--allow-slow", action="store_true",
                        help="run gpu-sized cases (--tags gpu) on the CPU anyway (Triton interpreted: tens of minutes)")


def check_out_dir(path: str) -> None:
    """Refuse an --out that is a file or cannot be created/written, before the run starts."""
    import os
    import tempfile

    if os.path.exists(path) and not os.path.isdir(path):
        raise GraftConfigError(f"--out {path!r} exists and is not a directory; name a directory for the report")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".graft-write-check-"):
            pass
    except OSError as exc:
        raise GraftConfigError(f"--out {path!r} cannot be written: {exc.strerror or exc}") from None


def _dtypes(names) -> tuple:
    out = []
    for name in names:
        value = getattr(torch, name.strip(), None)
        if not isinstance(value, torch.dtype):
            raise GraftConfigError(f"--dtype {name!r} is not a torch dtype (e.g. float16, bfloat16, float32, int32)")
        out.append(value)
    return tuple(out)


def options_from_args(args):
    from graft.tools.conformance.runner import Options

    tags = tuple(t.strip() for t in args.tags.split(",") if t.strip())
    unknown = [t for t in tags if t not in TAGS]
    if not tags or unknown:
        raise GraftConfigError(f"--tags {args.tags!r}: use a comma-separated list of {', '.join(TAGS)}")
    device = torch.device(args.device) if args.device in ("cpu", "cuda") or args.device.startswith("cuda:") else None
    if device is None:
        raise GraftConfigError(f"--device {args.device!r}: use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GraftConfigError("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    for flag, value in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if value is not None and value < (1 if flag == "--repeats" else 0):
            raise GraftConfigError(f"{flag} {value}: must be {'>= 1' if flag == '--repeats' else '>= 0'}")
    return Options(device=args.device, ops=tuple(args.op), families=tuple(args.family), impls=tuple(args.impl),
                   tags=tags, dtypes=_dtypes(args.dtype), timing=not args.no_timing, warmup=args.warmup,
                   repeats=args.repeats, time_interpreted=args.time_interpreted, upstream=not args.no_upstream,
                   seed=args.seed, grad=args.grad)


def run(args) -> int:
    from graft.tools.conformance.report import summary_table, write_reports
    from graft.tools.conformance.runner import Runner, enable_cpu_interpreter
    from graft.plugins import get_host

    options = options_from_args(args)
    check_out_dir(args.out)
    if "gpu" in options.tags and torch.device(options.device).type == "cpu" and not args.allow_slow:
        raise GraftConfigError("--tags gpu selects benchmark-sized cases; on the CPU (Triton interpreted) they take "
                               "tens of minutes. Run them with --device cuda on a GPU, or pass --allow-slow")
    if enable_cpu_interpreter(options.device):
        print("TRITON_INTERPRET=1 set: Triton kernels run in the CPU interpreter (numerics only)", flush=True)
    host = get_host()
    if options.impls:
        known = host.registry.backends()
        unknown = [b for b in options.impls if b not in known]
        if unknown:
            raise GraftConfigError(f"--impl {', '.join(unknown)}: unknown backend; known: {', '.join(sorted(known))}")
    log = None if args.quiet else (lambda line: print(line, flush=True))
    runner = Runner(host=host, options=options, log=log)
    if not any(runner.case_dtypes(c) for c in runner.cases()):
        raise GraftConfigError("no conformance cases match the given --op/--family/--tags/--dtype")
    if options.impls and set(options.impls) <= {"torch"}:
        raise GraftConfigError("--impl torch: torch is the reference every implementation is checked against; "
                               "name a backend to check (e.g. --impl triton)")
    report = runner.run()
    paths = write_reports(report, args.out, json_only=args.json_only)
    print()
    print(summary_table(report))
    for note in report.notes:
        print(f"note: {note}")
    for case, impl, message in report.failures:
        print(f"\nFAILED {message}", file=sys.stderr)
    counts = report.counts()
    print(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, {counts['skipped']} skipped")
    grads = report.grad_counts()
    if grads is not None:
        print(f"gradients: {grads['pass']} passed, {grads['fail']} failed, {grads['error']} errors, "
              f"{grads['skipped']} skipped (no backward)")
    for kind, path in paths.items():
        print(f"report ({kind}): {path}")
    return report.exit_code
