"""How ``graft profile`` starts a recorder in each process of the job it runs: the
command's environment carries the settings and a PYTHONPATH entry whose
``sitecustomize`` calls :func:`start_from_environment` when the interpreter starts.

Nothing is imported here until torch is (a launcher that never imports torch, such as
torchrun's parent or a shell helper, costs nothing and writes nothing); then the step
sources are installed, and the window opens at once with ``--warmup 0``.
"""
from __future__ import annotations

import atexit
import os
import sys

from graft import settings
from graft.after_import import after_import

# Declared in graft.settings; read from os.environ when the interpreter starts (before a job
# may set other GRAFT_* variables and import graft, so not through graft's snapshot).
DIR_VAR, STEPS_VAR, WARMUP_VAR = "GRAFT_PROFILE_DIR", "GRAFT_PROFILE_STEPS", "GRAFT_PROFILE_WARMUP"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")


def environment(out: str, steps: int, warmup: int, base: dict | None = None) -> dict:
    """The environment of a profiled command (``base``: os.environ)."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOT_DIR + (os.pathsep + path if path else "")
    env[DIR_VAR], env[STEPS_VAR], env[WARMUP_VAR] = os.path.abspath(out), str(steps), str(warmup)
    return env


def start_from_environment() -> None:
    out = settings.raw(DIR_VAR, os.environ)
    if not out:
        return
    steps, warmup = settings.get(STEPS_VAR, os.environ), settings.get(WARMUP_VAR, os.environ)
    if "torch" in sys.modules:
        _begin(out, steps, warmup)
    else:
        after_import("torch", lambda module: _begin(out, steps, warmup))


def _begin(out: str, steps: int, warmup: int) -> None:
    try:  # runs inside the job's own `import torch`: a failure here must not become the job's
        from graft.profiling import session

        session.begin(out, steps=steps, warmup=warmup)
        atexit.register(session.finish_at_exit)
    except Exception as exc:
        print(f"[graft profile] not profiling process {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
