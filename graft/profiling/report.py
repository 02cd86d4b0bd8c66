"""The profile's folder, merged: ``profile.json`` (every process's attribution, with the
Amdahl estimate per row), ``shapes.json`` (for ``graft tune``), ``trace.json`` (all
processes' traces in one, each named) and ``profile.html`` (:mod:`graft.profiling.html`).

This is where each process's trace is read and its window attributed (the processes only
record): each trace is streamed (:mod:`graft.profiling.tracescan`, tolerant of torch's
unescaped names), so memory holds one window's slimmed events, never a whole trace. What
could not be read is said in the process's ``warnings`` and the profile's."""
from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path

from graft.profiling import shapes

FORMAT = "graft-profile/1"


def processes(out, warnings: list | None = None) -> list:
    """Every process's summary in ``out`` (``<label>.summary.json``), ranks first; a process
    whose trace is not analysed yet is analysed now (and its summary file completed)."""
    warnings = warnings if warnings is not None else []
    found = []
    for path in sorted(Path(out).glob("*.summary.json")):
        try:
            proc = json.loads(path.read_text(encoding="utf-8", errors="replace"))
            if not isinstance(proc, dict) or "label" not in proc:
                raise ValueError("not a process summary")
        except (OSError, ValueError) as exc:
            warnings.append(f"{path.name}: unreadable, left out ({exc})")
            continue
        if proc.get("analysis") == "pending":
            proc = _analyse(Path(out), proc)
            _replace(path, json.dumps(proc, indent=1) + "\n")
        warnings.extend(f"{proc.get('label')}: {w}" for w in proc.get("warnings") or [])
        found.append(proc)
    return sorted(found, key=lambda p: (p.get("rank") is None, p.get("rank") or 0, p.get("pid") or 0))


def _analyse(out: Path, proc: dict) -> dict:
    from graft.profiling import analysis, tracescan

    proc = dict(proc)
    problems = tracescan.Problems()
    try:
        summary = analysis.analyse_file(out / proc["trace"], wall_s=proc["wall_us"] / 1e6,
                                        steps=proc.get("window_steps") or 0, problems=problems)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        summary = {"window": None}
        proc["note"] = f"its trace could not be analysed: {type(exc).__name__}: {exc}"
    warnings = summary.pop("warnings", [])
    proc.update(summary)
    proc["analysis"] = "done"
    proc["warnings"] = problems.messages() + warnings
    return proc


def amdahl_2x(total_us: float, window_us: float) -> float:
    """How much faster (in %) the window gets if this much of it ran 2x faster."""
    rest = window_us - total_us / 2
    return 100.0 * (window_us / rest - 1.0) if rest > 0 and window_us > 0 else 0.0


def framework_speed(op: str, backend: str, buckets: list):
    """The speed of ``backend`` vs the framework's own implementation of ``op`` as the
    tuning table measured it (>1: graft's faster), or None.

    The table is ``graft tune``'s (module graft.tuning, built alongside this one); this reads
    it only through ``graft.tuning.speed_vs_framework(op, backend, buckets)`` when that
    exists. Without it, or for an op it has not measured, the column stays empty rather than
    show a number nobody measured.
    """
    try:
        tuning = importlib.import_module("graft.tuning")
    except ImportError:
        return None
    speed = getattr(tuning, "speed_vs_framework", None)
    if speed is None:
        return None
    try:
        value = speed(op, backend, buckets)
    except Exception:
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _complete(proc: dict) -> dict:
    window = proc.get("window")
    if not window:
        return proc
    span = window["trace_span_us"]
    for row in proc["ops"]:
        row["share"] = row["total_us"] / span if span else 0.0
        row["per_step_us"] = row["total_us"] / max(window["steps"], 1)
        row["step_faster_if_2x_pct"] = None if row["kind"] == "idle" else amdahl_2x(row["total_us"], span)
        row["vs_framework"] = framework_speed(row["name"], row["backend"], row["shapes"]) if row["kind"] == "graft" \
            else None
    return proc


def build(out, command=None) -> dict:
    warnings: list = []
    procs = [_complete(p) for p in processes(out, warnings)]
    return {"format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
            "folder": os.path.abspath(out), "processes": procs, "shapes": shapes.FILE, "warnings": warnings}


def merge_traces(out, procs: list) -> Path | None:
    """All processes' traces in one file, each process named by its label and role: streamed
    event by event (written as valid JSON even where torch's export was not)."""
    from graft.profiling import tracescan

    sources = [p for p in procs if p.get("trace") and (Path(out) / p["trace"]).is_file()]
    if not sources:
        return None
    path = Path(out) / "trace.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True
        for proc in sources:
            name = f"{proc['label']} ({proc['role']})"
            events = tracescan.events(Path(out) / proc["trace"])
            for e in events:
                if e.get("ph") == "M" and e.get("name") == "process_name":
                    continue
                if isinstance(e.get("pid"), str):  # the profiler's own "Spans"/"Traces" rows
                    e = dict(e, pid=f"{proc['label']} {e['pid']}")
                f.write(("" if first else ",\n") + json.dumps(e, ensure_ascii=False))
                first = False
            f.write(("" if first else ",\n") + json.dumps(
                {"ph": "M", "name": "process_name", "pid": proc["pid"], "tid": 0, "args": {"name": name}}))
            first = False
        f.write("\n]}\n")
    os.replace(tmp, path)
    return path


def write(out, command=None) -> dict:
    """Merge what the processes left in ``out`` into the report files; returns profile.json's data."""
    from graft.profiling import html

    profile = build(out, command)
    recorded = [p for p in profile["processes"] if p.get("window")]
    entries = []
    for p in sorted(Path(out).glob("*.shapes.json")):
        if p.name == shapes.FILE:
            continue
        try:
            entries.append(shapes.read(p))
        except (OSError, ValueError) as exc:
            profile["warnings"].append(f"{p.name}: unreadable, its shapes left out ({exc})")
    shapes.write(Path(out) / shapes.FILE, shapes.merge(*entries))
    merge_traces(out, recorded)
    _replace(Path(out) / "profile.json", json.dumps(profile, indent=1) + "\n")
    _replace(Path(out) / "profile.html", html.page(profile))
    return profile


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load(path) -> dict:
    """A profile.json (or the folder holding one), checked."""
    path = Path(path)
    if path.is_dir():
        path = path / "profile.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not a readable graft profile ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a graft profile (format {got!r}, expected {FORMAT!r})")
    if not isinstance(data.get("processes"), list) or not all(isinstance(p, dict) for p in data["processes"]):
        raise ValueError(f"{path}: a graft profile without a list of processes (a damaged file?)")
    return data


def _pair_key(proc: dict):
    """Processes of two runs pair by rank (labels carry pids, which differ between runs)."""
    return f"rank{proc['rank']}" if isinstance(proc.get("rank"), int) else proc.get("label")


def compare(a: dict, b: dict, names=("A", "B")) -> str:
    """Two profiles side by side: per process (paired by label, else in order), each row's
    time per step in A and B and the ratio B/A."""
    lines = []
    procs_a = [p for p in a["processes"] if p.get("window")]
    procs_b = {_pair_key(p): p for p in b["processes"] if p.get("window")}
    ordered_b = [p for p in b["processes"] if p.get("window")]
    matched = set()
    for i, pa in enumerate(procs_a):
        pb = procs_b.get(_pair_key(pa)) or (ordered_b[i] if i < len(ordered_b) else None)
        if pb is None or _pair_key(pb) in matched:
            lines.append(f"{pa['label']}: only in {names[0]}")
            continue
        matched.add(_pair_key(pb))
        wa, wb = pa["window"], pb["window"]
        step_a = wa["trace_span_us"] / max(wa["steps"], 1)
        step_b = wb["trace_span_us"] / max(wb["steps"], 1)
        lines.append(f"{pa['label']} ({pa['role']}) vs {pb['label']} ({pb['role']}): step "
                     f"{step_a / 1e3:.2f} ms vs {step_b / 1e3:.2f} ms ({step_b / step_a:.2f}x)")
        lines.append(f"  {'op':<46} {'kind':<10} {names[0] + ' ms/step':>12} {names[1] + ' ms/step':>12} {'B/A':>7}")
        rows_b = {(r["kind"], r["name"]): r for r in pb["ops"]}
        seen = set()
        for ra in pa["ops"]:
            key = (ra["kind"], ra["name"])
            seen.add(key)
            rb = rows_b.get(key)
            per_a = ra["total_us"] / max(wa["steps"], 1) / 1e3
            per_b = rb["total_us"] / max(wb["steps"], 1) / 1e3 if rb else None
            label = ra["name"] + (f" [{ra['backend']}" + (f"->{rb['backend']}" if rb and rb["backend"] != ra["backend"]
                                                         else "") + "]" if ra["backend"] else "")
            ratio = f"{per_b / per_a:.2f}" if per_b is not None and per_a > 0 else "-"
            lines.append(f"  {label[:46]:<46} {ra['kind']:<10} {per_a:>12.3f} "
                         f"{(f'{per_b:.3f}' if per_b is not None else '-'):>12} {ratio:>7}")
        for key, rb in rows_b.items():
            if key not in seen:
                per_b = rb["total_us"] / max(wb["steps"], 1) / 1e3
                lines.append(f"  {rb['name'][:46]:<46} {rb['kind']:<10} {'-':>12} {per_b:>12.3f} {'-':>7}")
    for key in sorted(procs_b.keys() - matched, key=str):
        lines.append(f"{procs_b[key]['label']}: only in {names[1]}")
    return "\n".join(lines)
