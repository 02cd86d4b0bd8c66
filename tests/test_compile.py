"""Graft ops inside torch.compile: backend selection runs at trace time and the selected
torch.library custom op lands in the graph, with no graph break (fullgraph=True)."""
import torch

import graft.ops.attention as A
import graft.ops.fused as F
import graft.ops.gemm as G
import graft.ops.moe as M


def block(x, norm_w, w_up, w_down, cos_sin, positions, router_w, w13, w2):
    h = F.rms_norm(x, norm_w, 1e-6)
    q, _ = F.rotary_embedding(positions, h, None, 16, cos_sin, True)
    t = x.shape[0]
    cu = torch.tensor([0, t], dtype=torch.int32)
    a = A.prefill(q.view(t, 2, 16), h.view(t, 2, 16), h.view(t, 2, 16), cu, cu, t, t, True)
    y = G.linear(a.reshape(t, 32), w_up, None, "none")
    y = G.linear(F.silu_and_mul(y), w_down, None, "none")
    weights, ids = M.topk_routing(x @ router_w, 2, True)
    return y + M.fused_experts(y, w13, w2, weights, ids)


def _inputs():
    g = torch.Generator().manual_seed(0)
    t, hidden, inter, experts = 6, 32, 24, 4
    r = lambda *s: torch.randn(*s, generator=g)
    angles = torch.arange(64)[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))[None, :]
    return (r(t, hidden), r(hidden), r(2 * inter, hidden) * 0.2, r(hidden, inter) * 0.2,
            torch.cat([angles.cos(), angles.sin()], -1), torch.arange(t), r(hidden, experts),
            r(experts, 2 * inter, hidden) * 0.2, r(experts, hidden, inter) * 0.2)


def _compile_recording_ops(fn, fullgraph):
    """torch.compile with a backend that records every graph's call targets, then runs it eagerly."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    return torch.compile(fn, backend=backend, fullgraph=fullgraph), graphs


def _reference(args, monkeypatch):
    from graft.selection import reset_caches

    with monkeypatch.context() as m:
        m.setenv("GRAFT_DISABLE", "all")
        reset_caches()
        out = block(*args)
    reset_caches()
    return out


def test_fullgraph_compile_uses_custom_ops_and_matches_the_reference(fresh_graft, monkeypatch):
    import graft

    graft.get_registry()  # load the plugins before tracing (a cold start costs one graph break)
    args = _inputs()
    compiled, graphs = _compile_recording_ops(block, fullgraph=True)  # fullgraph: a break is an error
    out = compiled(*args)
    assert len(graphs) == 1
    for name in ("fused_rms_norm_triton", "fused_rotary_embedding_triton", "attention_prefill_triton",
                 "gemm_linear_triton", "fused_silu_and_mul_triton", "moe_fused_experts_triton"):
        assert any(name in target for target in graphs[0]), (name, sorted(graphs[0]))
    torch.testing.assert_close(out, block(*args), atol=1e-4, rtol=1e-4)  # compiled == eager Triton
    torch.testing.assert_close(out, _reference(args, monkeypatch), atol=2e-3, rtol=2e-3)  # == torch references


def test_env_selection_applies_under_compile(fresh_graft, monkeypatch):
    # With Triton disabled every op traces into its torch reference (the MoE reference's
    # loop over experts is data-dependent, so fullgraph is not asked for here).
    # Also a cold start: the plugins load during the trace, outside the graph.
    monkeypatch.setenv("GRAFT_DISABLE", "triton")
    args = _inputs()
    compiled, graphs = _compile_recording_ops(block, fullgraph=False)
    out = compiled(*args)
    targets = set().union(*graphs)
    # graft's torch backend of attention.prefill is torch code too, but its per-sequence
    # lengths are host reads: under compile it is the op graft.attention_prefill_torch
    kernels = sorted(t for t in targets if "graft." in t and "selection_log" not in t
                     and not t.startswith("graft.attention_prefill_torch"))
    assert targets and not kernels, kernels
    # the fallback reasons are logged from inside the graph, not lost at trace time
    assert any("graft.selection_log" in t for t in targets)
    torch.testing.assert_close(out, block(*args), atol=1e-4, rtol=1e-4)


def test_compile_traces_through_the_c_entries_when_graft_is_imported_first():
    """graft registers its Python entries with torch.compile when torch._dynamo is imported
    (later than graft here, as in a script that imports graft and then compiles), without
    importing torch._dynamo itself."""
    import subprocess
    import sys

    code = """
import sys, torch
import graft.ops.fused as F
from graft import dispatch
assert "torch._dynamo" not in sys.modules, "graft imported torch._dynamo"
x, w = torch.randn(4, 8), torch.randn(8)
for _ in range(2):
    F.rms_norm(x, w, 1e-6)  # remembered: the C entry serves it from now on
assert dispatch._fast_hits["fused.rms_norm"]
targets = []
def backend(gm, example_inputs):
    targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return gm.forward
f = torch.compile(lambda x, w: F.rms_norm(x, w, 1e-6) * 2, backend=backend, fullgraph=True)
torch.testing.assert_close(f(x, w), F.rms_norm_reference(x, w, 1e-6) * 2)
assert any("graft" in t for t in targets), targets
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
