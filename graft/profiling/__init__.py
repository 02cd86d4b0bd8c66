"""``graft profile``: where a job's time goes, which graft kernel served it, and what a
faster one would buy.

* :func:`profile` - ``with graft.profile("prof"):`` around a user's own loop;
* :func:`step` - mark a step boundary in a loop that has no optimizer;
* ``graft profile [--out DIR] [--steps N] -- <command...>`` (:mod:`graft.tools.profile`) -
  every Python process of a command (vLLM's engine core, each torch.distributed rank).

Importing this package stays light (no torch): the command line imports it into every
process of the job it starts.
"""
from __future__ import annotations

import contextlib


def step() -> None:
    """Mark a step boundary of the current profile (no-op when nothing records)."""
    from graft.profiling import session

    session.step()


@contextlib.contextmanager
def profile(out: str = "graft-profile", steps: int = 0, warmup: int = 0):
    """Profile the ``with`` block of this process into ``out``.

    The window opens after ``warmup`` steps (optimizer steps, vLLM engine steps or
    :func:`step` calls; 0: at once) and closes after ``steps`` more (0: at the end of the
    block). On exit ``out`` holds this process's trace, ``profile.json``, ``profile.html``
    and ``shapes.json`` (over every process that wrote into ``out`` so far: ranks that each
    use this block in one folder are merged, the last to finish writing the complete report).
    Yields the process's recorder.
    """
    from graft.profiling import report, session

    recorder = session.begin(out, steps=steps, warmup=warmup)
    try:
        yield recorder
    finally:
        # the block's own exception (if any) is the one that propagates: the profile's never does
        try:
            if session.current is recorder:
                recorder.finish()
        except Exception as exc:
            session._stop_after_failure(exc, "graft.profile")
        try:
            report.write(out)
        except Exception as exc:
            import sys

            print(f"[graft profile] the report in {out} could not be written: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
