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

from graft.after_import import after_import
from graft.config import declare_env_var

DIR_VAR = declare_env_var("GRAFT_PROFILE_DIR", "set by graft profile: the folder each process of the job records into")
STEPS_VAR = declare_env_var("GRAFT_PROFILE_STEPS", "set by graft profile: steps in each process's window (0: to exit)")
WARMUP_VAR = declare_env_var("GRAFT_PROFILE_WARMUP", "set by graft profile: steps before the window opens")
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")


def environment(out: str, steps: int, warmup: int, base: dict | None = None) -> dict:
    """The environment of a profiled command (``base``: os.environ)."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOT_DIR + (os.pathsep + path if path else "")
    env[DIR_VAR], env[STEPS_VAR], env[WARMUP_VAR] = os.path.abspath(out), str(steps), str(warmup)
    return env


def start_from_environment() -> None:
    out = os.environ.get(DIR_VAR)
    if not out:
        return
    steps, warmup = int(os.environ.get(STEPS_VAR, "0")), int(os.environ.get(WARMUP_VAR, "0"))
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
