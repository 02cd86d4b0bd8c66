"""Commit messages for generated patches, in the form maintainers expect:

    <[Tag]> subject

    motivation (why)
    what changes
    Testing: what ran, on which device; speedups only when measured on a GPU

    Signed-off-by: ...            (--signoff)
    Graft-Template: ...           (--graft-trailers only: graft-internal, kept out of upstream history)
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from graft.tools.patches.template import PatchError, PatchTemplate

TRAILER_KEYS = ("Graft-Template", "Graft-Upstream", "Graft-Import-Check")


def _is_gpu(device: dict) -> bool:
    name = f"{device.get('name', '')} {device.get('type', '')} {device.get('arch', '')}".lower()
    return bool(device.get("name")) and "cpu" not in name and "interpret" not in name


def conformance_lines(report_path: Path | None, ops: tuple) -> list:
    """What a conformance report shows for ``ops``, naming the device; [] without a report."""
    if report_path is None:
        return []
    try:
        report = json.loads(Path(report_path).read_text())
        cases = report["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PatchError(f"--conformance {report_path}: not a graft conformance JSON report ({exc})") from None
    rows: dict = {}
    for case in cases:
        if case.get("op") not in ops:
            continue
        for impl in case.get("impls", []):
            key = (case["op"], impl.get("backend"))
            row = rows.setdefault(key, {"pass": 0, "skip": 0, "total": 0, "max_abs": 0.0, "speedups": [],
                                        "reasons": set()})
            row["total"] += 1
            status = impl.get("status")
            row["pass"] += status == "pass"
            if status == "skip" or status == "skipped":
                row["skip"] += 1
                if impl.get("reason"):
                    row["reasons"].add(str(impl["reason"]))
            row["max_abs"] = max(row["max_abs"], impl.get("max_abs") or 0.0)
            row["speedups"] += [v for v in (impl.get("speedups") or {}).values() if v]
    if not rows:
        return [f"The attached conformance report has no results for {', '.join(ops)}."]
    device = report.get("meta", {}).get("device", {})
    gpu = _is_gpu(device)
    where = (f"{device.get('name')} {device.get('arch', '')}".strip() if gpu
             else "CPU, Triton interpreter, numerics only")
    lines = [f"Numerics against a PyTorch reference ({where}):"]
    for (op, backend), row in sorted(rows.items()):
        if row["skip"] == row["total"]:
            why = f": {'; '.join(sorted(row['reasons']))}" if row["reasons"] else ""
            lines.append(f"  {op} [{backend}]: skipped{why}")
            continue
        ran = row["total"] - row["skip"]
        text = f"  {op} [{backend}]: {row['pass']}/{ran} cases pass, max abs err {row['max_abs']:.3g}"
        if row["skip"]:
            text += f" ({row['skip']} skipped)"
        if gpu and row["speedups"]:
            s = sorted(row["speedups"])
            text += (f", speedup vs PyTorch median {s[len(s) // 2]:.2f}x "
                     f"(min {s[0]:.2f}x, max {s[-1]:.2f}x)")
        lines.append(text)
    return lines


BENCH_HOW = "python -m graft.tools.bench.kernels --device cuda --out DIR"


def benchmark_lines(results_path: Path, benchmark: tuple) -> list:
    """The "Performance" section of a kernel patch, from a ``graft/tools/bench/kernels.py`` results JSON:
    the GPU, each measured case's ratio against every baseline, and the geometric mean.
    Refuses a CPU run and a run without a measured case of this kernel."""
    family, op = benchmark
    try:
        report = json.loads(Path(results_path).read_text())
        env, results = report["environment"], report["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PatchError(f"--bench-results {results_path}: not a graft/tools/bench/kernels.py results JSON ({exc}); "
                         f"write one with `{BENCH_HOW}`") from None
    if not env.get("gpu"):
        raise PatchError(f"--bench-results {results_path} was measured on {env.get('device', 'an unknown device')}, "
                         "not a GPU: a kernel patch quotes GPU numbers only")
    rows = [r for r in results if r.get("family") == family and (r.get("params") or {}).get("op") == op
            and r.get("status") == "ok" and r.get("ratios")]
    if not rows:
        raise PatchError(f"--bench-results {results_path} has no measured {family} {op} case; "
                         f"run `{BENCH_HOW}` with the {family} family")
    lines = [f"Performance ({env['gpu']}, torch {env.get('torch', '?')}, triton {env.get('triton', '?')};",
             "graft/tools/bench/kernels.py from graft: per-call medians over interleaved rounds, CUDA graphs;",
             "ratio = baseline time / this kernel's time, > 1 is faster):"]
    ratios: dict = {}
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k != "op")
        lines.append(f"  {params}: " + ", ".join(f"{pair.split(' vs ')[1]} {v:.2f}x" for pair, v in r["ratios"].items()))
        for pair, v in r["ratios"].items():
            ratios.setdefault(pair.split(" vs ")[1], []).append(v)
    for base, values in ratios.items():
        geo = math.exp(sum(map(math.log, values)) / len(values))
        lines.append(f"  geometric mean vs {base}: {geo:.2f}x over {len(values)} cases "
                     f"(min {min(values):.2f}x, max {max(values):.2f}x)")
    return lines


def _wrap(text: str) -> str:
    paragraphs = [p for p in textwrap.dedent(text).strip().split("\n\n") if p.strip()]
    return "\n\n".join(p if p.lstrip().startswith(("-", "*", " ")) else textwrap.fill(" ".join(p.split()), 72)
                       for p in paragraphs)


def testing_section(template: PatchTemplate, conformance: Path | None, measured: bool = False) -> str:
    lines = ["Testing:"]
    if template.tests:
        lines.append("  pytest " + " ".join(template.tests))
    lines += conformance_lines(conformance, template.ops)
    if conformance is None and template.ops:
        lines.append("The tests run on CUDA/ROCm GPUs and, with TRITON_INTERPRET=1, on CPU")
        if measured:
            lines.append("(Triton interpreter, numerics only); the numbers above are from a GPU.")
        else:
            lines.append("(Triton interpreter, numerics only). No GPU measurements are attached,")
            lines.append("so this makes no performance claim.")
    return "\n".join(lines)


def reach_lines(template: PatchTemplate) -> list:
    """Where the change runs: the framework's default configuration, or the switch that turns it on."""
    if template.reach == "default":
        return ["Active in the default configuration: no setting turns it on."]
    return [_wrap(f"Not active by default. Turned on by: {template.reach}")]


def render(template: PatchTemplate, version: str, conformance: Path | None, title: str | None = None,
           graft_trailers: bool = False, bench_results: Path | None = None) -> str:
    parts = [title or template.subject]
    if template.motivation:
        parts.append(_wrap(template.motivation))
    parts.append(_wrap(template.body))
    parts.append("\n".join(reach_lines(template)))
    if template.benchmark and bench_results is not None:
        parts.append("\n".join(benchmark_lines(bench_results, template.benchmark)))
    parts.append(testing_section(template, conformance, measured=bool(template.benchmark and bench_results)))
    if graft_trailers:
        parts.append("\n".join([
            f"Graft-Template: {template.name}",
            f"Graft-Upstream: {template.framework} {template.supported}",
            *(f"Graft-Import-Check: {m}" for m in template.import_checks),
        ]))
    return "\n\n".join(parts) + "\n"


def read_trailers(patch_text: str) -> dict:
    """``{key: [values]}`` for graft's trailers in a format-patch file's message."""
    message = patch_text.split("\n---\n", 1)[0]
    found: dict = {}
    for line in message.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in TRAILER_KEYS:
            found.setdefault(key, []).append(value.strip())
    return found
