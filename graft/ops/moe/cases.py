"""The MoE ops' conformance cases and their input builders (``make_moe_inputs``, ``quantize_experts``)."""
from __future__ import annotations

import torch

from graft.cases import OpCase
from graft.quant import quantize_fp8_block


def _distinct_logits(num_tokens, num_experts, gen, device, dtype):
    """Logits whose scores have no ties (a random permutation of spaced values per row)."""
    base = torch.linspace(-2.0, 2.0, num_experts)
    rows = [base[torch.randperm(num_experts, generator=gen)] for _ in range(num_tokens)]
    noise = torch.rand(num_tokens, num_experts, generator=gen) * (1.0 / (4 * max(num_experts, 1)))
    logits = torch.stack(rows) + noise if num_tokens else torch.zeros(0, num_experts)
    return logits.to(device=device, dtype=dtype)


def _routing_case(num_tokens, num_experts, top_k, renormalize, scoring="softmax", tags=("quick",)):
    def make(device, dtype, gen):
        logits = _distinct_logits(num_tokens, num_experts, gen, device, dtype)
        return (logits, top_k, renormalize, scoring), {}

    name = f"t{num_tokens}_e{num_experts}_k{top_k}{'_renorm' if renormalize else ''}_{scoring}"
    return OpCase("moe.topk_routing", name, make, tags=frozenset(tags),
                  flops=lambda args, kwargs: 5.0 * args[0].numel())


def random_topk_ids(num_tokens, num_experts, top_k, gen, skip_expert=None):
    """Distinct experts per token (as routing gives), optionally never choosing ``skip_expert``."""
    pool = [e for e in range(num_experts) if e != skip_expert]
    rows = []
    for _ in range(num_tokens):
        perm = torch.randperm(len(pool), generator=gen)[:top_k]
        rows.append(torch.tensor([pool[p] for p in perm.tolist()]))
    if not rows:
        return torch.zeros(0, top_k, dtype=torch.int32)
    return torch.stack(rows).to(torch.int32)


def _align_case(num_tokens, num_experts, top_k, block_size, skip_expert=None):
    def make(device, dtype, gen):
        ids = random_topk_ids(num_tokens, num_experts, top_k, gen, skip_expert).to(device)
        return (ids, block_size, num_experts), {}

    name = f"t{num_tokens}_e{num_experts}_k{top_k}_bs{block_size}"
    return OpCase("moe.align_block_size", name, make, dtypes=(torch.int32,),
                  tags=frozenset({"quick"}), flops=lambda args, kwargs: float(args[0].numel()))


def make_moe_inputs(num_tokens, num_experts, top_k, hidden_size, inter, device, dtype, gen, skip_expert=None):
    """Inputs of fused_experts with weights scaled so outputs stay O(1) in every dtype."""
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, inter, generator=gen) / inter ** 0.5
    ids = random_topk_ids(num_tokens, num_experts, top_k, gen, skip_expert)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    to = dict(device=device, dtype=dtype)
    return (hidden.to(**to), w13.to(**to), w2.to(**to), weights.to(device), ids.to(device)), {}


def fused_experts_flops(args, kwargs) -> float:
    hidden, w13, _w2, _weights, ids = args[:5]
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    return 2.0 * num_tokens * ids.shape[1] * hidden_size * inter * 3  # GEMM1 (2I x H) + GEMM2 (H x I)


def _fused_case(num_tokens, num_experts, top_k, hidden_size, inter, tags=("quick",), skip_expert=None):
    def make(device, dtype, gen):
        return make_moe_inputs(num_tokens, num_experts, top_k, hidden_size, inter, device, dtype, gen, skip_expert)

    name = f"t{num_tokens}_e{num_experts}_k{top_k}_h{hidden_size}_i{inter}"
    return OpCase("moe.fused_experts", name, make, tags=frozenset(tags), flops=fused_experts_flops,
                  atol=FUSED_EXPERTS_ATOL, reduction=lambda args, kwargs: max(args[0].shape[1], args[2].shape[2]))


# Optimized kernels round the SiLU-and-mul activation to the input dtype before GEMM 2 (as
# vLLM does: the second GEMM's operands are in that dtype), the reference keeps fp32: one
# extra rounding propagated through GEMM 2, hence twice the output-rounding bound.
FUSED_EXPERTS_ATOL = {torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


CASES = [
    _routing_case(7, 5, 2, True),
    _routing_case(3, 8, 8, False),
    _routing_case(5, 7, 1, False, "sigmoid"),
    _routing_case(4096, 64, 8, True, "softmax", tags=("gpu",)),
    _align_case(1, 4, 2, 4),
    _align_case(17, 8, 2, 16, skip_expert=3),
    _align_case(33, 5, 4, 4),
    _fused_case(1, 4, 1, 48, 40),
    _fused_case(17, 8, 2, 96, 40, skip_expert=5),
    _fused_case(0, 4, 2, 48, 40),
    # Benchmark shapes: Mixtral-like prefill (H=4096, I=14336 scaled to I=7168 to fit beside
    # the fp32 reference) and a decode-sized batch.
    _fused_case(4096, 8, 2, 4096, 7168, tags=("gpu",)),
    _fused_case(32, 8, 2, 4096, 14336, tags=("gpu",)),
]


def quantize_experts(w13, w2, fp8_dtype=torch.float8_e4m3fn):
    """bf16/fp32 expert weights -> ``(w13_q, w2_q, w13_scale, w2_scale)`` with 128x128 block scales."""
    (w13_q, w13_s), (w2_q, w2_s) = quantize_fp8_block(w13, dtype=fp8_dtype), quantize_fp8_block(w2, dtype=fp8_dtype)
    return w13_q, w2_q, w13_s, w2_s


def _fp8_case(num_tokens, num_experts, top_k, hidden_size, inter, tags=("quick",)):
    def make(device, dtype, gen):
        (hidden, w13, w2, weights, ids), _ = make_moe_inputs(num_tokens, num_experts, top_k, hidden_size, inter,
                                                             "cpu", torch.float32, gen)
        w13_q, w2_q, w13_s, w2_s = quantize_experts(w13, w2)
        to = lambda t: t.to(device)  # noqa: E731
        return (hidden.to(device, dtype), to(w13_q), to(w2_q), to(w13_s), to(w2_s), to(weights), to(ids)), {}

    def flops(args, kwargs):
        hidden, w13_q, ids = args[0], args[1], args[6]
        return 6.0 * hidden.shape[0] * ids.shape[1] * hidden.shape[1] * (w13_q.shape[1] // 2)

    name = f"t{num_tokens}_e{num_experts}_k{top_k}_h{hidden_size}_i{inter}"
    # The act is rounded to hidden's dtype, then re-quantized to fp8 per 128-group: where the
    # kernel's and the reference's sums round to neighbouring values, a group's scale and codes
    # can move by one fp8 step (6%): for bf16, where that happens most, a few fp8 steps.
    return OpCase("moe.fused_experts_fp8", name, make, dtypes=(torch.float16, torch.bfloat16), tags=frozenset(tags),
                  flops=flops, atol={torch.float16: 8e-3, torch.bfloat16: 0.16},
                  reduction=lambda args, kwargs: max(args[0].shape[1], args[2].shape[2]))


CASES += [
    _fp8_case(1, 4, 1, 48, 40),
    _fp8_case(17, 8, 2, 200, 136),
    _fp8_case(0, 4, 2, 48, 40),
    _fp8_case(2048, 256, 8, 7168, 2048, tags=("gpu",)),
]
