"""``profile.html``: one self-contained page (inline SVG and CSS; no script, no network).

Per process: a stacked bar of where its window went (graft ops by backend, framework ops,
exposed communication, idle/host gaps), a bar of its communication (exposed vs overlapped
with compute), and a table per op: calls, total, mean, share of the window, shapes,
backend, speed vs the framework's own implementation (from the tuning table, where it
has one) and the Amdahl estimate "the step gets X% faster if this op becomes 2x faster".
"""
from __future__ import annotations

from html import escape

COLOURS = {"framework": "#8c8c8c", "comm": "#d62728", "idle": "#e0e0e0", "overlapped": "#ff9896"}
BACKEND_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#bcbd22", "#e377c2", "#ff7f0e", "#8c564b"]
BAR_WIDTH = 760


def _category(row) -> str:
    if row["kind"] == "graft":
        return f"graft: {row['backend']}"
    return {"framework": "framework ops", "comm": "communication (exposed)", "idle": "idle / host gaps"}[row["kind"]]


def _colours(profile) -> dict:
    colours = {"framework ops": COLOURS["framework"], "communication (exposed)": COLOURS["comm"],
               "idle / host gaps": COLOURS["idle"], "communication (overlapped)": COLOURS["overlapped"]}
    backends = sorted({r["backend"] for p in profile["processes"] for r in p.get("ops", []) if r["kind"] == "graft"})
    for i, backend in enumerate(backends):
        colours[f"graft: {backend}"] = BACKEND_COLOURS[i % len(BACKEND_COLOURS)]
    return colours


def _bars(title: str, bars: list, colours: dict, unit_us: float) -> str:
    """An SVG of horizontal stacked bars: ``bars`` = [(label, [(category, µs), ...])]."""
    row_h, left, height = 26, 150, 40 + 26 * len(bars) + 24 * ((len(colours) + 3) // 4)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{left + BAR_WIDTH + 20}" '
             f'height="{height}" role="img" aria-label="{escape(title)}">',
             f'<text x="0" y="16" class="title">{escape(title)}</text>']
    used = []
    for i, (label, segments) in enumerate(bars):
        y, x = 28 + i * row_h, float(left)
        parts.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">{escape(label)}</text>')
        for category, us in segments:
            w = BAR_WIDTH * us / unit_us if unit_us else 0
            if w <= 0:
                continue
            if category not in used:
                used.append(category)
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 6}" '
                         f'fill="{colours.get(category, "#bbbbbb")}"><title>{escape(category)}: '
                         f'{us / 1e3:.3f} ms</title></rect>')
            x += w
    y0 = 36 + len(bars) * row_h
    for i, category in enumerate(used):
        x, y = left + (i % 4) * 190, y0 + (i // 4) * 22
        parts.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colours.get(category, "#bbbbbb")}"/>'
                     f'<text x="{x + 16}" y="{y + 11}">{escape(category)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _segments(proc) -> list:
    order: dict = {}
    for row in proc["ops"]:
        order[_category(row)] = order.get(_category(row), 0.0) + row["total_us"]
    first = [c for c in order if c.startswith("graft: ")]
    rest = ["framework ops", "communication (exposed)", "idle / host gaps"]
    return [(c, order[c]) for c in first + rest if c in order]


def _fmt(value, digits=3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _table(proc) -> str:
    window = proc["window"]
    head = ("<tr><th>op</th><th>kind</th><th>backend</th><th>calls</th><th>total ms</th><th>mean µs</th>"
            "<th>% of window</th><th>shapes</th><th>vs framework</th><th>step faster if 2x</th></tr>")
    rows = []
    for r in proc["ops"]:
        speed = r.get("vs_framework")
        gain = r.get("step_faster_if_2x_pct")
        rows.append(
            f'<tr class="{r["kind"]}" data-total-us="{r["total_us"]:.3f}">'
            f'<td>{escape(r["name"])}</td><td>{r["kind"]}</td><td>{escape(r["backend"] or "")}</td>'
            f'<td class="n">{r["calls"] or ""}</td><td class="n">{r["total_us"] / 1e3:.3f}</td>'
            f'<td class="n">{_fmt(r["mean_us"], 1)}</td><td class="n">{100 * r["share"]:.1f}%</td>'
            f'<td>{escape("; ".join(r["shapes"]))}</td>'
            f'<td class="n">{"" if speed is None else f"{speed:.2f}x"}</td>'
            f'<td class="n">{"" if gain is None else f"{gain:.1f}%"}</td></tr>')
    total = sum(r["total_us"] for r in proc["ops"])
    rows.append(f'<tr class="sum"><td>sum</td><td></td><td></td><td></td><td class="n">{total / 1e3:.3f}</td>'
                f'<td></td><td class="n">{100 * total / window["trace_span_us"]:.1f}%</td><td colspan="3">'
                f'window {window["wall_us"] / 1e3:.3f} ms wall (perf_counter), {window["steps"]} step(s)</td></tr>')
    return f'<table class="ops">{head}{"".join(rows)}</table>'


def _comm_table(proc) -> str:
    comm = proc["comm"]
    if not comm["collectives"]:
        return "<p>No communication in this window.</p>"
    rows = "".join(
        f'<tr><td>{escape(c["name"])}</td><td class="n">{c["calls"]}</td><td class="n">{c["total_us"] / 1e3:.3f}</td>'
        f'<td class="n">{c["hidden_us"] / 1e3:.3f}</td>'
        f'<td class="n">{100 * c["hidden_us"] / c["total_us"] if c["total_us"] else 0:.0f}%</td></tr>'
        for c in comm["collectives"])
    return ('<table class="comm"><tr><th>collective</th><th>calls</th><th>total ms</th><th>hidden under compute ms</th>'
            f'<th>hidden</th></tr>{rows}</table>')


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; } h3 { font-size: 15px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.graft td:first-child { font-weight: 600; } tr.sum td { font-weight: 600; border-top: 2px solid #999; }
svg.plot text { font: 12px system-ui, sans-serif; } svg.plot text.title { font-weight: 600; }
.note { color: #a04000; } code { background: #f4f4f4; padding: 0 3px; }
"""


def page(profile: dict) -> str:
    colours = _colours(profile)
    recorded = [p for p in profile["processes"] if p.get("window")]
    command = " ".join(profile.get("command") or []) or "(the graft.profile API)"
    parts = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>graft profile</title>",
             f"<style>{CSS}</style></head><body>",
             f"<h1>graft profile</h1><p><code>{escape(command)}</code><br>{escape(profile['created'])}, "
             f"{len(recorded)} process(es) recorded; traces: <code>trace.json</code> (all) and "
             f"<code>&lt;label&gt;.trace.json</code> (open in Perfetto or chrome://tracing); shapes for "
             f"<code>graft tune</code>: <code>{escape(profile['shapes'])}</code></p>"]
    for warning in profile.get("warnings") or []:  # events the traces' reader could not read, and such
        parts.append(f'<p class="note">warning: {escape(str(warning))}</p>')
    for proc in profile["processes"]:
        if not proc.get("window"):
            parts.append(f'<p class="note">{escape(proc["label"])} ({escape(proc["role"])}, pid {proc["pid"]}): '
                         f'{escape(proc.get("note") or "nothing recorded")}</p>')
    if recorded:
        per_step = [(f'{p["label"]}', [(c, us / max(p["window"]["steps"], 1)) for c, us in _segments(p)])
                    for p in recorded]
        longest = max(sum(us for _, us in segs) for _, segs in per_step)
        parts.append("<h2>Where a step's time went</h2>")
        parts.append(_bars(f"time per step (full bar = {longest / 1e3:.3f} ms)", per_step, colours, longest))
        if any(p["comm"]["total_us"] > 0 for p in recorded):
            comm_bars = [(p["label"], [("communication (exposed)", p["comm"]["exposed_us"] / max(p["window"]["steps"], 1)),
                                       ("communication (overlapped)",
                                        p["comm"]["overlapped_us"] / max(p["window"]["steps"], 1))])
                         for p in recorded]
            widest = max(sum(us for _, us in segs) for _, segs in comm_bars) or 1.0
            parts.append(_bars(f"communication per step: exposed vs hidden under compute "
                               f"(full bar = {widest / 1e3:.3f} ms)", comm_bars, colours, widest))
    for i, proc in enumerate(recorded):
        w = proc["window"]
        parts.append(f'<details{" open" if i == 0 else ""}><summary><h2 style="display:inline">'
                     f'{escape(proc["label"])}: {escape(proc["role"])}</h2> (pid {proc["pid"]}, '
                     f'{w["steps"]} step(s), {w["wall_us"] / 1e3:.3f} ms)</summary>')
        if proc.get("note"):
            parts.append(f'<p class="note">{escape(proc["note"])}</p>')
        parts.append("<h3>Ops</h3>" + _table(proc))
        c = proc["comm"]
        parts.append(f"<h3>Communication</h3><p>{c['total_us'] / 1e3:.3f} ms of collectives, "
                     f"{c['exposed_us'] / 1e3:.3f} ms exposed (the host waited), "
                     f"{c['overlapped_us'] / 1e3:.3f} ms hidden under compute.</p>" + _comm_table(proc))
        if proc.get("device"):
            d = proc["device"]
            rows = "".join(f'<tr><td>{escape(r["name"])}</td><td>{r["kind"]}</td><td>{escape(r["backend"])}</td>'
                           f'<td class="n">{r["total_us"] / 1e3:.3f}</td></tr>' for r in d["ops"])
            parts.append(f"<h3>Device</h3><p>busy {d['busy_us'] / 1e3:.3f} ms, idle {d['idle_us'] / 1e3:.3f} ms"
                         f"</p><table><tr><th>launched by</th><th>kind</th><th>backend</th><th>kernel ms</th></tr>"
                         f"{rows}</table>")
        parts.append("</details>")
    parts.append("</body></html>\n")
    return "".join(parts)
