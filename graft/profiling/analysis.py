"""Where a window's time went, from one process's Chrome trace (torch.profiler's export).

The *host timeline* is the thread that marked the steps (the one running the loop). Each
instant of the window on it is given to exactly one owner, so the owners' totals add up to
the window:

1. the innermost graft op range (``graft/<op>/<backend>/<bucket>``): that op on that backend
   (a collectives op counts as communication);
2. else a communication op on the thread (``c10d::allreduce_``, ``nccl:*``, ``gloo:*``...):
   exposed communication;
3. else the outermost framework op (``aten::linear``, an autograd node): that op;
4. else a collective running on another thread or stream while this one waits for it:
   exposed communication ("waiting for ...");
5. else an idle/host gap (Python between ops, data loading, waiting on anything else).

Communication *overlapped* with compute is the time collectives ran (on gloo's or NCCL's
threads and streams) while the host timeline was computing (1 or 3): hidden, so it costs
nothing but shows how much of each collective the job manages to hide.

Where the trace has device kernels (CUDA/ROCm), the *device timeline* is attributed too:
each kernel's time goes to the owner of the host instant that launched it (matched by
correlation id), and device time no kernel covers is device idle.
"""
from __future__ import annotations

import functools
import re
from bisect import bisect_left, bisect_right
from collections import defaultdict

from graft.profiling import ranges

# Communication ops by the names torch.distributed's backends give them (the host-side
# c10d op, the backend's own range, NCCL/RCCL kernels); an op merely named after a collective
# (Megatron's "_LinearAllreduceDgradBackward", which also runs the wgrad GEMM) is not one:
# the collectives inside it are.
COMM = re.compile(r"^(c10d::|nccl|rccl|gloo:|mpi:|ucc:|record_param_comms)|^nccl[A-Z]|ncclDevKernel|ncclKernel", re.I)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MAX_WINDOW_EVENTS = 2_000_000  # events of one window the analysis keeps (a few hundred bytes each)
IDLE = ("idle", "idle/host gap", "")


def _is_comm(name: str) -> bool:
    return bool(COMM.search(name)) and not name.startswith("aten::")


def _owner(event) -> tuple:
    """(kind, name, backend) of an event that may own time."""
    return _owner_of(event.name)


@functools.lru_cache(maxsize=4096)
def _owner_of(name: str) -> tuple:
    parsed = ranges.parse_range(name)
    if parsed is not None:
        op, backend, _ = parsed
        return ("comm" if op.startswith("collectives.") else "graft", op, backend)
    if _is_comm(name):
        return ("comm", name, "")
    return ("framework", name, "")


def _top_level(events: list) -> list:
    """The events not nested in another (events on one thread nest properly)."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e.ts, -e.dur)):
        if e.ts >= end:
            out.append(e)
            end = e.ts + e.dur
    return out


class _Timeline:
    """Elementary segments between every boundary in the window, each with one owner."""

    def __init__(self, start: float, end: float, intervals: list):
        points = {start, end}
        for s, e in intervals:
            points.add(min(max(s, start), end))
            points.add(min(max(e, start), end))
        self.points = sorted(points)
        self.owner = [IDLE] * (len(self.points) - 1)

    def paint(self, s: float, e: float, owner) -> None:
        i, j = bisect_left(self.points, s), bisect_left(self.points, e)
        if j > i:
            self.owner[i:j] = [owner] * (j - i)

    def totals(self) -> dict:
        out: dict = defaultdict(float)
        for k, owner in enumerate(self.owner):
            out[owner] += self.points[k + 1] - self.points[k]
        return out

    def paint_gaps(self, s: float, e: float, owner, covered: list) -> None:
        """Paint ``owner`` over [s, e) where no op runs on the host timeline: idle segments
        and a top-level op's own time (not covered by one of its child ops)."""
        i, j = bisect_left(self.points, s), bisect_left(self.points, e)
        for k in range(i, j):
            if self.owner[k] == IDLE or (self.owner[k][0] == "framework" and not covered[k]):
                self.owner[k] = owner

    def covered(self, intervals: list) -> list:
        flags = [False] * len(self.owner)
        for s, e in intervals:
            i, j = bisect_left(self.points, s), bisect_left(self.points, e)
            if j > i:
                flags[i:j] = [True] * (j - i)
        return flags

    def owner_at(self, t: float):
        k = bisect_right(self.points, t) - 1
        return self.owner[k] if 0 <= k < len(self.owner) else None

    def overlap(self, s: float, e: float, kinds) -> float:
        """Time in [s, e) owned by an owner of one of ``kinds``."""
        i = max(bisect_right(self.points, s) - 1, 0)
        total = 0.0
        while i < len(self.owner) and self.points[i] < e:
            if self.owner[i][0] in kinds:
                total += min(self.points[i + 1], e) - max(self.points[i], s)
            i += 1
        return total


def _union(intervals: list) -> list:
    out: list = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _dims(args) -> str:
    dims = args.get("Input Dims") if isinstance(args, dict) else None
    if not dims or not isinstance(dims, list):
        return ""
    return ",".join("x".join(str(d) for d in dim) if isinstance(dim, list) else str(dim)
                    for dim in dims if dim not in ([], None))[:80]


class Event:
    """What the attribution needs of one complete ("X") trace event, and no more: a window
    of many small calls keeps a few slots per event, not the event's whole dict."""
    __slots__ = ("name", "cat", "pid", "tid", "ts", "dur", "seq", "corr", "dims")

    def __init__(self, name, cat, pid, tid, ts, dur, seq=None, corr=None, dims=""):
        self.name, self.cat, self.pid, self.tid, self.ts, self.dur = name, cat, pid, tid, ts, dur
        self.seq, self.corr, self.dims = seq, corr, dims


def _slim(raw, names: dict):
    """The :class:`Event` of a raw trace event dict, or None (not a complete event, or one
    whose fields are not of the types a trace has)."""
    if not isinstance(raw, dict) or raw.get("ph") != "X":
        return None
    ts, dur, name = raw.get("ts"), raw.get("dur"), raw.get("name")
    if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or isinstance(ts, bool) \
            or isinstance(dur, bool):
        return None
    name = name if isinstance(name, str) else str(name)
    name = names.setdefault(name, name)  # a window of 100k calls repeats a few dozen names
    cat = raw.get("cat")
    cat = names.setdefault(cat, cat) if isinstance(cat, str) else None
    args = raw.get("args")
    args = args if isinstance(args, dict) else {}
    dims = _dims(args) if cat == "cpu_op" else ""
    pid, tid = raw.get("pid"), raw.get("tid")
    pid, tid = (names.setdefault(pid, pid) if isinstance(pid, (int, str)) else pid,
                names.setdefault(tid, tid) if isinstance(tid, (int, str)) else tid)
    return Event(name, cat, pid, tid, ts, dur, args.get("Sequence number"),
                 args.get("correlation"), names.setdefault(dims, dims))


def _backward_of_graft_ops(top: list, ops: list, graft_ranges: list):
    """The autograd nodes (top-level backward events) created by a graft op's forward, each
    with its owner ``(kind, "<op> (backward)", backend)``, and the calls per such owner.

    torch.profiler gives each forward op the autograd sequence number current when it ran;
    the op that created node N is the last to start with number N (the counter moves on
    after it), and node N's backward event carries N too."""
    creators: dict = {}
    stack: list = []
    marked = [(e.ts, -e.dur, 0, i, e) for i, e in enumerate(graft_ranges)]
    marked += [(e.ts, -e.dur, 1, i, e) for i, e in enumerate(ops)
               if e.seq is not None
               and not e.name.startswith("autograd::") and "Backward" not in e.name]
    for ts, _, is_op, _, e in sorted(marked, key=lambda m: m[:4]):
        while stack and stack[-1].ts + stack[-1].dur <= ts:
            stack.pop()
        if not is_op:
            stack.append(e)
        else:
            creators[e.seq] = stack[-1] if stack else None
    found, ranges_per_owner = [], defaultdict(set)
    for e in top:
        if not e.name.startswith("autograd::engine::evaluate_function"):
            continue
        creator = creators.get(e.seq)
        if creator is None:
            continue
        kind, op, backend = _owner(creator)
        owner = (kind, f"{op} (backward)", backend)
        found.append((e, owner))
        ranges_per_owner[owner].add(id(creator))
    return found, {owner: len(ids) for owner, ids in ranges_per_owner.items()}


def analyse(trace: dict, wall_s: float, steps: int) -> dict:
    """The attribution of the window in ``trace`` (a Chrome trace dict): ``window`` (bounds,
    steps, wall time measured by the process, the trace's own span), ``ops`` (one row per
    owner: kind, name, backend, calls, total/mean µs, shapes) and ``comm`` (exposed vs
    overlapped, per collective); ``device`` when the trace has kernels."""
    return analyse_events(lambda: trace.get("traceEvents", []), wall_s, steps)


def analyse_file(path, wall_s: float, steps: int, problems=None) -> dict:
    """:func:`analyse` of a trace file, read twice as a stream (:mod:`graft.profiling.tracescan`:
    tolerant of torch's unescaped names): memory holds the window's relevant events only."""
    from graft.profiling import tracescan

    problems = problems if problems is not None else tracescan.Problems()
    first = [True]

    def read():
        # the second pass re-reads the same events: count the file's problems once
        scan = problems if first[0] else tracescan.Problems()
        first[0] = False
        return tracescan.events(path, scan)
    return analyse_events(read, wall_s, steps)


def analyse_events(read, wall_s: float, steps: int) -> dict:
    """:func:`analyse` over ``read()``, an iterable of raw event dicts it is called for twice
    (the step marks first, then the window's events): nothing but the window's events that
    can own time or be communication is kept."""
    names: dict = {}
    marks = []
    for raw in read():
        if isinstance(raw, dict) and str(raw.get("name", "")).startswith(ranges.STEP_PREFIX):
            e = _slim(raw, names)
            if e is not None:
                marks.append(e)
    marks.sort(key=lambda e: e.ts)
    if len(marks) < 2:
        raise ValueError(f"the trace has {len(marks)} step mark(s) ({ranges.STEP_PREFIX}N ranges); "
                         "a window needs its first and last")
    start, end = marks[0].ts, marks[-1].ts
    main = (marks[0].pid, marks[0].tid)
    host, device, launches, comm_elsewhere = [], [], [], []
    kept = left_out = 0
    for raw in read():
        e = _slim(raw, names)
        if e is None or not (e.ts < end and e.ts + e.dur > start) or e.name.startswith(ranges.STEP_PREFIX):
            continue
        if kept >= MAX_WINDOW_EVENTS:  # the bound on this analysis's memory (a few hundred bytes an event)
            left_out += 1
            continue
        kept += 1
        if (e.pid, e.tid) == main:
            if e.cat in ("cpu_op", "user_annotation"):
                host.append(e)
        elif e.cat != "Trace" and _is_comm(e.name):
            comm_elsewhere.append(e)
        if e.cat in DEVICE_CATS:
            device.append(e)
        elif e.corr is not None and e.cat in ("cuda_runtime", "cuda_driver"):
            launches.append(e)
    inside = launches
    graft_ranges = [e for e in host if ranges.parse_range(e.name) is not None]
    ops = [e for e in host if e.cat == "cpu_op"]
    comm_here = [e for e in host if _is_comm(e.name) and ranges.parse_range(e.name) is None]
    top = _top_level(ops)  # (a collective's device kernels are in comm_elsewhere: not on the host thread)

    timeline = _Timeline(start, end, [(e.ts, e.ts + e.dur) for e in host + comm_elsewhere])
    for e in top:
        timeline.paint(e.ts, e.ts + e.dur, _owner(e))
    # The host blocked on a collective running elsewhere (gloo's threads, NCCL's stream):
    # its wait() is no op of its own, so it shows as idle time or as a top-level op's own time.
    # (A leaf op computes all its time; a parent, an autograd Function say, may wait in its own.)
    top_ids = {id(e) for e in top}
    children = [(e.ts, e.ts + e.dur) for e in ops if id(e) not in top_ids]
    starts = sorted(s for s, _ in children)
    leaves = [(e.ts, e.ts + e.dur) for e in top
              if bisect_left(starts, e.ts) == bisect_left(starts, e.ts + e.dur)]
    covered = timeline.covered(children + leaves)
    for s, e in _union([(x.ts, x.ts + x.dur) for x in comm_elsewhere]):
        timeline.paint_gaps(s, e, ("comm", "waiting for collectives (other threads/streams)", ""), covered)
    for e in sorted(comm_here, key=lambda e: (e.ts, -e.dur)):
        timeline.paint(e.ts, e.ts + e.dur, _owner(e))
    backward, backward_calls = _backward_of_graft_ops(top, ops, graft_ranges)
    for e, owner in backward:
        timeline.paint(e.ts, e.ts + e.dur, owner)
    for e in sorted(graft_ranges, key=lambda e: (e.ts, -e.dur)):
        timeline.paint(e.ts, e.ts + e.dur, _owner(e))

    calls: dict = defaultdict(int, backward_calls)
    shapes: dict = defaultdict(dict)
    in_backward = {id(e) for e, _ in backward}
    for e in top + [e for e in comm_here if id(e) not in top_ids]:
        if _owner(e)[0] != "graft" and id(e) not in in_backward:
            calls[_owner(e)] += 1
            dims = e.dims
            if dims and len(shapes[_owner(e)]) < 4:
                shapes[_owner(e)][dims] = None
    stack: list = []  # enclosing graft ranges: a range inside one of the same op (an entry
    for e in sorted(graft_ranges, key=lambda e: (e.ts, -e.dur)):  # point over its impl) is one call
        while stack and stack[-1].ts + stack[-1].dur <= e.ts:
            stack.pop()
        owner = _owner(e)
        nested = bool(stack) and _owner(stack[-1])[1] == owner[1]
        stack.append(e)
        if nested:
            continue
        calls[owner] += 1
        bucket = ranges.parse_range(e.name)[2]
        if len(shapes[owner]) < 6:
            shapes[owner][bucket] = None
    totals = timeline.totals()
    rows = []
    for owner, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        kind, name, backend = owner
        n = calls.get(owner, 0)
        rows.append({"kind": kind, "name": name, "backend": backend, "calls": n, "total_us": total,
                     "mean_us": total / n if n else None, "shapes": list(shapes.get(owner, {}))})

    comm_total = sum(e - s for s, e in _union([(x.ts, x.ts + x.dur) for x in comm_elsewhere + comm_here]))
    exposed = sum(r["total_us"] for r in rows if r["kind"] == "comm")
    overlapped = sum(timeline.overlap(s, e, ("graft", "framework"))
                     for s, e in _union([(x.ts, x.ts + x.dur) for x in comm_elsewhere]))
    per_collective: dict = defaultdict(lambda: {"calls": 0, "total_us": 0.0, "hidden_us": 0.0})
    elsewhere = {id(e) for e in comm_elsewhere}
    for e in comm_elsewhere + comm_here:
        entry = per_collective[e.name]
        entry["calls"] += 1
        entry["total_us"] += e.dur
        if id(e) in elsewhere:
            entry["hidden_us"] += timeline.overlap(e.ts, e.ts + e.dur, ("graft", "framework"))
    summary: dict = {
        "window": {"start_us": start, "end_us": end, "trace_span_us": end - start, "wall_us": wall_s * 1e6,
                   "steps": steps, "host_thread": list(main),
                   "step_span_us": [round(b.ts - a.ts, 1) for a, b in zip(marks, marks[1:])]},
        "ops": rows,
        "comm": {"total_us": comm_total, "exposed_us": exposed, "overlapped_us": overlapped,
                 "collectives": [dict(name=k, **v) for k, v in sorted(per_collective.items(),
                                                                      key=lambda kv: -kv[1]["total_us"])]},
    }
    if device:
        summary["device"] = _device(device, inside, timeline, start, end)
    if left_out:
        summary["window"]["events_left_out"] = left_out
        summary.setdefault("warnings", []).append(
            f"the window holds {kept + left_out} events; the analysis read the first {kept} of them "
            f"(its memory bound), so {left_out} are not attributed: profile fewer --steps")
    return summary


def _device(kernels: list, inside: list, timeline: _Timeline, start: float, end: float) -> dict:
    """Kernel time per owner of the host instant that launched each kernel (correlation ids)."""
    launches = {}
    for e in inside:
        corr = e.corr
        if corr is not None and e.cat in ("cuda_runtime", "cuda_driver"):
            launches[corr] = e
    totals: dict = defaultdict(float)
    for k in kernels:
        launch = launches.get(k.corr)
        owner = timeline.owner_at(launch.ts) if launch is not None else None
        if owner is None or owner == IDLE:
            owner = ("comm", k.name, "") if _is_comm(k.name) else ("framework", "kernels launched outside ops", "")
        totals[owner] += min(k.ts + k.dur, end) - max(k.ts, start)
    busy = sum(e - s for s, e in _union([(max(k.ts, start), min(k.ts + k.dur, end)) for k in kernels]))
    return {"busy_us": busy, "idle_us": (end - start) - busy,
            "ops": [{"kind": o[0], "name": o[1], "backend": o[2], "total_us": t}
                    for o, t in sorted(totals.items(), key=lambda kv: -kv[1])]}
