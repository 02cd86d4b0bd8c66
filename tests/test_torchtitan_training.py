"""TorchTitan training on 2 gloo ranks, graft's converter on vs off: its registry's debug
models, its parallelize functions (FSDP2, TP/SP), its loss and optimizer builders (driven
by graft.tools.bench.torchtitan_step, whose docstring lists the CPU shims and the Trainer parts not exercised).

Tolerance: fp32 throughout (params, reduction, activations). graft's torch backend computes
RMSNorm and SwiGLU with the same formulas as TorchTitan's modules but not necessarily the
same op order, so a step may differ in the last bits of fp32 (eps 1.2e-7); over 20 Adam
steps on a 2-layer model such differences stay far under 1e-5 relative in the loss, and the
step-1 gradients agree to 1e-5 relative / 1e-6 absolute. A real mismatch (a wrong shard, a
lost Partial gradient, a missing reduction) moves the loss at the 1e-3 level or more.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torchtitan")

sys.path.insert(0, str(Path(__file__).parent))
import _titan  # noqa: E402
from _dist_helpers import run_ranks  # noqa: E402

STEPS = 20
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6
ENV = {"GRAFT_BACKENDS": "torch", "GRAFT_DISABLE_PLUGINS": "triton,hip,vllm,deepspeed,megatron"}


def _train(model, graft_on, tp, steps=STEPS, n_layers=2, env=ENV, batch=2, seq=16, timeout=400, graft_optim=False,
           ac=False):
    return run_ranks(_titan.train_ranks, 2, model, graft_on, tp, steps, 0, n_layers, batch, seq, False, ac, None,
                     graft_optim, timeout=timeout, env=env)


def _check_equal(off, on):
    lo, lg = off[0]["losses"], on[0]["losses"]
    assert len(lo) == len(lg) == STEPS
    assert np.allclose(lg, lo, rtol=LOSS_RTOL, atol=0), (lg, lo)
    assert lo[-1] != lo[0]  # it trained
    go, gg = off[0]["grads"], on[0]["grads"]
    assert go.keys() == gg.keys() and go
    for name in go:
        np.testing.assert_allclose(gg[name], go[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=name)


def _check_served(results, norms, ffns, backend="torch", extra=(0, 0)):
    """Every swapped module served by graft's ``backend`` once per step (forward; ``extra``:
    recomputed norm and SwiGLU calls a step), none left to TorchTitan."""
    for r in results:
        assert r["modules"] == {"GraftRMSNorm": norms, "GraftFeedForward": ffns}, r["modules"]
        assert r["served"] == {f"fused.rms_norm:{backend}": STEPS * (norms + extra[0]),
                               f"fused.silu_and_mul:{backend}": STEPS * (ffns + extra[1])}, r["served"]
        assert r["fallbacks"] == {}, r["fallbacks"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp,ac", [(1, False), (2, False), (1, True)], ids=["fsdp2", "tp2", "fsdp2_full_ac"])
def test_llama3_2_ranks_graft_on_equals_off(tp, ac):
    off = _train("llama3", False, tp, ac=ac)
    assert all(r["served"] == {} for r in off)
    on = _train("llama3", True, tp, ac=ac)
    # 2 layers: attention and ffn norms, the final norm; with full activation checkpointing
    # (TorchTitan's FullAC on each block) backward recomputes the blocks' forward: their 4 norms
    # and 2 SwiGLUs run twice a step
    recomputed = (4, 2) if ac else (0, 0)
    _check_served(on, norms=2 * 2 + 1, ffns=2, extra=recomputed)
    _check_equal(off, on)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_deepseek_v3_moe_fsdp2_graft_on_equals_off():
    """DeepSeek-V3 debug model (MLA attention, MoE layer with a shared expert): its norms
    (layer norms, MLA's kv norm, the final norm: 7 in 2 layers) and SwiGLU FeedForwards (the dense layer's
    and the shared expert's) on graft; the routed experts stay TorchTitan's GroupedExperts."""
    off = _train("deepseek_v3", False, 1)
    on = _train("deepseek_v3", True, 1)
    _check_served(on, norms=7, ffns=2)
    _check_equal(off, on)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_llama3_fsdp2_graft_model_and_optimizer_equal_torchtitans():
    """graft's converter and graft's optimizer container (AdamW on fused.adam_step, updating
    FSDP2's local shards) against TorchTitan's own model and torch AdamW. Adam's update is
    normalized (m / sqrt(v)), so fp32 rounding differences in the step do not grow: the same
    tolerances hold."""
    off = _train("llama3", False, 1)
    on = _train("llama3", True, 1, graft_optim=True)
    assert off[0]["optimizers"] == ["AdamW"] and on[0]["optimizers"] == ["GraftAdamW"]
    n_params = on[0]["n_params"]
    for r in on:
        assert r["served"] == {"fused.rms_norm:torch": STEPS * 5, "fused.silu_and_mul:torch": STEPS * 2,
                               "fused.adam_step:torch": STEPS * n_params}, r["served"]
        assert r["fallbacks"] == {}, r["fallbacks"]
    _check_equal(off, on)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_deepseek_v3_moe_experts_fsdp2_graft_on_equals_off():
    """The opt-in ``moe`` part on 2 FSDP2 ranks (expert weights all-gathered by FSDP2, local
    dispatch): graft's ``moe.fused_experts`` against TorchTitan's experts made fp32 (test-only,
    see graft.tools.bench.torchtitan_step.fp32_experts) on both sides."""
    parts = ("norm", "swiglu", "moe")
    experts_fp32 = ("flex", 1, True)  # attn_backend, pp (their defaults), experts_fp32
    off = run_ranks(_titan.train_ranks, 2, "deepseek_v3", False, 1, STEPS, 0, 2, 2, 16, False, False, None, False,
                    parts, *experts_fp32, timeout=400, env=ENV)
    on = run_ranks(_titan.train_ranks, 2, "deepseek_v3", True, 1, STEPS, 0, 2, 2, 16, False, False, None, False,
                   parts, *experts_fp32, timeout=400, env=ENV)
    for r in on:
        assert r["modules"] == {"GraftRMSNorm": 7, "GraftFeedForward": 2, "GraftRoutedExperts": 1}, r["modules"]
        assert r["served"] == {"fused.rms_norm:torch": STEPS * 7, "fused.silu_and_mul:torch": STEPS * 2,
                               "moe.fused_experts:torch": STEPS}, r["served"]
        assert r["fallbacks"] == {}, r["fallbacks"]
    _check_equal(off, on)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "tp2"])
def test_llama3_compiled_by_parallelize_graft_on_equals_off(tp):
    """TorchTitan's own compile path (``parallelize_llama`` with compile on: each
    TransformerBlock ``compile(fullgraph=True)``, backend aot_eager here: no C++ toolchain
    needed, the same Dynamo capture) with graft's modules, under FSDP2 and under TP=2 (the
    DTensor local-shard path traced too): no graph break, and the same training as TorchTitan's
    own compiled model."""
    off = run_ranks(_titan.train_ranks, 2, "llama3", False, tp, STEPS, 0, 2, 2, 16, "aot_eager", False, None,
                    timeout=400, env=ENV)
    on = run_ranks(_titan.train_ranks, 2, "llama3", True, tp, STEPS, 0, 2, 2, 16, "aot_eager", False, None,
                   timeout=400, env=ENV)
    for r in on:
        assert r["fallbacks"] == {}, r["fallbacks"]
        served = r["served"]
        assert set(served) == {"fused.rms_norm:torch", "fused.silu_and_mul:torch"}, served
        assert served["fused.silu_and_mul:torch"] == STEPS * 2, served
        # Each block's two norms record through identical counting ops, which AOTAutograd's CSE
        # merges into one (graft's CallCounter under compile; see the README): 1 or 2 per block,
        # plus the final norm, run eagerly.
        assert STEPS * 3 <= served["fused.rms_norm:torch"] <= STEPS * 5, served
    _check_equal(off, on)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "tp2"])
def test_llama3_varlen_attention_on_graft_equals_torchtitans(tp):
    """A Llama 3 built with TorchTitan's varlen attention (document masking): graft serves it
    with attention.prefill on TorchTitan's VarlenMetadata (on the CPU, where TorchTitan's own
    varlen, CUDA flash attention, cannot run); TorchTitan's side runs its causal SDPA, which is
    the same attention for one document a row (the batches' positions count 0..seq-1). Under
    TP=2 the heads-sharded q/k/v run on their local heads."""
    steps = 10
    args = (steps, 0, 2, 2, 16, False, False, None, False, None, "varlen")
    off = run_ranks(_titan.train_ranks, 2, "llama3", False, tp, *args, timeout=400, env=ENV)
    on = run_ranks(_titan.train_ranks, 2, "llama3", True, tp, *args, timeout=400, env=ENV)
    for r in on:
        assert r["modules"] == {"GraftRMSNorm": 5, "GraftFeedForward": 2, "GraftVarlenAttention": 2}, r["modules"]
        assert r["served"]["attention.prefill:torch"] == 2 * steps, r["served"]  # 2 layers a step
        assert r["fallbacks"] == {}, r["fallbacks"]
    lo, lg = off[0]["losses"], on[0]["losses"]
    assert np.allclose(lg, lo, rtol=LOSS_RTOL, atol=0) and lo[-1] != lo[0], (lg, lo)
    for name in off[0]["grads"]:
        np.testing.assert_allclose(on[0]["grads"][name], off[0]["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   err_msg=name)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_llama3_pipeline_parallel_graft_on_equals_off():
    """PP=2 through TorchTitan's pipelining_fn (pipeline_llm: the model split into one stage a
    rank, each stage parallelized by parallelize_llama, its 1F1B schedule over microbatches of
    one row): graft's modules serve inside the stages, losses and every stage's step-1
    gradients equal TorchTitan's own. Each stage runs one extra forward of a microbatch on its
    first step (the schedule's shape inference), counted too."""
    steps, microbatches = 10, 2
    args = (steps, 0, 2, 2, 16, False, False, None, False, None, "flex", 2)
    off = run_ranks(_titan.train_ranks, 2, "llama3", False, 1, *args, timeout=400, env=ENV)
    on = run_ranks(_titan.train_ranks, 2, "llama3", True, 1, *args, timeout=400, env=ENV)
    calls = steps * microbatches + 1
    # stage 0: layer 0 (its 2 norms, 1 SwiGLU); stage 1: layer 1 and the final norm
    for r, norms in zip(on, (2, 3)):
        assert r["modules"] == {"GraftRMSNorm": norms, "GraftFeedForward": 1}, r["modules"]
        assert r["served"] == {"fused.rms_norm:torch": norms * calls, "fused.silu_and_mul:torch": calls}, r["served"]
        assert r["fallbacks"] == {}, r["fallbacks"]
    lo, lg = off[0]["losses"], on[0]["losses"]
    assert np.allclose(lg, lo, rtol=LOSS_RTOL, atol=0) and lo[-1] != lo[0], (lg, lo)
    for stage_off, stage_on in zip(off, on):
        assert stage_off["grads"].keys() == stage_on["grads"].keys() and stage_off["grads"]
        for name in stage_off["grads"]:
            np.testing.assert_allclose(stage_on["grads"][name], stage_off["grads"][name], rtol=GRAD_RTOL,
                                       atol=GRAD_ATOL, err_msg=name)
