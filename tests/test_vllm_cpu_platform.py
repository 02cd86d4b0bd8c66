"""graft inside the real vLLM 0.33 running as vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu).

vLLM's fused-MoE layer only builds on a known platform, and its CPU experts need vLLM's
compiled ``_C`` extension (absent from a CPU-torch install), so the MoE layer here runs
end to end only because graft serves it: vLLM's factory, weight loader, router, runner
and forward context, graft's ``moe.fused_experts``. One fresh interpreter (vLLM's
registries are process-global) also checks GRAFT_VLLM_ATTENTION_OVERRIDE through vLLM's
attention selector and graft's CustomOps under torch.compile.
"""
from __future__ import annotations

import json
import os
import sys

import graft

from test_vllm_integration import _run, needs_vllm

HERE = os.path.abspath(__file__)


@needs_vllm
def test_cpu_platform():
    result = _run("cpu", HERE, VLLM_TARGET_DEVICE="cpu", GRAFT_VLLM_ATTENTION_OVERRIDE="cpu_attn")
    assert result["platform"] == "CpuPlatform"
    assert result["summary"]["attention"] == "registered; serves CPU_ATTN", result["summary"]
    assert result["selected attention backend"] == "graft.adapters.vllm.attention.GraftAttentionBackend"
    assert result["bad override"].startswith("failed: ValueError: GRAFT_VLLM_ATTENTION_OVERRIDE='NOPE'")
    assert result["moe checks"] == 5 and result["compile checks"] == 2, result


# ----------------------------------------------------------------- scenario body (run in the subprocess)


def _moe_reference(x, w_gate, w_up, w_down, logits, top_k):
    """Plain loop over tokens and their experts: softmax routing, renormalised top-k, SiLU-gated MLPs."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(top_k):
            e, xt = int(ids[t, j]), x[t].float()
            h = torch.nn.functional.silu(w_gate[e].float() @ xt) * (w_up[e].float() @ xt)
            out[t] += weights[t, j] * (w_down[e].float() @ h)
    return out


def _moe_checks(cfg, checks, calls) -> int:
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    experts, hidden, inter, top_k = 4, 64, 48, 2  # vLLM's CPU MoE needs hidden % 32 == 0
    gen = torch.Generator().manual_seed(2)
    before = checks.count
    for n, (dtype, tokens, with_shared) in enumerate(
        ((torch.float32, 7, False), (torch.float32, 1, False), (torch.bfloat16, 5, False), (torch.float32, 6, True))
    ):
        shared = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype) if with_shared else None
        layer = FusedMoEFactory(
            num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter, params_dtype=dtype,
            renormalize=True, prefix=f"model.layers.{n}.mlp.experts", shared_experts=shared,
        )
        routed = layer.routed_experts
        method = routed.quant_method
        assert type(method).__name__ == "GraftUnquantizedFusedMoEMethod", type(method)
        assert method.unquantized_backend.value == "CPU" and method._forward_method.__name__ == "forward_graft"
        # Per-expert checkpoint tensors through vLLM's own weight loader (gate/up fused into w13 by vLLM).
        w_gate, w_up = (torch.randn(experts, inter, hidden, generator=gen).to(dtype) * 0.2 for _ in range(2))
        w_down = torch.randn(experts, hidden, inter, generator=gen).to(dtype) * 0.2
        ckpt = [(f"{e}.{name}.weight", w[e]) for e in range(experts)
                for name, w in (("gate_proj", w_gate), ("up_proj", w_up), ("down_proj", w_down))]
        assert len(list(layer.load_weights(ckpt))) == 3 * experts
        method.process_weights_after_loading(routed)
        assert method.graft_owns_layout and method.moe_kernel is not None
        assert tuple(routed.w13_weight.shape) == (experts, 2 * inter, hidden)  # not repacked/padded by vLLM

        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        logits = torch.randn(tokens, experts, generator=gen)
        want = _moe_reference(x, w_gate, w_up, w_down, logits, top_k)
        if shared is not None:
            want += shared(x).float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        start = len(calls)
        os.environ["GRAFT_MOE_FUSED_EXPERTS"] = "recorder"
        graft.reload_config()
        with set_forward_context(None, cfg):
            got = layer(x, logits)
        assert calls[start:] == ["moe.fused_experts"], calls[start:]
        checks.close(f"vLLM FusedMoE via graft (recorder) {dtype} T={tokens} shared={with_shared}", got, want, tol, tol)
        if n == 0:  # default selection as well (graft's Triton kernel, interpreted here)
            del os.environ["GRAFT_MOE_FUSED_EXPERTS"]
            graft.reload_config()
            with set_forward_context(None, cfg):
                got = layer(x, logits)
                # vLLM's CPU runner calls its MoE forward directly (no opaque vllm.moe_forward op), so
                # Dynamo traces router + runner + graft's method down to graft's custom op.
                explanation = torch._dynamo.explain(layer)(x, logits)
            assert len(calls) == start + 1
            checks.close(f"vLLM FusedMoE via graft (default) {dtype} T={tokens}", got, want, tol, tol)
            assert explanation.graph_break_count == 0, explanation.break_reasons
            ops = {str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops}
            assert any(op.startswith("graft.moe_fused_experts") for op in ops), ops
        os.environ.pop("GRAFT_MOE_FUSED_EXPERTS", None)
        graft.reload_config()

    # A layer graft cannot serve keeps vLLM's method untouched (its CPU kernel needs vllm._C, so not run here).
    biased = FusedMoEFactory(num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
                             params_dtype=torch.float32, has_bias=True, prefix="model.layers.9.mlp.experts")
    assert biased.routed_experts.quant_method.graft_layer_reason(biased.routed_experts) == "expert biases"
    return checks.count - before


def _compile_checks(cfg, checks) -> int:
    """graft's vLLM CustomOps traced by torch.compile with no graph break."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    before = checks.count
    with set_current_vllm_config(cfg):
        norm, act = RMSNorm(32, eps=1e-6), SiluAndMul()
    assert norm._forward_method.__name__ == act._forward_method.__name__ == "forward_graft"
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))

    def block(x, residual):
        h, residual = norm(x, residual)
        return act(torch.cat([h, 2 * h], dim=-1)), residual

    # Traced before any eager graft call: graft's plugin host must already be up (vLLM's
    # plugin hook loads it), else Dynamo meets its lock and breaks the graph.
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    explanation = torch._dynamo.explain(block)(x.clone(), res.clone())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    ops = {str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops}
    assert any(op.startswith("graft.fused_add_rms_norm") for op in ops), ops  # the residual variant
    assert any(op.startswith("graft.fused_silu_and_mul") for op in ops), ops
    eager = block(x.clone(), res.clone())
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True)(x.clone(), res.clone())
    checks.close("compiled CustomOps out", compiled[0], eager[0], 1e-5, 1e-5)
    checks.close("compiled CustomOps residual", compiled[1], eager[1], 1e-5, 1e-5)
    return checks.count - before


def scenario_cpu() -> dict:
    import tempfile

    import torch
    import vllm.plugins
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import get_attn_backend

    from graft.adapters.vllm import attention, plugin
    from graft.plugins import get_host
    from test_vllm_integration import _Checks, _recording_backend

    out = {"platform": type(current_platform).__name__}
    vllm.plugins.load_general_plugins()
    out["summary"] = plugin.activation_summary()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(custom_ops=["all"]))
    checks = _Checks()
    out["compile checks"] = _compile_checks(cfg, checks)

    # vLLM's own selector picks CPU_ATTN on CPU whatever --attention-backend says; the override serves it with graft.
    with set_current_vllm_config(cfg):
        backend = get_attn_backend(16, torch.float32, "auto")
    out["selected attention backend"] = f"{backend.__module__}.{backend.__qualname__}"
    # A misspelt override must not break vLLM: graft's register() reports it and the other parts stay.
    os.environ["GRAFT_VLLM_ATTENTION_OVERRIDE"] = "nope"
    graft.reload_config()
    plugin._summary = None
    bad = plugin.activate()
    out["bad override"] = bad["attention"]
    assert bad["moe"] == "registered" and "GRAFT" in AttentionBackendEnum.__members__
    os.environ["GRAFT_VLLM_ATTENTION_OVERRIDE"] = "CPU_ATTN"
    graft.reload_config()
    assert attention.register()["attention"] == "registered; serves CPU_ATTN"

    calls: list = []
    get_host().register(_recording_backend(calls, ops=("moe.fused_experts", "gemm.linear")), name="recorder")
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method="file://" + tempfile.mktemp(), backend="gloo"
        )
        initialize_model_parallel(1, 1)
        # On CPU graft keeps the linear weight vLLM would repack with its _C extension.
        linear = ReplicatedLinear(24, 10, bias=True, params_dtype=torch.float32)
        with torch.no_grad():
            for p in linear.parameters():
                p.copy_(torch.randn(p.shape))
        linear.quant_method.process_weights_after_loading(linear)
        x = torch.randn(3, 24)
        checks.close("linear on vLLM CPU", linear(x)[0], torch.nn.functional.linear(x, linear.weight, linear.bias), 1e-4)
        out["moe checks"] = _moe_checks(cfg, checks, calls)
    return out


if __name__ == "__main__":
    print(json.dumps(globals()[f"scenario_{sys.argv[1]}"]()))
