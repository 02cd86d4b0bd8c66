"""Write a conformance report: JSON for machines, Markdown and a self-contained HTML page
(inline CSS and SVG plots, no scripts or external resources, readable offline) for people."""
from __future__ import annotations

import html
import json
import math
import os

from graft.baselines import REFERENCE
from graft.tools.conformance.runner import ERROR, FAIL, SKIPPED, CaseResult, ImplResult, Report

DEVICE_SPECIFIC = "device-specific"


# --------------------------------------------------------------------------- table rows


def _fmt_time(seconds) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _fmt_err(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _fmt_ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def upstream_ratio(case: CaseResult, impl: ImplResult):
    """(baseline name, ratio) against the first upstream baseline timed for this case, or None."""
    for b in case.baselines:
        if b.name in impl.speedups:
            return b.name, impl.speedups[b.name]
    return None


def impl_row(case: CaseResult, impl: ImplResult) -> dict:
    timing = impl.timing or {}
    up = upstream_ratio(case, impl)
    if impl.status == SKIPPED:
        status = f"skipped: {impl.reason}"
    elif impl.status == ERROR:
        status = f"error: {impl.reason}"
    else:
        status = impl.status
    return {
        "op": case.op, "case": case.case, "dtype": case.dtype, "impl": impl.name, "status": status,
        "max_abs": _fmt_err(impl.max_abs), "max_rel": _fmt_err(impl.max_rel),
        "median": _fmt_time(timing.get("median_s")) + (f" ±{timing['iqr_rel'] * 50:.0f}%" if timing else ""),
        "vs_reference": _fmt_ratio(impl.speedups.get(REFERENCE)),
        "vs_upstream": f"{_fmt_ratio(up[1])} vs {up[0]}" if up else "-",
        "selected": "yes" if impl.selected else "",
        "note": impl.timing_note or "",
    }


IMPL_COLUMNS = [
    ("op", "op"), ("case", "case (shape)"), ("dtype", "dtype"), ("impl", "implementation"), ("status", "numerics"),
    ("max_abs", "max abs err"), ("max_rel", "max rel err"), ("median", f"median time ({DEVICE_SPECIFIC}) ±IQR/2"),
    ("vs_reference", "speedup vs torch reference"), ("vs_upstream", "speedup vs upstream"),
    ("selected", "graft selects"),
]


GRAD_COLUMNS = [
    ("op", "op"), ("case", "case (shape)"), ("dtype", "dtype"), ("impl", "implementation"),
    ("status", "gradient"), ("inputs", "max abs / max rel error per input"),
]


def grad_rows(report: Report) -> list:
    """One row per implementation and case that went through the gradient check (--grad)."""
    rows = []
    for case, impl in report.impl_rows():
        g = impl.grad
        if g is None:
            continue
        status = g["status"] if not g.get("reason") else f"{g['status']}: {g['reason']}"
        inputs = "; ".join(f"d{name} {_fmt_err(e['max_abs'])} / {_fmt_err(e['max_rel'])}" + ("" if e["ok"] else " FAIL")
                           for name, e in g["inputs"].items())
        rows.append({"op": case.op, "case": case.case, "dtype": case.dtype, "impl": impl.name, "status": status,
                     "inputs": inputs or "-", "_class": g["status"]})
    return rows


def baseline_rows(report: Report) -> list:
    """Baselines that ran (timed, or disagreeing with the reference); unused ones: see unused_baselines."""
    rows = []
    for case in report.cases:
        if case.reference_timing:
            rows.append({"op": case.op, "case": case.case, "dtype": case.dtype, "baseline": REFERENCE,
                         "status": "ok", "median": _fmt_time(case.reference_timing["median_s"]), "ratio": "1.00x"})
        for b in case.baselines:
            if b.status in ("unavailable", "not applicable"):
                continue
            status = b.status if not b.reason else f"{b.status}: {b.reason}"
            rows.append({"op": case.op, "case": case.case, "dtype": case.dtype, "baseline": b.name, "status": status,
                         "median": _fmt_time((b.timing or {}).get("median_s")),
                         "ratio": _fmt_ratio(b.speedup_vs_reference)})
    return rows


BASELINE_COLUMNS = [
    ("op", "op"), ("case", "case (shape)"), ("dtype", "dtype"), ("baseline", "baseline"), ("status", "status"),
    ("median", f"median time ({DEVICE_SPECIFIC})"), ("ratio", "speedup vs torch reference"),
]


def unused_baselines(report: Report) -> list:
    """"op: baseline: status: reason (N cases)" for baselines that were unavailable or did not apply."""
    counts: dict = {}
    for case in report.cases:
        for b in case.baselines:
            if b.status in ("unavailable", "not applicable"):
                key = (case.op, b.name, b.status, b.reason)
                counts[key] = counts.get(key, 0) + 1
    return [f"{op}: {name}: {status}: {reason} ({n} case{'s' if n > 1 else ''})"
            for (op, name, status, reason), n in counts.items()]


def case_skip_rows(report: Report) -> list:
    return [c for c in report.cases if c.status != "ran"]


# --------------------------------------------------------------------------- plot data


def plot_series(report: Report) -> dict:
    """op -> list of (label, ratio, against): speedup per shape, for the plots.

    Each timed implementation is plotted against the upstream baseline when one was
    timed for that case, else against the torch reference. Where no implementation was
    timed (the Triton interpreter on a CPU), the upstream baselines' ratios against the
    torch reference are plotted instead, so the page still shows what was measured.
    """
    series: dict = {}
    for case in report.cases:
        timed = [i for i in case.impls if i.speedups]
        for impl in timed:
            up = upstream_ratio(case, impl)
            against, ratio = up if up else (REFERENCE, impl.speedups.get(REFERENCE))
            if ratio is not None:
                series.setdefault(case.op, []).append((f"{case.case} {case.dtype} {impl.backend}", ratio, against))
        if not timed:
            for b in case.baselines:
                if b.speedup_vs_reference is not None:
                    series.setdefault(case.op, []).append(
                        (f"{case.case} {case.dtype} [{b.name}]", b.speedup_vs_reference, REFERENCE))
    return series


def svg_bar_chart(title: str, points: list, width: int = 760) -> str:
    """Horizontal bars on a log2 axis centred on 1x (right of the line: faster than the baseline)."""
    row, label_w, top, pad = 18, 330, 34, 12
    height = top + row * len(points) + 28
    ratios = [max(p[1], 1e-6) for p in points]
    lo = min(0.5, min(ratios) / 1.2)
    hi = max(2.0, max(ratios) * 1.2)
    x0, x1 = label_w, width - pad
    span = math.log2(hi) - math.log2(lo)

    def x(v):
        return x0 + (math.log2(max(v, lo)) - math.log2(lo)) / span * (x1 - x0)

    esc = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">',
             f'<text x="4" y="16" font-size="13" font-weight="bold">{esc(title)}</text>']
    for tick in _ticks(lo, hi):
        tx = x(tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{top - 6}" x2="{tx:.1f}" y2="{height - 24}" stroke="#ddd"/>')
        parts.append(f'<text x="{tx:.1f}" y="{height - 10}" font-size="10" text-anchor="middle">{tick:g}x</text>')
    one = x(1.0)
    for i, (label, ratio, against) in enumerate(points):
        y = top + i * row
        bx, bw = (one, x(ratio) - one) if ratio >= 1 else (x(ratio), one - x(ratio))
        color = "#3a8f3a" if ratio >= 1 else "#c0392b"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">{esc(label)}</text>')
        parts.append(f'<rect x="{bx:.1f}" y="{y + 2}" width="{max(bw, 1):.1f}" height="{row - 5}" fill="{color}">'
                     f'<title>{esc(label)}: {ratio:.3g}x vs {esc(against)}</title></rect>')
        tx = x(ratio) + (4 if ratio >= 1 else -4)
        anchor = "start" if ratio >= 1 else "end"
        parts.append(f'<text x="{tx:.1f}" y="{y + 12}" font-size="10" text-anchor="{anchor}">{ratio:.2f}x</text>')
    parts.append(f'<line x1="{one:.1f}" y1="{top - 6}" x2="{one:.1f}" y2="{height - 24}" stroke="#000"/>')
    parts.append("</svg>")
    return "\n".join(parts)


def _ticks(lo, hi) -> list:
    ticks, v = [], 2.0 ** math.floor(math.log2(lo))
    while v <= hi:
        if v >= lo:
            ticks.append(v)
        v *= 2 if hi / lo < 64 else 4
    return ticks


# --------------------------------------------------------------------------- Markdown


def _md_table(columns, rows) -> str:
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r[key]) for key, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def _header_lines(report: Report) -> list:
    m = report.meta
    d = m["device"]
    o = m["options"]
    counts = report.counts()
    return [
        f"graft {m['graft_version']}, torch {m['torch_version']}; device {d['type']} {d['name']} (arch {d['arch']})"
        + ("; TRITON_INTERPRET=1" if m["triton_interpret"] else ""),
        f"tags {','.join(o['tags']) or 'all'}; timing {'on' if o['timing'] else 'off'}"
        + (f" (warm-up {o['warmup']}, {o['repeats']} repeats, median and inter-quartile range)" if o["timing"] else "")
        + f"; speedup = {m['speedup_definition']}",
        f"result: {counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
        f"{counts['skipped']} skipped; wall time {m.get('wall_s', 0):.1f} s",
    ] + ([f"gradients: {g['pass']} passed, {g['fail']} failed, {g['error']} errors, {g['skipped']} skipped "
          "(no backward registered)"] if (g := report.grad_counts()) is not None else [])


def render_markdown(report: Report) -> str:
    out = ["# graft conformance report", ""]
    out += [f"- {line}" for line in _header_lines(report)]
    out += [f"- note: {n}" for n in report.notes]
    failures = report.failures
    if failures:
        out += ["", "## Failures", ""]
        for _, _, message in failures:
            out += ["```", message, "```"]
    out += ["", "## Implementations", ""]
    out.append(_md_table(IMPL_COLUMNS, [impl_row(c, i) for c, i in report.impl_rows()]) if any(report.impl_rows())
               else "(no implementations besides the torch references ran)")
    grows = grad_rows(report)
    if grows:
        out += ["", "## Gradients (registered backward vs autograd through the torch reference)", "",
                _md_table(GRAD_COLUMNS, grows)]
    skipped = case_skip_rows(report)
    if skipped:
        out += ["", "## Cases not run", ""]
        out += [f"- {c.id}: {c.status}: {c.reason}" for c in skipped]
    rows = baseline_rows(report)
    if rows:
        out += ["", f"## Baselines (absolute times are {DEVICE_SPECIFIC})", "", _md_table(BASELINE_COLUMNS, rows)]
    unused = unused_baselines(report)
    if unused:
        out += ["", "## Baselines not used", ""] + [f"- {line}" for line in unused]
    series = plot_series(report)
    if series:
        out += ["", "## Speedup per shape", ""]
        for op, points in series.items():
            out.append(f"- {op}: " + ", ".join(f"{label} {ratio:.2f}x vs {against}" for label, ratio, against in points))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:.5em 0 1.5em}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f0f0f0} tr.fail td,tr.error td{background:#fde2e0} tr.skipped td{color:#777}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:12px}
.note{color:#555}
"""


def _html_table(columns, rows, row_class=None) -> str:
    esc = html.escape
    parts = ["<table><thead><tr>" + "".join(f"<th>{esc(t)}</th>" for _, t in columns) + "</tr></thead><tbody>"]
    for r in rows:
        cls = f' class="{row_class(r)}"' if row_class else ""
        parts.append(f"<tr{cls}>" + "".join(f"<td>{esc(str(r[k]))}</td>" for k, _ in columns) + "</tr>")
    parts.append("</tbody></table>")
    return "\n".join(parts)


def render_html(report: Report) -> str:
    esc = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>graft conformance report</title>", f"<style>{_CSS}</style></head><body>",
           "<h1>graft conformance report</h1><ul>"]
    out += [f"<li>{esc(line)}</li>" for line in _header_lines(report)]
    out += [f'<li class="note">note: {esc(n)}</li>' for n in report.notes]
    out.append("</ul>")
    failures = report.failures
    if failures:
        out.append("<h2>Failures</h2>")
        out += [f"<pre>{esc(message or '')}</pre>" for _, _, message in failures]
    series = plot_series(report)
    out.append("<h2>Speedup per shape</h2>")
    if series:
        out.append('<p class="note">Log scale; bars right of the 1x line are faster than the baseline named in '
                   "each bar's tooltip. Ratios come from one run on one device.</p>")
        for op, points in series.items():
            against = sorted({p[2] for p in points})
            out.append(svg_bar_chart(f"{op}: speedup vs {', '.join(against)}", points))
    else:
        out.append('<p class="note">Nothing was timed (timing off, or only interpreter runs).</p>')
    out.append("<h2>Implementations</h2>")
    rows = [(impl_row(c, i), i.status) for c, i in report.impl_rows()]
    status_of = {id(r): s for r, s in rows}
    out.append(_html_table(IMPL_COLUMNS, [r for r, _ in rows], lambda r: status_of[id(r)]) if rows
               else "<p>(no implementations besides the torch references ran)</p>")
    grows = grad_rows(report)
    if grows:
        out.append("<h2>Gradients (registered backward vs autograd through the torch reference)</h2>")
        out.append(_html_table(GRAD_COLUMNS, grows, lambda r: r["_class"]))
    skipped = case_skip_rows(report)
    if skipped:
        out.append("<h2>Cases not run</h2><ul>")
        out += [f"<li>{esc(c.id)}: {esc(c.status)}: {esc(c.reason or '')}</li>" for c in skipped]
        out.append("</ul>")
    brows = baseline_rows(report)
    if brows:
        out.append(f"<h2>Baselines (absolute times are {DEVICE_SPECIFIC})</h2>")
        out.append(_html_table(BASELINE_COLUMNS, brows))
    unused = unused_baselines(report)
    if unused:
        out.append("<h2>Baselines not used</h2><ul>")
        out += [f"<li>{esc(line)}</li>" for line in unused]
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- files


def write_reports(report: Report, out_dir: str, json_only: bool = False) -> dict:
    """Write report.json (and report.md, report.html); returns {kind: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "report.json")}
    with open(paths["json"], "w") as f:
        json.dump(report.as_dict(), f, indent=1, default=str)
    if not json_only:
        paths["markdown"] = os.path.join(out_dir, "report.md")
        with open(paths["markdown"], "w") as f:
            f.write(render_markdown(report))
        paths["html"] = os.path.join(out_dir, "report.html")
        with open(paths["html"], "w") as f:
            f.write(render_html(report))
    return paths


def summary_table(report: Report) -> str:
    """Short per-op summary for the terminal."""
    per_op: dict = {}
    for case in report.cases:
        entry = per_op.setdefault(case.op, {"pass": 0, "fail": 0, "error": 0, "skipped": 0, "ratios": [], "runs": 0})
        entry["runs"] += 1
        if case.status == ERROR:
            entry["error"] += 1
        elif case.status == SKIPPED:
            entry["skipped"] += 1
        for impl in case.impls:
            entry[impl.status] += 1
            if REFERENCE in impl.speedups:
                entry["ratios"].append(impl.speedups[REFERENCE])
    width = max([len("op")] + [len(op) for op in per_op]) + 1
    lines = [f"{'op':<{width}} {'cases':>5} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5}  "
             "median speedup vs torch reference"]
    for op, e in per_op.items():
        ratios = sorted(e["ratios"])
        med = f"{ratios[len(ratios) // 2]:.2f}x" if ratios else "-"
        if not any(e[k] for k in ("pass", "fail", "error", "skipped")):
            med = "(only the torch reference is registered)"
        lines.append(f"{op:<{width}} {e['runs']:>5} {e['pass']:>5} {e['fail']:>5} {e['error']:>5} {e['skipped']:>5}  {med}")
    return "\n".join(lines)
