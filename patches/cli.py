"""``graft patches``: list templates, generate patches, check them against a source tree."""
from __future__ import annotations

import sys

from graft.patches.versions import FRAMEWORKS


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="patches_command", metavar="ACTION")
    sub.add_parser("list", help="list the installed patch templates")
    gen = sub.add_parser("generate", help="write git format-patch files for a framework's source tree")
    gen.add_argument("framework", choices=FRAMEWORKS)
    gen.add_argument("--source", required=True, help="upstream checkout (or unpacked sdist) to patch")
    gen.add_argument("--out", required=True, help="directory for the .patch files")
    gen.add_argument("--upstream-version", help="the source's version, when it cannot be read from the tree")
    gen.add_argument("--template", action="append", help="only these templates (repeatable)")
    gen.add_argument("--conformance", help="graft conformance JSON report whose results go into the messages")
    gen.add_argument("--author", help="'Name <email>' for the commits (default: the template's)")
    chk = sub.add_parser("check", help="check that patches apply cleanly and the patched tree imports")
    chk.add_argument("--source", required=True, help="upstream checkout to check against")
    chk.add_argument("--patches", required=True, help="directory of .patch files")
    chk.add_argument("--upstream-version", help="the source's version, when it cannot be read from the tree")
    chk.add_argument("--no-import", action="store_true", help="skip importing the patched modules")


def run(args) -> int:
    action = getattr(args, "patches_command", None)
    if action == "list":
        from graft.patches.generate import available_templates

        for t in available_templates():
            print(f"{t.name:<28} {t.framework:<10} {t.supported:<14} {t.subject}")
        return 0
    if action == "generate":
        from graft.patches.generate import generate

        paths = generate(args.framework, args.source, args.out, args.upstream_version, args.template,
                         args.conformance, args.author)
        for p in paths:
            print(p)
        return 0
    if action == "check":
        return _check(args)
    print("graft patches: choose an action: list, generate or check", file=sys.stderr)
    return 2


def _check(args) -> int:
    from graft.patches.check import check

    report = check(args.source, args.patches, args.upstream_version, import_check=not args.no_import)
    for framework, version in report.version.items():
        print(f"source: {framework} {version}")
    for p in report.patches:
        print(f"  {p.status:<16} {p.patch}" + (f"\n      {p.detail}" if p.detail and p.status != "applies" else ""))
    for path, error in report.compiled:
        print(f"  {'compiles' if error is None else 'SYNTAX ERROR':<16} {path}" + (f"\n      {error}" if error else ""))
    for module, error in report.imports:
        print(f"  {'imports' if error is None else 'IMPORT FAILS':<16} {module}" + (f"\n      {error}" if error else ""))
    print("OK: patches apply cleanly" if report.ok else "FAILED")
    return 0 if report.ok else 1


