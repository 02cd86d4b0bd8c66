"""The ``graft`` command line. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import sys

from graft import __version__
from graft.errors import GraftError

SUBCOMMANDS = {
    "info": ("graft.tools.info", "show plugins, ops, implementations and what would be selected here, and why"),
    "conformance": ("graft.tools.conformance.cli", "check implementations against their baselines and write a report"),
    "patches": ("graft.tools.patches.cli", "generate and check upstream-contribution patches"),
    "bench": ("graft.tools.bench.overhead", "measure graft's own overhead against the frameworks without it"),
    "tune": ("graft.tools.tune", "measure graft's implementations against the framework's own on this device; write a tuning table"),
    "bench-kernels": ("graft.tools.bench.kernels", "time graft's kernels against library baselines on model shapes"),
    "profile": ("graft.tools.profile", "run a command with torch.profiler and graft's op ranges; report where time went"),
    "fuzz": ("graft.tools.fuzz", "hostile layouts, reload races, double backward and gradcheck over every op, in bounded time"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported: `graft info` stays cheap."""
    parser = argparse.ArgumentParser(prog="graft", description="graft: hardware backend adapter for ML frameworks")
    parser.add_argument("--version", action="version", version=f"graft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except GraftError as exc:
        print(f"graft {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
