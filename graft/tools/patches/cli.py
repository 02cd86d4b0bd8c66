"""``graft patches``: list templates, generate patches, check them against a source tree."""
from __future__ import annotations

import sys
import warnings


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="patches_command", metavar="ACTION")
    sub.add_parser("list", help="list the installed patch templates")
    exp = sub.add_parser("explain", help="per patch of a project: why upstream would want it, where it runs, "
                                         "what it tests and what graft drops once it is merged")
    exp.add_argument("framework", help="the upstream project (vllm, deepspeed, megatron or one a plugin adds)")
    gen = sub.add_parser("generate", help="write git format-patch files for a framework's source tree")
    gen.add_argument("framework", help="the upstream project (vllm, deepspeed, megatron or one a plugin adds)")
    gen.add_argument("--source", required=True, help="upstream checkout (or unpacked sdist) to patch")
    gen.add_argument("--out", required=True, help="directory for the .patch files")
    gen.add_argument("--upstream-version", help="the source's version, when it cannot be read from the tree")
    gen.add_argument("--template", action="append", help="only these templates (repeatable)")
    gen.add_argument("--conformance", help="graft conformance JSON report whose results go into the messages")
    gen.add_argument("--bench-results", metavar="JSON",
                     help="graft/tools/bench/kernels.py results from a GPU (kernels-<tag>.json): kernel patches are generated "
                          "only with it, their messages quote its numbers")
    gen.add_argument("--author", help="'Name <email>' for the commits (required with --signoff)")
    gen.add_argument("-s", "--signoff", action="store_true", help="add a DCO Signed-off-by line for --author")
    gen.add_argument("-v", "--reroll-count", type=int, metavar="N", help="mark the series as version N ([PATCH vN])")
    gen.add_argument("--cover-letter", action="store_true", default=None,
                     help="write a cover letter (always written for a series of more than one patch)")
    gen.add_argument("--allow-dirty", action="store_true", help="generate against HEAD of a tree with uncommitted changes")
    gen.add_argument("--graft-trailers", action="store_true", help="add Graft-* trailers (graft-internal; not for upstream)")
    gen.add_argument("--no-format", action="store_true",
                     help="do not run the project's own formatters on the changed files (they are installed on first use)")
    chk = sub.add_parser("check", help="check that patches apply to the tree on disk, pass the project's "
                                       "linters, import and pass their tests")
    chk.add_argument("--source", required=True, help="upstream checkout to check against")
    chk.add_argument("--patches", required=True, help="directory of .patch files")
    chk.add_argument("--upstream-version", help="the source's version, when it cannot be read from the tree")
    chk.add_argument("--no-import", action="store_true", help="skip importing the patched modules")
    chk.add_argument("--no-lint", action="store_true", help="skip the project's linters")
    chk.add_argument("--no-tests", action="store_true", help="skip the patch's and the nearest upstream tests")
    chk.add_argument("-v", "--verbose", action="store_true", help="show linter and test output even when they pass")


def run(args) -> int:
    action = getattr(args, "patches_command", None)
    if action == "list":
        from graft.tools.patches.generate import available_templates

        for t in available_templates():
            print(f"{t.name:<28} {t.framework:<10} {t.supported:<14} {t.subject}")
            print(f"{'':<28} upstream: {t.upstream}")
        return 0
    if action == "generate":
        from graft.tools.patches.generate import generate

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paths = generate(args.framework, args.source, args.out, args.upstream_version, args.template,
                             args.conformance, args.author, signoff=args.signoff, reroll=args.reroll_count,
                             cover_letter=args.cover_letter, allow_dirty=args.allow_dirty,
                             graft_trailers=args.graft_trailers, format_code=not args.no_format,
                             bench_results=args.bench_results)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        for p in paths:
            print(p)
        return 0
    if action == "explain":
        from graft.tools.patches.explain import explain

        print(explain(args.framework), end="")
        return 0
    if action == "check":
        return _check(args)
    print("graft patches: choose an action: list, explain, generate or check", file=sys.stderr)
    return 2


def _indent(text: str, limit: int = 40) -> str:
    lines = text.strip().splitlines()
    more = [f"... ({len(lines) - limit} more lines)"] if len(lines) > limit else []
    return "\n".join("      " + line for line in lines[:limit] + more)


def _check(args) -> int:
    from graft.tools.patches.check import APPLIES, check

    report = check(args.source, args.patches, args.upstream_version, import_check=not args.no_import,
                   lint=not args.no_lint, run_tests=not args.no_tests)
    for framework, version in report.version.items():
        print(f"source: {framework} {version}")
    for warning in report.warnings:
        print(f"warning: {warning}")
    for p in report.patches:
        print(f"  {p.status:<16} {p.patch}" + (f"\n{_indent(p.detail)}" if p.detail and p.status != APPLIES else ""))
    for path, error in report.compiled:
        print(f"  {'compiles' if error is None else 'SYNTAX ERROR':<16} {path}" + (f"\n      {error}" if error else ""))
    for module, error in report.imports:
        print(f"  {'imports' if error is None else 'IMPORT FAILS':<16} {module}" + (f"\n{_indent(error)}" if error else ""))
    for result in report.lint:
        print(f"  {'lint clean' if result.ok else 'LINT FAILS':<16} {result.tool}: {' '.join(result.paths)}")
        if result.output and (not result.ok or args.verbose):
            print(_indent(result.output))
    for run_ in report.tests:
        verdict = "TESTS FAIL" if not run_.ok else "NOT CHECKED" if run_.not_checked else "tests pass"
        print(f"  {verdict:<16} {run_.summary} ({run_.tally()})")
        if run_.baseline is not None:
            print(f"      unpatched tree: {run_.baseline}; "
                  + (f"{len(run_.regressions)} new failures: {', '.join(run_.regressions[:10])}"
                     if run_.regressions else "not checked: none of them passes here" if run_.not_checked
                     else "no new failures"))
        for f in run_.files:
            print(f"      {f}")
        if run_.output and (not run_.ok or args.verbose):
            print(_indent(run_.output, 60))
    failures = report.failures()
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    checked = ["patches apply"]
    checked += ["linters pass"] if report.lint else []
    for t in report.tests:
        if t.baseline is None:
            checked.append(f"new tests pass ({t.tally()})")
        elif t.not_checked:
            checked.append(f"existing upstream tests: not checked ({t.tally()}: none passes here)")
        else:
            checked.append(f"existing upstream tests: no new failures ({t.tally()}; unpatched: {t.baseline})")
    print("OK: " + ", ".join(checked) + (" (with warnings above)" if report.warnings else ""))
    return 0
