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


def test_fullgraph_compile_matches_eager_and_uses_custom_ops(fresh_graft):
    args = _inputs()
    eager = block(*args)
    explanation = torch._dynamo.explain(block)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    ops = {str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops}
    for name in ("fused_rms_norm_triton", "fused_rotary_embedding_triton", "attention_prefill_triton",
                 "gemm_linear_triton", "fused_silu_and_mul_triton", "moe_fused_experts_triton"):
        assert any(name in op for op in ops), (name, sorted(ops))
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), eager, atol=1e-4, rtol=1e-4)


def test_env_selection_applies_under_compile(fresh_graft, monkeypatch):
    # With Triton disabled every op traces into its torch reference (the MoE reference's
    # loop over experts is data-dependent, so fullgraph is not asked for here).
    monkeypatch.setenv("GRAFT_DISABLE", "triton")
    args = _inputs()
    explanation = torch._dynamo.explain(block)(*args)
    ops = {str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops}
    assert ops and not any("graft." in op for op in ops), sorted(ops)
    compiled = torch.compile(block, backend="eager")
    torch.testing.assert_close(compiled(*args), block(*args), atol=1e-4, rtol=1e-4)
