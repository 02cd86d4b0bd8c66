"""Mixture-of-experts ops: top-k routing, token alignment per expert, fused expert MLPs.

The three ops compose into one MoE layer (the layout vLLM's fused MoE uses)::

    weights, ids = topk_routing(router_logits, top_k, renormalize=True)
    out = fused_experts(hidden, w13, w2, weights, ids)        # aligns internally

``align_block_size`` is public because grouped-GEMM kernels of other backends need
the same per-expert, block-padded token layout.

Semantics (shared by every backend; the torch references below define them):

``topk_routing(router_logits [T, E], top_k, renormalize, scoring="softmax")``
    Scores are ``softmax`` over experts in fp32 (or ``sigmoid`` per expert), then the
    ``top_k`` largest scores per token, largest first. Ties go to the lowest expert id;
    a NaN score ranks above every number (as in ``torch.sort``), so a row of NaN logits
    picks experts 0..k-1 with NaN weights instead of an undefined id.
    With ``renormalize`` each token's k weights are divided by their sum. Returns
    ``(topk_weights fp32 [T, k], topk_ids int32 [T, k])``.

``align_block_size(topk_ids [T, k] int32, block_size, num_experts)``
    Flattened slot ``i = t * k + j`` (token t, slot j) is grouped by expert
    ``topk_ids[t, j]``; experts in increasing id order, slots of one expert in
    increasing ``i`` (stable). A slot whose id is ``-1`` (its expert is on another rank
    under expert parallelism, as vLLM and Megatron mark it) is skipped: never placed,
    never counted. Ids ``< -1`` or ``>= num_experts`` are rejected by the value checks
    and skipped the same way when those are off (``GRAFT_CHECK_VALUES=0``, tracing, CUDA
    graphs), so no kernel ever indexes with them. Each expert's group is padded up to a multiple of
    ``block_size`` with the sentinel ``T * k``; an expert with no slots gets no block.
    Returns ``sorted_token_ids`` int32 of fixed size ``T*k + num_experts*(block_size-1)``
    (entries past the used part are the sentinel), ``expert_ids`` int32 of size
    ``ceil(len(sorted_token_ids) / block_size)`` (one expert per block; ``-1`` for
    unused blocks) and ``num_tokens_post_padded`` int32 [1] (used length, a multiple of
    block_size).

``fused_experts(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k], activation="silu")``
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)`` with ``e = topk_ids[t, j]``
    and ``[g; u] = w13[e] @ hidden[t]`` (gate = the first I rows of w13, as in vLLM).
    A slot with a skipped id (see above) contributes nothing, as in vLLM's fused MoE under
    expert parallelism.
    Returns [T, H] in hidden's dtype.
"""
from __future__ import annotations

import torch

from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import check_same_device, check_tensor, checks_values_on, readable_bounds
from graft.ops.moe.reference import (align_block_size_reference, aligned_sizes, fused_experts_fp8_reference,
                                     fused_experts_reference, quantize_act, topk_routing_reference, valid_ids)
from graft.quant import FP8_BLOCK
from graft.registry import OpSpec


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu",)
NOT_ON_RANK = -1  # expert id of a slot whose expert lives on another rank (expert parallelism)
_FLOAT_SET = frozenset(FLOAT_DTYPES)


# sorted_token_ids are int32 indices: the padded length num_slots + E*(block_size-1) must fit.
MAX_ALIGNED = 2**31 - 1


def _check_ids(op: str, topk_ids, num_experts: int, num_tokens: int | None = None) -> None:
    check_tensor(f"{op}: topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2)
    if num_tokens is not None and topk_ids.shape[0] != num_tokens:
        raise GraftInputError(f"{op}: topk_ids has {topk_ids.shape[0]} rows, expected {num_tokens} (one per token)")
    _check_id_values(op, topk_ids, num_experts)


def _check_id_values(op: str, topk_ids, num_experts: int) -> None:
    bounds = readable_bounds(topk_ids)
    if bounds is None or (bounds[0] >= NOT_ON_RANK and bounds[1] < num_experts):
        return
    bad = topk_ids[(topk_ids < NOT_ON_RANK) | (topk_ids >= num_experts)]
    raise GraftInputError(
        f"{op}: topk_ids must lie in [0, {num_experts}) (num_experts={num_experts}) or be {NOT_ON_RANK} "
        f"(an expert on another rank), got {int(bad[0])} ({bad.numel()} such ids)"
    )


def check_fused_experts_values(w13, topk_ids):
    """moe.fused_experts' check of values (``OpSpec.check_values``): expert ids in range."""
    _check_id_values("moe.fused_experts", topk_ids, w13.shape[0])


def check_fused_experts_fp8_values(w13_q, topk_ids):
    """moe.fused_experts_fp8's check of values (``OpSpec.check_values``): expert ids in range."""
    _check_id_values("moe.fused_experts_fp8", topk_ids, w13_q.shape[0])


def validate_topk_routing(router_logits, top_k, renormalize=True, scoring="softmax"):
    op = "moe.topk_routing"
    check_tensor(f"{op}: router_logits", router_logits, dtypes=FLOAT_DTYPES, ndim=2)
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise GraftInputError(f"{op}: top_k must be an int, got {type(top_k).__name__}")
    if top_k <= 0 or top_k > num_experts:
        raise GraftInputError(f"{op}: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if not isinstance(renormalize, bool):
        raise GraftInputError(f"{op}: renormalize must be a bool, got {type(renormalize).__name__}")
    if scoring not in SCORINGS:
        raise GraftInputError(f"{op}: scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")


def topk_routing(router_logits, top_k, renormalize=True, scoring="softmax"):
    """Top-k experts per token: (weights fp32 [T, k], ids int32 [T, k]); see the module doc."""
    return call("moe.topk_routing", router_logits, top_k, renormalize, scoring)


def validate_align_block_size(topk_ids, block_size, num_experts):
    op = "moe.align_block_size"
    for name, value in (("block_size", block_size), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GraftInputError(f"{op}: {name} must be a positive int, got {value!r}")
    _check_ids(op, topk_ids, num_experts)
    if aligned_sizes(topk_ids.numel(), block_size, num_experts)[0] > MAX_ALIGNED:
        raise GraftInputError(
            f"{op}: num_slots + num_experts * (block_size - 1) must be at most 2**31 - 1 (int32 token indices); "
            f"got block_size={block_size}, num_experts={num_experts} for {topk_ids.numel()} slots"
        )


def align_block_size(topk_ids, block_size, num_experts):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded); see the module doc."""
    return call("moe.align_block_size", topk_ids, block_size, num_experts)


def validate_fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    # Fast path (value checks off, as on GPUs by default); the full checks below name any problem.
    if (isinstance(hidden, torch.Tensor) and isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
            and isinstance(topk_weights, torch.Tensor) and isinstance(topk_ids, torch.Tensor)
            and hidden.dtype in _FLOAT_SET and w13.dtype == hidden.dtype and w2.dtype == hidden.dtype
            and topk_weights.dtype in _FLOAT_SET and topk_ids.dtype == torch.int32 and hidden.ndim == 2
            and w13.ndim == 3 and w2.ndim == 3 and topk_weights.ndim == 2 and topk_ids.shape == topk_weights.shape
            and w13.shape[2] == hidden.shape[1] and w13.shape[1] and not w13.shape[1] % 2
            and w2.shape[0] == w13.shape[0] and w2.shape[1] == hidden.shape[1] and 2 * w2.shape[2] == w13.shape[1]
            and topk_ids.ndim == 2 and topk_ids.shape[0] == hidden.shape[0] and 0 < topk_ids.shape[1] <= w13.shape[0]
            and activation in ACTIVATIONS and w13.device == hidden.device and w2.device == hidden.device
            and topk_weights.device == hidden.device and topk_ids.device == hidden.device
            and not checks_values_on(topk_ids)):
        return
    op = "moe.fused_experts"
    check_tensor(f"{op}: hidden", hidden, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(f"{op}: w13", w13, ndim=3)
    check_tensor(f"{op}: w2", w2, ndim=3)
    check_tensor(f"{op}: topk_weights", topk_weights, dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden.dtype:
            raise GraftInputError(f"{op}: {name} has dtype {w.dtype}, expected hidden's dtype {hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, h13 = w13.shape
    if h13 != hidden_size:
        raise GraftInputError(f"{op}: w13 is [E, 2I, H] = {tuple(w13.shape)} but hidden has H={hidden_size}")
    if two_i % 2 or two_i == 0:
        raise GraftInputError(f"{op}: w13 dim 1 must be 2*I (gate rows then up rows), got {two_i}")
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise GraftInputError(
            f"{op}: w2 must be [E, H, I] = {(num_experts, hidden_size, inter)} to match w13/hidden, got {tuple(w2.shape)}"
        )
    if topk_weights.shape[0] != num_tokens:
        raise GraftInputError(f"{op}: topk_weights has {topk_weights.shape[0]} rows, expected T={num_tokens}")
    _check_ids(op, topk_ids, num_experts, num_tokens)
    if topk_ids.shape != topk_weights.shape:
        raise GraftInputError(
            f"{op}: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must have one shape"
        )
    if topk_ids.shape[1] <= 0 or topk_ids.shape[1] > num_experts:
        raise GraftInputError(f"{op}: top_k must be in [1, num_experts={num_experts}], got {topk_ids.shape[1]}")
    if activation not in ACTIVATIONS:
        raise GraftInputError(f"{op}: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    """Weighted sum over each token's top-k expert MLPs (SiLU-gated); see the module doc."""
    return call("moe.fused_experts", hidden, w13, w2, topk_weights, topk_ids, activation)


OPS = [
    OpSpec(
        name="moe.topk_routing",
        family="moe",
        signature="(router_logits[T,E], top_k:int, renormalize:bool=True, scoring:str='softmax') "
        "-> (topk_weights fp32[T,k], topk_ids int32[T,k])",
        reference=topk_routing_reference,
        description="softmax (or sigmoid) scores in fp32, top-k experts per token, optional renormalization",
        validate=validate_topk_routing,
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="moe.align_block_size",
        family="moe",
        signature="(topk_ids int32[T,k], block_size:int, num_experts:int) -> (sorted_token_ids int32"
        "[T*k+E*(block_size-1)], expert_ids int32[num_blocks], num_tokens_post_padded int32[1])",
        reference=align_block_size_reference,
        description="group (token, slot) pairs by expert, padded per expert to a multiple of block_size",
        validate=validate_align_block_size,
        # Its checks are all cheap or of values: a remembered signature runs them all (block_size
        # and num_experts then matched by type only, and checked here).
        check_values=validate_align_block_size,
        dtypes=(torch.int32,),
    ),
    OpSpec(
        name="moe.fused_experts",
        family="moe",
        signature="(hidden[T,H], w13[E,2I,H], w2[E,H,I], topk_weights[T,k], topk_ids int32[T,k], "
        "activation:str='silu') -> [T,H]",
        reference=fused_experts_reference,
        description="grouped expert GEMMs with fused SiLU-and-mul and routing-weighted combine",
        validate=validate_fused_experts,
        check_values=check_fused_experts_values,
        grad_inputs=(0, 1, 2, 3),
    ),
]


# FP8 block-scaled mixture of experts (DeepSeek-V3 style): ``moe.fused_experts_fp8``.
#
# ``fused_experts_fp8(hidden [T, H], w13_q [E, 2I, H], w2_q [E, H, I], w13_scale, w2_scale,
# topk_weights [T, k], topk_ids int32 [T, k], activation="silu")``
#     The MoE of :func:`graft.ops.moe.fused_experts` with fp8 e4m3 expert weights
#     (``float8_e4m3fn``, or ``float8_e4m3fnuz`` on MI300) and fp32 scales per 128x128 block:
#     ``w13_scale [E, ceil(2I/128), ceil(H/128)]``, ``w2_scale [E, ceil(H/128), ceil(I/128)]``
#     (:func:`graft.quant.quantize_fp8_block` makes both). Activations are quantized to the
#     weights' fp8 format per token per 128 features, as DeepSeek-V3 runs: ``hidden`` before
#     GEMM 1, and the SiLU-and-mul output, rounded to hidden's dtype, before GEMM 2
#     (:func:`graft.quant.quantize_fp8_per_token_group`). ``hidden`` is fp16/bf16/fp32; the
#     result [T, H] has its dtype. Kept a separate op (not a flag of ``moe.fused_experts``) so
#     that op's signature and every backend of it stay as they are.
#
# The reference dequantizes those very fp8 values and computes in fp32, so an
# implementation differs from it by accumulation order and roundings only.

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def validate_fused_experts_fp8(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    op = "moe.fused_experts_fp8"
    check_tensor(f"{op}: w13_q", w13_q, dtypes=FP8_DTYPES, ndim=3)
    check_tensor(f"{op}: w2_q", w2_q, dtypes=FP8_DTYPES, ndim=3)
    if w2_q.dtype != w13_q.dtype:
        raise GraftInputError(f"{op}: w2_q dtype {w2_q.dtype} must match w13_q dtype {w13_q.dtype}")
    check_tensor(f"{op}: hidden", hidden, dtypes=FLOAT_DTYPES, ndim=2)
    # Shapes, routing tensors and devices: the bf16 op's checks, on zero-memory stand-ins
    # of the weights' shapes in hidden's dtype.
    def stand_in(w):
        return torch.empty((), device=w.device, dtype=hidden.dtype).expand(w.shape)

    try:
        validate_fused_experts(hidden, stand_in(w13_q), stand_in(w2_q), topk_weights, topk_ids, activation)
    except GraftInputError as exc:
        raise GraftInputError(str(exc).replace("moe.fused_experts:", f"{op}:").replace("w13 ", "w13_q ")
                              .replace("w2 ", "w2_q ")) from None
    e, two_i, h = w13_q.shape
    inter = two_i // 2
    for name, scale, shape in (("w13_scale", w13_scale, (e, _blocks(two_i), _blocks(h))),
                               ("w2_scale", w2_scale, (e, _blocks(h), _blocks(inter)))):
        check_tensor(f"{op}: {name}", scale, dtypes=(torch.float32,), ndim=3, device=hidden.device)
        if tuple(scale.shape) != shape:
            raise GraftInputError(f"{op}: {name} has shape {tuple(scale.shape)}; expected one scale per 128x128 "
                                  f"block: {list(shape)}")


def fused_experts_fp8(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    """fp8 block-scaled expert MLPs; see the module docstring."""
    return call("moe.fused_experts_fp8", hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation)


OPS += [
    OpSpec(
        name="moe.fused_experts_fp8",
        family="moe",
        signature="(hidden[T,H], w13_q fp8[E,2I,H], w2_q fp8[E,H,I], w13_scale[E,2I/128,H/128], "
        "w2_scale[E,H/128,I/128], topk_weights[T,k], topk_ids int32[T,k], activation:str='silu') -> [T,H]",
        reference=fused_experts_fp8_reference,
        description="DeepSeek-V3-style fp8 experts: 128x128 block-scaled weights, per-token-group fp8 activations",
        validate=validate_fused_experts_fp8,
        check_values=check_fused_experts_fp8_values,
    ),
]


# The conformance cases, re-exported here (imported last: a cases module may use this module's names).
from graft.ops.moe.cases import (_distinct_logits, random_topk_ids, make_moe_inputs, fused_experts_flops,
                                 FUSED_EXPERTS_ATOL, CASES, quantize_experts)
