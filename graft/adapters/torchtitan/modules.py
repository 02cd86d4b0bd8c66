"""TorchTitan modules whose compute goes through graft ops.

Each class subclasses the TorchTitan module it stands in for and keeps its constructor,
parameters and their names, ``param_init`` and ``sharding_config``, so FSDP2, TP/SP plans,
activation checkpointing and checkpoints see the same module. Only ``forward`` changes:

* ``GraftRMSNorm``: ``fused.rms_norm``;
* ``GraftFeedForward``: the SwiGLU activation ``silu(w1 x) * w3 x`` as ``fused.silu_and_mul``
  (w1, w2, w3 stay TorchTitan's Linears, so their sharding is untouched);
* ``GraftVarlenAttention``: TorchTitan's varlen inner attention (document masking: each
  document of a packed row attends causally within itself, boundaries where ``positions``
  restarts) as ``attention.prefill`` on the same cumulative lengths.

DTensor activations (TorchTitan's ``partial_dtensor`` SPMD backend under TP/SP) run on their
local shards, the way TorchTitan's own local-map modules do: both ops are row-wise (RMSNorm
normalizes the last dim; SwiGLU is elementwise per hidden unit), so a shard on any dim but the
normalized one (RMSNorm) or any matching shard of gate and up (SwiGLU, column-parallel ``w1`` /
``w3`` give ``Shard(-1)``) computes exactly its part of the result. A replicated RMSNorm weight
seen by sequence-sharded activations gets a ``Partial`` gradient (summed over the TP ranks by
DTensor, as torch's own sharding rule for ``rms_norm`` does). Where a call arrives in a layout
the local path does not take (a ``Partial`` activation, a sharded normalized dim, meshes that
differ), the module runs TorchTitan's own forward, counts ``fallback.<Module>`` and logs the
reason once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.nn_modules import RMSNorm

from graft.adapters.torchtitan.integration import counter

_DTENSOR = "DTensor layout graft's local-shard path does not take: TorchTitan's own code serves it"


def _from_local(out: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(out, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _rms_norm_dtensor(x, weight, eps):
    """``fused.rms_norm`` on the local shard of a DTensor ``x``; None where the layout does not allow it."""
    if not isinstance(x, DTensor) or not x.is_contiguous():
        return None
    last = x.ndim - 1
    for p in x.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % x.ndim != last)):
            return None
    if isinstance(weight, DTensor):
        if weight.device_mesh != x.device_mesh or not all(isinstance(p, Replicate) for p in weight.placements):
            return None
        # each rank's weight gradient covers its shard of the activations: a partial sum there
        w = weight.to_local(grad_placements=[Partial() if isinstance(p, Shard) else Replicate() for p in x.placements])
    elif any(isinstance(p, Shard) for p in x.placements):
        return None  # a plain weight would keep a per-rank partial gradient nobody sums
    else:
        w = weight
    return _from_local(counter.run("fused.rms_norm", x.to_local(), w, eps), x)


def _silu_and_mul_dtensor(gate, up):
    """``fused.silu_and_mul`` on local shards of DTensors ``gate``, ``up`` laid out alike; else None."""
    if not (isinstance(gate, DTensor) and isinstance(up, DTensor)):
        return None
    if gate.device_mesh != up.device_mesh or gate.placements != up.placements or gate.shape != up.shape:
        return None
    if any(p.is_partial() for p in gate.placements):
        return None
    local = counter.run("fused.silu_and_mul", torch.cat((gate.to_local(), up.to_local()), dim=-1))
    return _from_local(local, gate)


# The dtypes graft's fused ops take; TorchTitan's modules serve the others (float64...).
_GRAFT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rms_norm_differs(x, weight, normalized_shape) -> str | None:
    """Why ``fused.rms_norm`` would not compute what ``torch.nn.RMSNorm`` does for this call."""
    if len(tuple(normalized_shape)) != 1:
        return f"normalized over {len(tuple(normalized_shape))} dims; fused.rms_norm normalizes the last only"
    if x.dtype not in _GRAFT_DTYPES or weight.dtype not in _GRAFT_DTYPES:
        return f"dtype {x.dtype} (weight {weight.dtype}): fused.rms_norm takes float16, bfloat16 or float32"
    return None


class GraftRMSNorm(RMSNorm):
    """TorchTitan's ``RMSNorm`` (``torch.nn.RMSNorm``) on ``fused.rms_norm``."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None:  # elementwise_affine=False: the converter does not swap these
            counter.fallback("GraftRMSNorm", "no weight (elementwise_affine=False)")
            return super().forward(x)
        why = _rms_norm_differs(x, weight, self.normalized_shape)
        if why:  # graft's op would not compute what torch.nn.RMSNorm does here: TorchTitan's serves
            counter.fallback("GraftRMSNorm", why)
            return super().forward(x)
        # torch.nn.RMSNorm's eps=None means the input dtype's machine epsilon
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if isinstance(x, DTensor) or isinstance(weight, DTensor):
            out = _rms_norm_dtensor(x, weight, eps)
            if out is None:
                counter.fallback("GraftRMSNorm", _DTENSOR)
                return super().forward(x)
            return out
        return counter.run("fused.rms_norm", x, weight, eps)


class GraftFeedForward(FeedForward):
    """TorchTitan's SwiGLU ``FeedForward`` with its activation on ``fused.silu_and_mul``."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in _GRAFT_DTYPES:
            counter.fallback("GraftFeedForward", f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                             f"{up.dtype}: fused.silu_and_mul takes one shape in float16, bfloat16 or float32")
            return self.w2(F.silu(gate) * up)
        if isinstance(gate, DTensor) or isinstance(up, DTensor):
            out = _silu_and_mul_dtensor(gate, up)
            if out is None:
                counter.fallback("GraftFeedForward", _DTENSOR)
                return self.w2(F.silu(gate) * up)
            return self.w2(out)
        # silu_and_mul takes [..., 2*H]: one copy of the two projections side by side
        return self.w2(counter.run("fused.silu_and_mul", torch.cat((gate, up), dim=-1)))


from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher  # noqa: E402


def _replicated_local(w):
    """The local tensor of a plain or fully replicated DTensor weight; None for a sharded one."""
    if not isinstance(w, DTensor):
        return w
    if all(isinstance(p, Replicate) for p in w.placements):
        return w.to_local()
    return None


class GraftRoutedExperts(RoutedExperts):
    """TorchTitan's routed experts (local dispatch, grouped expert MLPs, scored combine) as one
    ``moe.fused_experts`` call on the router's top-k scores and ids.

    TorchTitan's own ``GroupedExperts`` runs its grouped GEMMs in bfloat16 (``x.bfloat16()``)
    whatever the model dtype; ``moe.fused_experts`` computes in the input's dtype with fp32
    accumulation, so an fp32 model's MoE output is more exact than TorchTitan's and differs
    from it at bfloat16 rounding: opt-in (``GraftConverter.Config(parts=(..., "moe"))``).
    Taken only with TorchTitan's local dispatch (its local dispatcher, or the all-to-all one
    without an EP mesh, which then dispatches locally) on plain tensors and
    unsharded expert weights; anything else (EP all-to-all, DeepEP, TP-sharded experts) runs
    TorchTitan's forward, counted as ``fallback.GraftRoutedExperts``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        experts = self.inner_experts
        why = None
        dispatcher = self.token_dispatcher
        # the local dispatcher, or the all-to-all one without an EP mesh (it then dispatches locally)
        if type(dispatcher) not in (LocalTokenDispatcher, AllToAllTokenDispatcher) or \
                getattr(dispatcher, "ep_mesh", None) is not None:
            why = f"{type(dispatcher).__name__} with expert parallelism: TorchTitan's dispatch and experts serve it"
        elif any(isinstance(t, DTensor) for t in (x_BLD, topk_scores_BLK, topk_expert_ids_BLK)):
            why = _DTENSOR
        elif type(experts) is not GroupedExperts:  # e.g. the MXFP8 converter's: its grouped GEMM differs
            why = f"{type(experts).__name__} is not TorchTitan's plain GroupedExperts"
        if why is None:
            w1, w2, w3 = (_replicated_local(w) for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))
            if w1 is None or w2 is None or w3 is None:
                why = "sharded expert weights (TP/EP): TorchTitan's experts serve them"
        if why is not None:
            counter.fallback("GraftRoutedExperts", why)
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        out = counter.run("moe.fused_experts", x_BLD.reshape(B * L, D), torch.cat((w1, w3), dim=1), w2,
                          topk_scores_BLK.reshape(B * L, K).float(),
                          topk_expert_ids_BLK.reshape(B * L, K).to(torch.int32), "silu")
        return out.view(B, -1, D)


from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata  # noqa: E402

# window_size -> causal for the windows attention.prefill computes (TorchTitan's (-1, 0) is
# causal, (-1, -1) full); a sliding window stays TorchTitan's.
_WINDOWS = {(-1, 0): True, (-1, -1): False}


def _local_heads(*tensors):
    """Local shards of DTensors laid out alike and split (if at all) on the heads dim (2 of
    [B, L, N, H]) only, with their placements; ``(None, why)`` for any other layout. Each
    head's attention is independent, so a head shard computes exactly its part; a batch or
    sequence shard would not match the packed rows' cumulative lengths."""
    first = tensors[0]
    if not all(isinstance(t, DTensor) for t in tensors):
        return None, "q, k, v are not all DTensors"
    for t in tensors:
        if t.device_mesh != first.device_mesh or t.placements != first.placements:
            return None, "q, k, v are laid out differently"
        for p in t.placements:
            if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % t.ndim == 2)):
                return None, f"placement {p} (attention.prefill takes a heads shard or a replica)"
    return [t.to_local() for t in tensors], None


class GraftVarlenAttention(VarlenAttention):
    """TorchTitan's ``VarlenAttention`` (document-masked attention over packed rows) on
    ``attention.prefill``, with TorchTitan's ``VarlenMetadata`` as the cumulative lengths.

    TorchTitan's own path calls torch's ``varlen_attn`` (flash attention; CUDA, bf16 only: it
    casts q, k, v to bfloat16); ``attention.prefill`` computes in the inputs' dtype with fp32
    softmax and accumulation, on any device graft has a backend for, forward and backward.
    Taken for causal and full windows with equal q/k and v head dims and no ``out_transform``
    (which needs the log-sum-exp), on plain tensors or heads-sharded DTensors; anything else
    (a sliding window, MLA's narrower value heads, an LSE epilogue) runs TorchTitan's forward,
    counted as ``fallback.GraftVarlenAttention`` with the reason.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, out_transform=None, **kwargs):
        causal = _WINDOWS.get(tuple(self.window_size))
        why = None
        if causal is None:
            why = f"window_size {tuple(self.window_size)}: attention.prefill computes causal or full windows"
        elif out_transform is not None:
            why = "an out_transform epilogue needs the log-sum-exp, which attention.prefill does not return"
        elif v_BLNH.shape[-1] != q_BLNH.shape[-1]:
            why = f"value head dim {v_BLNH.shape[-1]} != query head dim {q_BLNH.shape[-1]} (MLA)"
        elif not isinstance(attention_masks, VarlenMetadata):
            why = f"attention_masks is a {type(attention_masks).__name__}, not VarlenMetadata"
        tensors = (q_BLNH, k_BLNH, v_BLNH)
        dtensor = any(isinstance(t, DTensor) for t in tensors)
        if why is None and dtensor:
            local, why = _local_heads(*tensors)
            if local is not None:
                tensors = local
        if why is not None:
            counter.fallback("GraftVarlenAttention", why)
            return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale,
                                   out_transform=out_transform, **kwargs)
        q, k, v = tensors
        B, L, _, D = q.shape
        meta = attention_masks
        out = counter.run("attention.prefill", q.reshape(B * L, -1, D), k.reshape(B * L, -1, D),
                          v.reshape(B * L, -1, D), meta.cu_seq_q, meta.cu_seq_k, int(meta.max_q), int(meta.max_k),
                          causal, scale).view(B, L, -1, D)
        return _from_local(out, q_BLNH) if dtensor else out
