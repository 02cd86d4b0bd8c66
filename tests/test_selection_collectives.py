"""The collectives too: what graft.explain says a call gets is what dispatch runs, on a
one-rank gloo group (graft's path as on many ranks: the agreement runs once per signature)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, torch
    import graft
    from graft import dispatch
    from graft.plugins import get_host
    from graft.tools.bench.ops import one_rank_group
    from graft.tools.conformance.cases import all_cases

    host = get_host()
    rows = []
    with one_rank_group() as ok:
        assert ok, "no one-rank gloo group"
        seen = set()
        for case in all_cases(host, host.registry):
            if not case.op.startswith("collectives.") or case.op in seen:
                continue
            seen.add(case.op)
            dtype = torch.float32 if torch.float32 in case.dtypes else case.dtypes[0]
            args, kwargs = case.inputs("cpu", dtype)
            decision = graft.explain(case.op, *args, **kwargs)
            impl = dispatch.run(case.op, *args, **kwargs)[1]
            rows.append({"op": case.op, "explain": [decision.selected.backend, decision.selected.provider],
                         "ran": [impl.backend, impl.provider], "why": decision.why})
    print(json.dumps(rows))
""")


def test_explain_matches_what_dispatch_runs_for_every_collective():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    from graft.plugins import get_registry

    assert {r["op"] for r in rows} == {op for op in get_registry().ops if op.startswith("collectives.")}
    for row in rows:
        assert row["explain"] == row["ran"], row
        assert row["why"], row
