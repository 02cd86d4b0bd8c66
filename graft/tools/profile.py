"""``graft profile [--out DIR] [--steps N] [--warmup W] -- <command...>`` and
``graft profile --compare A.json B.json``."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from graft.errors import GraftConfigError


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="graft-profile", help="folder for the traces and the report "
                        "(default: graft-profile; its earlier profile files are replaced)")
    parser.add_argument("--steps", type=int, default=3, help="steps in the window (default 3; 0: until the "
                        "process exits)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the window opens (default 1: the "
                        "first step's compilation and allocation stay out; 0: open when torch is imported)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="show two profiles (profile.json files "
                        "or their folders) side by side instead of running anything")
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the Python command to profile (python script.py ..., torchrun ..., deepspeed ...)")


def run(args) -> int:
    from graft.profiling import boot, report

    if args.compare:
        for path in args.compare:
            if not Path(path).exists():
                raise GraftConfigError(f"--compare: {path} does not exist (give profile.json files or their folders)")
        a, b = (report.load(p) for p in args.compare)
        print(report.compare(a, b, names=("A", "B")))
        return 0
    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise GraftConfigError("no command to profile: graft profile [--out DIR] [--steps N] -- python train.py ...")
    if args.steps < 0 or args.warmup < 0:
        raise GraftConfigError(f"--steps and --warmup must be >= 0, got --steps {args.steps} --warmup {args.warmup}")
    if shutil.which(command[0]) is None and not Path(command[0]).exists():
        raise GraftConfigError(f"command not found: {command[0]!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.summary.json")) + list(out.glob("*.trace.json")) + list(out.glob("*.shapes.json")):
        old.unlink()  # a folder holds one profile: an earlier run's processes must not merge into this one
    env = boot.environment(str(out), args.steps, args.warmup)
    print(f"graft profile: running {' '.join(command)} (window: {args.steps or 'all'} step(s) after "
          f"{args.warmup} warm-up step(s); every Python process of the command records)", file=sys.stderr)
    proc = subprocess.Popen(command, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the job gets the interrupt too (same process group); let it write and leave
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    profile = report.write(out, command=command)
    recorded = [p for p in profile["processes"] if p.get("window")]
    for p in profile["processes"]:
        if not p.get("window"):
            print(f"graft profile: {p['label']} ({p['role']}): {p.get('note')}", file=sys.stderr)
    if not recorded:
        print("graft profile: no process recorded a window. A step is an optimizer step, a vLLM engine step or a "
              "graft.profiling.step() call; use --warmup 0 --steps 0 to profile a command without steps from start "
              "to exit", file=sys.stderr)
        return code or 1
    print(f"graft profile: {len(recorded)} process(es) recorded; open {os.path.join(str(out), 'profile.html')} "
          f"(command exit status {code})", file=sys.stderr)
    return code
