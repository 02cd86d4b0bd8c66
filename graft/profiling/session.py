"""The profile of one process: torch.profiler on for a window of steps, graft's op ranges
on while it records, and what the window leaves in the profile's folder.

A *step* is a boundary the process reaches once per iteration of its loop: an optimizer's
``step()`` (any ``torch.optim.Optimizer``: plain loops, DeepSpeed, Megatron-core,
TorchTitan), a vLLM engine step that ran the model, or :func:`graft.profiling.step` called
by the user's own loop. The first source to fire in a process is the one counted (a
DeepSpeed step that also steps an inner optimizer counts once). The window opens after
``warmup`` steps (0: at once) and closes after ``steps`` more (0: when the process exits
or the ``with`` block ends).

Each process writes, named by its label (``rank<R>-pid<P>`` under torch.distributed, else
``pid<P>``: a process forked from a rank has a label of its own): ``<label>.trace.json``
(Chrome/Perfetto), ``<label>.summary.json`` (what the process measured: its steps' wall
times, the trace's name) and ``<label>.shapes.json``. The process only records: reading the
trace and attributing its window (:mod:`graft.profiling.analysis`) is the report's work
(:mod:`graft.profiling.report`), in ``graft profile``'s own process.

Nothing the recorder does may break the job it records: an exception inside it (a step
hook, the window's end, a fork, the exit hook) is reported once on stderr, the recording
stops, and the job goes on (:func:`_contained`).
"""
from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from graft.profiling import ranges, shapes
from graft.after_import import after_import


class Recorder:
    """One process's window. ``start_now``: open at once (the ``with`` API, ``--warmup 0``)."""

    def __init__(self, out, steps: int = 0, warmup: int = 0, role: str | None = None):
        if steps < 0 or warmup < 0:
            raise ValueError(f"steps and warmup must be >= 0, got steps={steps}, warmup={warmup}")
        self.out = Path(out)
        self.steps, self.warmup, self.role = steps, warmup, role
        self.pid = os.getpid()
        self.source = None  # the step source counted in this process
        self.seen = 0  # step boundaries counted before the window opened
        self.prof: Any = None  # torch.profiler.profile while the window is open
        self.t0 = 0.0
        self.marks: list = []  # perf_counter of each step boundary inside the window
        self.finished = False
        self.forked = False  # a forked child's recorder (set by the at-fork hook)
        self.note = ""
        ranges.install()

    # -- steps -----------------------------------------------------------------------------
    def step(self, source) -> None:
        if self.finished or os.getpid() != self.pid:
            return
        if self.source is None:
            self.source = source
        elif source != self.source:
            return
        if self.prof is None:
            self.seen += 1
            if self.seen >= self.warmup:
                self.start()
            return
        self.marks.append(time.perf_counter())
        _mark(len(self.marks))
        if self.steps and len(self.marks) >= self.steps:
            self.finish()

    # -- window ----------------------------------------------------------------------------
    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():  # CUDA and ROCm (HIP kernels come through the same activity)
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities, record_shapes=True)
        _mark(0)  # before recording: the first range in a process pays one-time set-up costs
        self.prof.start()
        with torch.profiler.record_function("graft.profile/start"):  # the recording thread's first event
            pass  # (its one-time set-up must not land between the clock and mark 0)
        self.t0 = time.perf_counter()  # the clock, then the mark: wall and trace span run between the same points
        _mark(0)

    def finish(self, note: str = "") -> None:
        """Close the window (if open) and write this process's files."""
        if self.finished or os.getpid() != self.pid:
            return
        self.finished = True
        ranges.uninstall()
        if self.prof is None:
            self.note = note or f"the window never opened: {self.seen} step(s) seen, warmup {self.warmup}"
            self._write_meta(None)
            return
        if not self.steps or len(self.marks) < self.steps:
            self.marks.append(time.perf_counter())
            _mark(len(self.marks))
            self.note = note
        self.prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        label = self.label()
        trace = self.out / f"{label}.trace.json"
        self.prof.export_chrome_trace(str(trace))  # torch writes it (C++); nothing here reads it back
        self.prof = None
        shapes.write(self.out / f"{label}.shapes.json", ranges.records())
        self._write_meta({"window": None, "analysis": "pending", "wall_us": (self.marks[-1] - self.t0) * 1e6,
                          "window_steps": len(self.marks)}, trace.name)

    def label(self) -> str:
        rank = _rank()
        return f"rank{rank}-pid{self.pid}" if rank is not None else f"pid{self.pid}"

    def _write_meta(self, summary, trace_name: str | None = None) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "label": self.label(), "pid": self.pid, "rank": _rank(), "host": socket.gethostname(),
            "role": self.role or _role(self.source), "argv": list(sys.argv), "trace": trace_name,
            "step_source": str(self.source[0]) if self.source else None, "steps": self.steps,
            "warmup": self.warmup, "note": self.note,
            "step_wall_us": [round((b - a) * 1e6, 1) for a, b in zip([self.t0] + self.marks, self.marks)],
        }
        meta.update(summary or {"window": None})
        path = self.out / f"{self.label()}.summary.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path)


def _mark(index: int) -> None:
    import torch

    with torch.profiler.record_function(f"{ranges.STEP_PREFIX}{index}"):
        pass


def _rank():
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # no torch.distributed: the launcher's variable, if any
        pass
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None


def _role(source) -> str:
    if source is None:
        return "process (no steps)"
    return {"vllm": "vLLM engine core", "vllm-worker": "vLLM worker (runs the model)", "optimizer": "training rank",
            "user": "user loop"}.get(source[0], source[0])


# -- the process's one recorder and its step sources ------------------------------------------
current: Recorder | None = None
_failed: list = []  # the first failure of this process's recorder, once reported


def _stop_after_failure(exc: BaseException, where: str) -> None:
    """The recorder failed: say so once, stop recording, leave the job alone."""
    global current
    live, current = current, None
    if not _failed:
        _failed.append(f"{type(exc).__name__}: {exc}")
        try:
            print(f"[graft profile] process {os.getpid()}: the recorder failed in {where} and stopped recording "
                  f"(the job goes on): {type(exc).__name__}: {exc}", file=sys.stderr)
        except Exception:
            pass
    try:
        if live is not None:
            live.finished = True
            if live.prof is not None:
                prof, live.prof = live.prof, None
                prof.stop()
    except Exception:
        pass
    try:  # the report names the process and why it has no profile
        if live is not None and live.pid == os.getpid():
            live.note = f"recording failed in {where}: {type(exc).__name__}: {exc}"
            live._write_meta(None)
    except Exception:
        pass
    try:
        ranges.uninstall()
    except Exception:
        pass


def _contained(fn):
    """``fn`` never raises into the job's code (an optimizer's step, vLLM's engine, a fork,
    the interpreter's exit): see :func:`_stop_after_failure`."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            _stop_after_failure(exc, fn.__name__)
    return run


@_contained
def step(source=("user",)) -> None:
    """Mark a step boundary (``graft.profiling.step()`` in a loop without an optimizer)."""
    if current is not None:
        current.step(source)


@_contained
def _optimizer_stepped(optimizer, args, kwargs) -> None:
    if current is not None:
        current.step(("optimizer", id(optimizer)))


_hooks: list = []


def install_step_sources() -> None:
    """Count optimizer steps (a global post-step hook) and vLLM engine steps (wrapped when
    vLLM's engine core is imported). Installed once per process."""
    if _hooks:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _hooks.append(register_optimizer_step_post_hook(_optimizer_stepped))
    after_import("vllm.v1.engine.core", _wrap_vllm_steps)
    after_import("vllm.v1.worker.worker_base", _wrap_vllm_worker_steps)


@_contained
def _wrap_vllm_steps(module) -> None:
    engine = getattr(module, "EngineCore", None)
    for name in ("step", "step_with_batch_queue"):
        original = getattr(engine, name, None)
        if original is None or getattr(original, "_graft_profiled", False):
            continue

        def counted(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            # (outputs, model_executed): only a step that ran the model is one
            if not (isinstance(result, tuple) and len(result) == 2 and result[1] is False):
                step(("vllm",))
            return result

        setattr(counted, "_graft_profiled", True)
        setattr(engine, name, counted)


@_contained
def _wrap_vllm_worker_steps(module) -> None:
    """A vLLM worker's step starts with each ``execute_model`` that runs the model (the
    sampling that follows belongs to it)."""
    wrapper: Any = getattr(module, "WorkerWrapperBase", None)
    original = getattr(wrapper, "execute_model", None)
    if original is None or getattr(original, "_graft_profiled", False):
        return

    def counted(self, scheduler_output, *args, **kwargs):
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0:
            step(("vllm-worker",))
        return original(self, scheduler_output, *args, **kwargs)

    setattr(counted, "_graft_profiled", True)
    setattr(wrapper, "execute_model", counted)


def begin(out, steps: int = 0, warmup: int = 0, role: str | None = None) -> Recorder:
    """Start this process's recorder (the window opens now when ``warmup`` is 0)."""
    global current
    if current is not None and not current.finished and current.pid == os.getpid():
        raise RuntimeError(f"a graft profile is already recording in this process (into {current.out})")
    install_step_sources()
    current = Recorder(out, steps=steps, warmup=warmup, role=role)
    if warmup == 0:
        current.start()
    return current


@_contained
def finish_at_exit() -> None:
    """Write what the window holds when the process ends before it closed."""
    live = current
    if live is None or live.pid != os.getpid() or live.finished:
        return
    if live.prof is None and live.forked and live.seen == 0:
        ranges.uninstall()  # a forked helper (a DataLoader worker) that never stepped: nothing to report
        live.finished = True
        return
    if live.prof is None:
        live.finish(f"no window: the process exited after {live.seen} step(s), before the {live.warmup} warm-up "
                    "step(s) were over" if live.seen else "no window: the process made no step (an optimizer "
                    "step, a vLLM engine step or graft.profiling.step())")
    else:
        live.finish(f"the process exited after {len(live.marks)} of {live.steps or 'unlimited'} step(s) "
                    "of the window")


@_contained
def _after_fork_in_child() -> None:
    """A forked child (vLLM's engine core, a DataLoader worker) starts its own window: the
    parent's profiler state is not the child's to stop."""
    global current
    parent = current
    _failed.clear()
    if parent is None or parent.finished:
        return
    if parent.prof is not None:
        current = None  # forked mid-window: kineto's threads did not come along; record nothing here
        return
    current = Recorder(parent.out, steps=parent.steps, warmup=parent.warmup)
    current.forked = True
    if parent.warmup == 0:
        current.start()
    # multiprocessing's children leave through os._exit (no atexit): its own exit hook
    from multiprocessing import util

    util.Finalize(None, finish_at_exit, exitpriority=100)


os.register_at_fork(after_in_child=_after_fork_in_child)
