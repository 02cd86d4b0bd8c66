"""Commit messages for generated patches: explanation, conformance evidence, trailers.

Trailers (``Graft-Template``, ``Graft-Upstream``, ``Graft-Import-Check``) let
``graft patches check`` find the template's version range and what must import.
"""
from __future__ import annotations

import json
from pathlib import Path

from graft import __version__
from graft.patches.template import PatchError, PatchTemplate

TRAILER_KEYS = ("Graft-Template", "Graft-Upstream", "Graft-Import-Check")


def conformance_lines(report_path: Path | None, ops: tuple) -> list:
    """One line per (op, implementation) from a ``graft conformance`` JSON report."""
    if report_path is None:
        return [f"Conformance: not attached. Run `graft conformance --op {' --op '.join(ops)}`",
                "and regenerate with --conformance <report.json> to include the results."]
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
            row = rows.setdefault(key, {"pass": 0, "total": 0, "max_abs": 0.0, "speedups": []})
            row["total"] += 1
            row["pass"] += impl.get("status") == "pass"
            row["max_abs"] = max(row["max_abs"], impl.get("max_abs") or 0.0)
            row["speedups"] += [v for v in (impl.get("speedups") or {}).values() if v]
    if not rows:
        return [f"Conformance: the attached report has no results for {', '.join(ops)}."]
    meta = report.get("meta", {})
    device = meta.get("device", {})
    lines = [f"Conformance (graft {meta.get('graft_version', '?')}, device {device.get('name', '?')} "
             f"{device.get('arch', '')}, speedup = baseline time / kernel time, device-specific):"]
    for (op, backend), row in sorted(rows.items()):
        speed = ""
        if row["speedups"]:
            s = sorted(row["speedups"])
            speed = f", speedup median {s[len(s) // 2]:.2f}x (min {s[0]:.2f}x, max {s[-1]:.2f}x)"
        lines.append(f"  {op} [{backend}]: {row['pass']}/{row['total']} cases pass, "
                     f"max abs err {row['max_abs']:.3g}{speed}")
    return lines


def render(template: PatchTemplate, version: str, conformance: Path | None) -> str:
    parts = [
        template.subject,
        template.body.strip(),
        f"Written for {template.framework} {template.supported}; generated against {template.framework} {version}.",
        "\n".join(conformance_lines(conformance, template.ops)),
        "\n".join([
            f"Generated-by: graft {__version__} (graft patches generate)",
            f"Graft-Template: {template.name}",
            f"Graft-Upstream: {template.framework} {template.supported}",
            *(f"Graft-Import-Check: {m}" for m in template.import_checks),
        ]),
    ]
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
