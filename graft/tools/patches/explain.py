"""``graft patches explain <project>``: per patch, in the project's terms, why upstream would
want it, where it runs (the default configuration, or the switch), what its tests cover and
which of graft's workarounds it retires; kernel patches also say what they need to be generated."""
from __future__ import annotations

import textwrap

from graft.tools.patches.generate import select_templates
from graft.tools.patches.message import BENCH_HOW
from graft.tools.patches.projects import project


def _block(label: str, text: str) -> list:
    body = textwrap.fill(" ".join(textwrap.dedent(text).split()), 88, initial_indent="    ", subsequent_indent="    ")
    return [f"  {label}:", body]


def explain(framework: str) -> str:
    proj = project(framework)  # unknown framework: a PatchError naming the installed ones
    lines = []
    for t in select_templates(framework):
        lines.append(f"{proj.title(t.subject)}  [{t.name}, {t.framework} {t.supported}]")
        lines += _block("why upstream wants it", t.motivation or t.body)
        lines += _block("where it runs", "the default configuration: no setting turns it on" if t.reach == "default"
                        else f"not by default; turned on by: {t.reach}")
        if t.tests:
            selection = ("new, in the project's default test selection" if "-m" not in t.test_args else
                         f"new; run with {' '.join(t.test_args)}: the project's default selection leaves it out")
            lines += _block("tests", f"{t.tests[0]} ({selection})"
                            + (f"; existing tests run beside it: {', '.join(t.tests[1:])}" if t.tests[1:] else ""))
        if t.benchmark:
            lines += _block("generated", "only with GPU numbers from graft/tools/bench/kernels.py "
                            f"({t.benchmark[0]} {t.benchmark[1]}; `{BENCH_HOW}`, then --bench-results); "
                            "without them `generate` leaves it out and says so")
        if t.retire:
            lines += _block("graft drops", t.retire)
        lines.append(f"  upstream: {t.upstream}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
