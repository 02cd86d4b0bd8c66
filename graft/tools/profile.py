"""``graft profile [--out DIR] [--steps N] [--warmup W] -- <command...>`` and
``graft profile --compare A.json B.json``.

The command's processes only record (each writes its trace and what it measured); this
process reads the traces and writes the report once the command has ended
(:mod:`graft.profiling.report`).

``--out`` is never a place where a file graft did not write is lost: graft writes into an
empty (or new) folder, or into one holding only its own earlier profile of the same
command, as its manifest (:data:`MANIFEST`) lists it; anything else is refused with the
reason, and nothing is deleted.

The command runs in a process group of its own. Ctrl-C is passed to it (its processes
write what they recorded and the report follows); a second Ctrl-C ends it (SIGTERM to its
group, then SIGKILL to whatever is left after a grace period). The exit status is the
command's: ``128 + N`` when signal N killed it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from graft.errors import GraftConfigError

MANIFEST = "graft-profile-manifest.json"
MANIFEST_FORMAT = "graft-profile-manifest/1"
REPORT_FILES = ("profile.json", "profile.html", "trace.json", "shapes.json")
# what each recording process writes (graft.profiling.session): <label>.{trace,summary,shapes}.json
PROCESS_FILE = re.compile(r"^(rank\d+-)?pid\d+\.(trace|summary|shapes)\.(json|tmp)$")
GRACE_S = 5.0  # after the second Ctrl-C: SIGTERM, this long, then SIGKILL


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="graft-profile", help="folder for the traces and the report (default: "
                        "graft-profile); created if missing; an earlier profile of the same command in it is "
                        "replaced, and a folder holding anything else is refused (nothing is deleted)")
    parser.add_argument("--steps", type=int, default=3, help="steps in the window (default 3; 0: until the "
                        "process exits)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the window opens (default 1: the "
                        "first step's compilation and allocation stay out; 0: open when torch is imported)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="show two profiles (profile.json files "
                        "or their folders) side by side instead of running anything")
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the Python command to profile (python script.py ..., torchrun ..., deepspeed ...)")


def _compare(paths) -> int:
    from graft.profiling import report

    loaded = []
    for path in paths:
        if not Path(path).exists():
            raise GraftConfigError(f"--compare: {path} does not exist (give profile.json files or their folders)")
        try:
            loaded.append(report.load(path))
        except ValueError as exc:
            raise GraftConfigError(f"--compare: {exc}; give profile.json files graft profile wrote "
                                   "(or their folders)") from None
    try:
        text = report.compare(loaded[0], loaded[1], names=("A", "B"))
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        raise GraftConfigError(f"--compare: {paths[0]} or {paths[1]} is a damaged graft profile "
                               f"({type(exc).__name__}: {exc}); write it again with graft profile") from None
    print(text)
    return 0


def _prepare_out(out: Path, command: list) -> None:
    """Make ``out`` ready for this run, or refuse it (see the module's docstring)."""
    if out.exists() and not out.is_dir():
        raise GraftConfigError(f"--out {out}: is a file, not a folder; give a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".graft-profile-probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise GraftConfigError(f"--out {out}: cannot write there ({exc.strerror or exc}); give a folder this user "
                               "can create and write") from None
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        _write_manifest(out, command, [], complete=False)
        return
    manifest_path = out / MANIFEST
    if MANIFEST not in entries:
        raise GraftConfigError(
            f"--out {out}: the folder is not empty ({len(entries)} entries, e.g. {', '.join(entries[:3])}) and holds "
            f"no profile graft wrote ({MANIFEST} is missing); graft profile writes only into an empty folder or one "
            "holding its own earlier profile of the same command. Nothing was deleted: give another --out "
            "(it is created)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT \
                or not isinstance(manifest.get("files"), list):
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
    except (OSError, ValueError) as exc:
        raise GraftConfigError(f"--out {out}: {MANIFEST} is unreadable ({exc}); nothing was deleted: give another "
                               "--out, or empty that folder yourself") from None
    if manifest.get("command") != command:
        raise GraftConfigError(
            f"--out {out}: holds graft's profile of another command ({' '.join(map(str, manifest.get('command') or []))!r}); "
            "nothing was deleted: give another --out to keep it, or delete that folder to replace it")
    ours = {name for name in manifest["files"] if isinstance(name, str) and "/" not in name and name not in ("", ".", "..")}
    ours.add(MANIFEST)
    if not manifest.get("complete"):  # that run ended before listing its processes' files
        ours.update(name for name in entries if PROCESS_FILE.match(name))
    foreign = [name for name in entries if name not in ours or not (out / name).is_file() or (out / name).is_symlink()]
    if foreign:
        raise GraftConfigError(
            f"--out {out}: holds graft's earlier profile of this command and also {len(foreign)} entr"
            f"{'y' if len(foreign) == 1 else 'ies'} graft did not write ({', '.join(foreign[:5])}); nothing was "
            "deleted: give another --out, or move those away")
    for name in entries:
        if name != MANIFEST:
            (out / name).unlink()  # graft's own earlier output, as its manifest lists it
    _write_manifest(out, command, [], complete=False)


def _write_manifest(out: Path, command: list, files: list, complete: bool) -> None:
    path = out / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "command": command, "complete": complete,
                               "written": time.strftime("%Y-%m-%d %H:%M:%S"), "files": sorted(files)},
                              indent=1) + "\n")
    os.replace(tmp, path)


def _written_files(out: Path) -> list:
    """What this run wrote in ``out`` (it held none of these names when the run began)."""
    return [p.name for p in out.iterdir() if p.is_file() and (p.name in REPORT_FILES or PROCESS_FILE.match(p.name))]


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end(proc) -> None:
    """End the command's whole process group: SIGTERM, then SIGKILL after :data:`GRACE_S`."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third Ctrl-C must not cut this short
    try:
        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                break
            time.sleep(0.05)
        _signal_group(proc, signal.SIGKILL)  # whatever is left of the group (a rank that ignored SIGTERM)
        proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait(proc) -> tuple:
    """The command's return code, and whether graft ended it (a second Ctrl-C)."""
    interrupts = 0
    while True:
        try:
            return proc.wait(), interrupts > 1
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 1:
                print("\ngraft profile: Ctrl-C passed to the command (its processes write what they recorded); "
                      "Ctrl-C again ends it", file=sys.stderr)
                _signal_group(proc, signal.SIGINT)
            else:
                print(f"\ngraft profile: ending the command (SIGTERM to its processes, SIGKILL after {GRACE_S:g} s)",
                      file=sys.stderr)
                _end(proc)


def _status(code: int) -> tuple:
    """The exit status to pass on (a shell's 128 + N for signal N) and a hint, or None."""
    if code >= 0:
        return code, None
    sig = -code
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    hint = f"the command was killed by {name} (exit status {128 + sig})"
    if sig == signal.SIGKILL:
        hint += ": by the kernel's out-of-memory killer, a job scheduler or a user; see dmesg or the scheduler's log"
    hint += ". A process killed before its window closed wrote no profile; the report has the processes that did"
    return 128 + sig, hint


def run(args) -> int:
    from graft.profiling import boot, report

    if args.compare:
        return _compare(args.compare)
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
    _prepare_out(out, command)
    env = boot.environment(str(out), args.steps, args.warmup)
    print(f"graft profile: running {' '.join(command)} (window: {args.steps or 'all'} step(s) after "
          f"{args.warmup} warm-up step(s); every Python process of the command records)", file=sys.stderr)
    previous_term = signal.getsignal(signal.SIGTERM)
    proc = subprocess.Popen(command, env=env, process_group=0)
    # graft profile ended by SIGTERM (a scheduler, `timeout`): the command is asked to end too
    signal.signal(signal.SIGTERM, lambda signum, frame: _signal_group(proc, signal.SIGTERM))
    try:
        code, ended = _wait(proc)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    status, hint = _status(code)
    if ended:
        print(f"graft profile: the command was ended (exit status {status}); writing the report of what its "
              "processes recorded (Ctrl-C skips it)", file=sys.stderr)
    try:
        profile = report.write(out, command=command)
    except KeyboardInterrupt:
        print(f"graft profile: report skipped; the processes' own files are in {out}", file=sys.stderr)
        return status or 130
    except OSError as exc:
        print(f"graft profile: error: could not write the report in {out}: {exc}", file=sys.stderr)
        return status or 1
    finally:
        try:
            _write_manifest(out, command, _written_files(out), complete=True)
        except OSError:
            pass
    for warning in profile.get("warnings") or []:
        print(f"graft profile: warning: {warning}", file=sys.stderr)
    recorded = [p for p in profile["processes"] if p.get("window")]
    for p in profile["processes"]:
        if not p.get("window"):
            print(f"graft profile: {p['label']} ({p['role']}): {p.get('note')}", file=sys.stderr)
    if hint:
        print(f"graft profile: {hint}", file=sys.stderr)
    if not recorded:
        if hint is None and status == 0:
            print("graft profile: no process recorded a window. A step is an optimizer step, a vLLM engine step or "
                  "a graft.profiling.step() call; use --warmup 0 --steps 0 to profile a command without steps from "
                  "start to exit", file=sys.stderr)
        elif hint is None:
            print(f"graft profile: no process recorded a window; the command exited with status {status}",
                  file=sys.stderr)
        return status or 1
    print(f"graft profile: {len(recorded)} process(es) recorded; open {os.path.join(str(out), 'profile.html')} "
          f"(command exit status {status})", file=sys.stderr)
    return status