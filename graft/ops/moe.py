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

from graft.cases import OpCase
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import acc, acc_dtype, check_same_device, check_tensor, checks_values_on, readable_bounds
from graft.quant import FP8_BLOCK, dequantize_fp8, quantize_fp8_block, quantize_fp8_per_token_group
from graft.registry import OpSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu",)
NOT_ON_RANK = -1  # expert id of a slot whose expert lives on another rank (expert parallelism)
_FLOAT_SET = frozenset(FLOAT_DTYPES)
# sorted_token_ids are int32 indices: the padded length num_slots + E*(block_size-1) must fit.
MAX_ALIGNED = 2**31 - 1


# ---------------------------------------------------------------- shared helpers

def aligned_sizes(num_slots: int, block_size: int, num_experts: int) -> tuple[int, int]:
    """(len(sorted_token_ids), len(expert_ids)): fixed upper bounds, so fake impls can state them."""
    max_padded = num_slots + num_experts * (block_size - 1)
    return max_padded, -(-max_padded // block_size)


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


def valid_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Which ids take part: the others (-1, or out of range with the value checks off) are skipped."""
    return (ids >= 0) & (ids < num_experts)


# ---------------------------------------------------------------- topk_routing

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


def topk_routing_reference(router_logits, top_k, renormalize=True, scoring="softmax"):
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    # Ties -> lowest expert id: a stable descending sort keeps equal scores in id order.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(scores, 1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), order.to(torch.int32).contiguous()


def topk_routing(router_logits, top_k, renormalize=True, scoring="softmax"):
    """Top-k experts per token: (weights fp32 [T, k], ids int32 [T, k]); see the module doc."""
    return call("moe.topk_routing", router_logits, top_k, renormalize, scoring)


# ---------------------------------------------------------------- align_block_size

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


def align_block_size_reference(topk_ids, block_size, num_experts):
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    max_padded, max_blocks = aligned_sizes(num_slots, block_size, num_experts)
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=device)
    slots = torch.nonzero(valid_ids(flat, num_experts)).flatten()  # skipped ids are never placed
    experts = flat[slots]
    counts = torch.bincount(experts, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(experts, stable=True).indices  # stable: slots of one expert in index order
    if slots.numel():
        rank = torch.arange(slots.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[experts[order]]
        sorted_ids[starts[experts[order]] + rank] = slots[order].to(torch.int32)
    total = int(padded.sum())
    blocks = torch.arange(total // block_size, device=device)
    ends_in_blocks = torch.cumsum(padded, 0) // block_size
    expert_ids[: total // block_size] = torch.searchsorted(ends_in_blocks, blocks, right=True).to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=device)


def align_block_size(topk_ids, block_size, num_experts):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded); see the module doc."""
    return call("moe.align_block_size", topk_ids, block_size, num_experts)


# ---------------------------------------------------------------- fused_experts

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


def fused_experts_reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    """A plain loop over experts with fp32 accumulation: the semantics every backend matches."""
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, hidden_size, dtype=acc_dtype(hidden), device=hidden.device)
    weights = acc(topk_weights)
    ids = topk_ids.long()
    for expert in range(w13.shape[0]):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        x = acc(hidden[tokens])
        gate_up = x @ acc(w13[expert]).t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ acc(w2[expert]).t()
        out.index_add_(0, tokens, y * weights[tokens, slots].unsqueeze(1))
    return out.to(hidden.dtype)


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    """Weighted sum over each token's top-k expert MLPs (SiLU-gated); see the module doc."""
    return call("moe.fused_experts", hidden, w13, w2, topk_weights, topk_ids, activation)


# ---------------------------------------------------------------- catalogue

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


# ---------------------------------------------------------------- cases

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


# =========================================================================== moe.fused_experts_fp8
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


def quantize_act(x: torch.Tensor, fp8_dtype) -> tuple:
    """Per token per 128 features, as both GEMMs' activations are quantized."""
    return quantize_fp8_per_token_group(x, FP8_BLOCK, fp8_dtype)


def fused_experts_fp8_reference(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    num_tokens, hidden_size = hidden.shape
    inter = w13_q.shape[1] // 2
    fmt = w13_q.dtype
    x = dequantize_fp8(*quantize_act(hidden, fmt), (1, FP8_BLOCK))
    w13 = dequantize_fp8(w13_q, w13_scale, (FP8_BLOCK, FP8_BLOCK))
    w2 = dequantize_fp8(w2_q, w2_scale, (FP8_BLOCK, FP8_BLOCK))
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    weights, ids = topk_weights.float(), topk_ids.long()
    for expert in range(w13_q.shape[0]):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[expert].t()
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        act = dequantize_fp8(*quantize_act(act, fmt), (1, FP8_BLOCK))
        out.index_add_(0, tokens, (act @ w2[expert].t()) * weights[tokens, slots].unsqueeze(1))
    return out.to(hidden.dtype)


def fused_experts_fp8(hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation="silu"):
    """fp8 block-scaled expert MLPs; see the module docstring."""
    return call("moe.fused_experts_fp8", hidden, w13_q, w2_q, w13_scale, w2_scale, topk_weights, topk_ids, activation)


def quantize_experts(w13, w2, fp8_dtype=torch.float8_e4m3fn):
    """bf16/fp32 expert weights -> ``(w13_q, w2_q, w13_scale, w2_scale)`` with 128x128 block scales."""
    (w13_q, w13_s), (w2_q, w2_s) = quantize_fp8_block(w13, dtype=fp8_dtype), quantize_fp8_block(w2, dtype=fp8_dtype)
    return w13_q, w2_q, w13_s, w2_s


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
