"""Megatron-core submodules whose compute goes through graft ops.

Each class keeps the Megatron module it stands in for (constructor, parameters and their
names, tensor-parallel attributes, sharded state dict), so a layer built from graft's spec
loads the same checkpoints as one built from Megatron's local spec. Only the local compute
changes:

* ``GraftColumnParallelLinear`` / ``GraftRowParallelLinear``: the per-rank GEMM is
  ``gemm.linear``; Megatron's tensor-parallel communication around it is unchanged (the
  column-parallel dgrad all-reduce overlaps the wgrad GEMM, as in Megatron).
* ``GraftNorm`` (``GraftRMSNorm`` / ``GraftLayerNorm``, following ``config.normalization``):
  ``fused.rms_norm`` / ``fused.layer_norm``.
* ``GraftDotProductAttention``: ``attention.prefill`` (causal / no-mask / packed ``thd``).
* ``GraftSequentialMLP``: MoE experts as one ``moe.fused_experts`` call.

When a call needs a feature the graft path does not cover (listed per class), the module
runs Megatron's own code for it, counts a ``fallback.*`` in
:data:`graft.adapters.megatron.counter.calls` and logs the reason once (INFO,
``graft.integration.megatron``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.experts import SequentialMLP

from graft.adapters.megatron._autograd import call_with_reference_grad
from graft.adapters.megatron.integration import counter
from graft.ops.attention import prefill_reference
from graft.ops.fused import layer_norm_reference, rms_norm_reference
from graft.ops.gemm import linear_reference
from graft.ops.moe import fused_experts_reference

# ---------------------------------------------------------------------------- linear layers


def graft_linear(x, weight, bias=None):
    return call_with_reference_grad("gemm.linear", linear_reference, x, weight, bias)


def _linear_no_grad(x, weight, bias=None):
    """The forward of a linear whose gradients another autograd function computes: one
    ``gemm.linear`` dispatch, counted under the implementation that served it."""
    return counter.run("gemm.linear", x, weight, bias)


def _megatron_gemm_reason(kwargs) -> str | None:
    """Why this local GEMM must stay Megatron's (its autograd function does the comm), or None."""
    if kwargs.get("gradient_accumulation_fusion"):
        return "gradient_accumulation_fusion"
    if kwargs.get("sequence_parallel"):
        return "sequence_parallel"
    if kwargs.get("grad_output_buffer") is not None:
        return "deferred embedding wgrad"
    return None


class _GraftLocalGemm:
    """Replaces the linear layers' local GEMM (``_forward_impl``) with ``gemm.linear``.

    Under tensor parallelism (``allreduce_dgrad``) the input gradient is all-reduced over
    the TP group, overlapped with the weight-gradient GEMM (:mod:`.linear_tp`), as
    Megatron's own autograd function does.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        reason = "positional arguments graft does not read" if args else _megatron_gemm_reason(kwargs)
        if reason is None and kwargs.get("allreduce_dgrad") and not weight.requires_grad:
            reason = "allreduce_dgrad with a frozen weight"
        if reason is not None:
            counter.fallback(type(self).__name__, reason)
            return super()._forward_impl(input, weight, *args, **kwargs)
        bias = kwargs.get("bias")
        if kwargs.get("allreduce_dgrad") and torch.is_grad_enabled():
            from graft.adapters.megatron.linear_tp import linear_allreduce_dgrad

            return linear_allreduce_dgrad(_linear_no_grad, input, weight, bias, kwargs.get("tp_group"))
        return graft_linear(input, weight, bias)


class GraftColumnParallelLinear(_GraftLocalGemm, ColumnParallelLinear):
    """``ColumnParallelLinear`` with its per-rank GEMM on ``gemm.linear``; returns ``(output, bias)``."""


class GraftRowParallelLinear(_GraftLocalGemm, RowParallelLinear):
    """``RowParallelLinear`` with its per-rank GEMM on ``gemm.linear``; returns ``(output, bias)``."""


# ---------------------------------------------------------------------------- norms

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


class GraftNorm:
    """The norm ``config.normalization`` asks for, on graft ops: :class:`GraftRMSNorm` or
    :class:`GraftLayerNorm` (as Megatron's ``WrappedTorchNorm`` follows the config).

    ``expected`` (a spec's ``normalization`` argument) must agree with the config; any other
    normalization (``L2Norm``) is refused with a clear error rather than silently replaced.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str | None = None, expected: str | None = None):
        norm = getattr(config, "normalization", "LayerNorm")
        if norm not in NORMALIZATIONS:
            raise ValueError(f"graft's Megatron spec serves config.normalization in {NORMALIZATIONS}, got {norm!r}; "
                             "use Megatron's own layer spec for it")
        if expected is not None and expected != norm:
            raise ValueError(f"the graft layer spec was built for normalization={expected!r} but "
                             f"config.normalization is {norm!r}; build the spec with normalization={norm!r} "
                             "(or None, to follow the config)")
        module = GraftRMSNorm if norm == "RMSNorm" else GraftLayerNorm
        return module(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma)


class _GraftNormBase(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None):
        super().__init__()
        self.config = config
        self.eps = eps
        self.zero_centered_gamma = bool(zero_centered_gamma or getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def _scale(self, x):
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return weight.to(x.dtype) if weight.dtype != x.dtype else weight

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GraftRMSNorm(_GraftNormBase):
    """RMSNorm on ``fused.rms_norm``; the parameter is ``weight`` like ``torch.nn.RMSNorm``'s.

    Built by Megatron as ``build_module(spec, config=..., hidden_size=..., eps=...)``.
    ``layernorm_zero_centered_gamma`` is honoured (the scale is ``1 + weight``).
    """

    def forward(self, x):
        return call_with_reference_grad("fused.rms_norm", rms_norm_reference, x, self._scale(x), self.eps)


class GraftLayerNorm(_GraftNormBase):
    """LayerNorm on ``fused.layer_norm``; parameters ``weight`` and ``bias`` like ``torch.nn.LayerNorm``'s
    (so local-spec LayerNorm checkpoints load). ``layernorm_zero_centered_gamma`` is honoured."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None):
        super().__init__(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.bias, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        bias = self.bias.to(x.dtype) if self.bias.dtype != x.dtype else self.bias
        return call_with_reference_grad("fused.layer_norm", layer_norm_reference, x, self._scale(x), bias, self.eps)


# ---------------------------------------------------------------------------- core attention


def _prefill(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    return call_with_reference_grad("attention.prefill", prefill_reference, q, k, v, cu_q, cu_k, max_q, max_k,
                                    causal, scale)


_verified_mask: list = [None]  # (tensor, version) of the last mask found causal: layers of a step share one


def _is_causal_mask(mask, sq, sk) -> bool:
    """Whether Megatron's boolean ``attention_mask`` (True = masked, broadcastable to
    ``[b, h, sq, sk]``) is exactly the causal mask, which ``attention.prefill`` serves.

    Reading the mask is a device sync, done once per mask tensor (all layers of a step pass
    the same one). With GRAFT_CHECK_VALUES=0 the mask is not read and the causal mask type
    decides, as in Megatron's Transformer Engine and flash-attention backends.
    """
    from graft.ops._validate import can_read_values

    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() < 2 or sq is None:
        return False
    if tuple(mask.shape[-2:]) != (sq, sk):
        return False
    if not can_read_values(mask):
        return True
    last = _verified_mask[0]
    if last is not None and last[0] is mask and last[1] == mask._version:
        return True
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1 + sk - sq)
    if not bool((mask == causal).all()):
        return False
    _verified_mask[0] = (mask, mask._version)
    return True


class GraftDotProductAttention(DotProductAttention):
    """Megatron's local core attention with the attention itself on ``attention.prefill``.

    Inputs as Megatron's: ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]``
    (GQA when ``ng < np``); output ``[sq, b, np * hn]``. Served by graft: causal or unmasked
    attention with ``attention_mask=None``, the causal mask type with the causal
    ``attention_mask`` Megatron's data pipeline passes (checked once per mask tensor, see
    :func:`_is_causal_mask`), and packed sequences (``packed_seq_params``, ``thd``), which
    Megatron's local class does not support. Megatron's own path serves any other
    ``attention_mask`` tensor, attention dropout while training, attention bias,
    non-vanilla softmax, sliding windows and query-key layer scaling.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config_reason = self._static_reason()
        self._cu_seqlens = {}  # (batch, seq, device) -> the uniform batch's cu_seqlens (int32)

    def _static_reason(self) -> str | None:
        """What in the config (fixed once the layer is built) needs Megatron's own attention."""
        if self.config.softmax_type != "vanilla":
            return f"softmax_type={self.config.softmax_type}"
        if self.config.window_size is not None:
            return "sliding window"
        if self.config.apply_query_key_layer_scaling:
            return "apply_query_key_layer_scaling"
        return None

    def _megatron_reason(self, attention_mask, attention_bias, mask_type, sq=None, sk=None) -> str | None:
        if attention_mask is not None and not (mask_type == AttnMaskType.causal and _is_causal_mask(attention_mask, sq, sk)):
            return "explicit attention_mask"
        if attention_bias is not None:
            return "attention_bias"
        if self.training and self.attention_dropout.p > 0:
            return "attention dropout"
        if self._config_reason is not None:
            return self._config_reason
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
            return f"mask type {mask_type}"
        return None

    def _uniform_cu_seqlens(self, batch: int, seq: int, device):
        """``[0, seq, 2*seq, ...]``: every batch element is one sequence. Kept per shape (read
        only by the op), so a step does not rebuild it in every layer and pass."""
        key = (batch, seq, device)
        cu = self._cu_seqlens.get(key)
        if cu is None:
            if len(self._cu_seqlens) >= 8:  # shapes vary (e.g. eval lengths): stay bounded
                self._cu_seqlens.clear()
            cu = self._cu_seqlens[key] = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
        return cu

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        reason = self._megatron_reason(attention_mask, attention_bias, mask_type, query.shape[0], key.shape[0])
        if reason is not None:
            if packed_seq_params is not None:
                raise NotImplementedError(f"graft's core attention cannot serve packed sequences with {reason}")
            counter.fallback("GraftDotProductAttention", reason)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        causal = mask_type == AttnMaskType.causal
        if packed_seq_params is not None:
            # thd layout: [t, 1, heads, dim], sequences delimited by cu_seqlens.
            p = packed_seq_params
            out = _prefill(query.squeeze(1), key.squeeze(1), value.squeeze(1), p.cu_seqlens_q.int(),
                           p.cu_seqlens_kv.int(), int(p.max_seqlen_q), int(p.max_seqlen_kv), causal,
                           self.softmax_scale)
            return out.reshape(out.shape[0], 1, -1)
        sq, batch = query.shape[:2]
        sk = key.shape[0]
        # [s, b, h, d] -> packed [b*s, h, d]: each batch element is one sequence.
        q = query.transpose(0, 1).reshape(batch * sq, *query.shape[2:])
        k = key.transpose(0, 1).reshape(batch * sk, *key.shape[2:])
        v = value.transpose(0, 1).reshape(batch * sk, *value.shape[2:])
        cu_q = self._uniform_cu_seqlens(batch, sq, query.device)
        cu_k = cu_q if sk == sq else self._uniform_cu_seqlens(batch, sk, query.device)
        out = _prefill(q, k, v, cu_q, cu_k, sq, sk, causal, self.softmax_scale)
        return out.view(batch, sq, -1).transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------- MoE experts


class GraftSequentialMLP(SequentialMLP):
    """``SequentialMLP`` (one MLP per local expert, same parameters and checkpoints) whose
    forward is one ``moe.fused_experts`` call over all local experts.

    Megatron's token dispatcher hands the experts tokens already grouped by expert
    (``tokens_per_expert``) with their routing probabilities; each row is one (token,
    expert) pair, i.e. top-1 over the local experts with weight = its probability. Served
    by graft: SwiGLU experts (``gated_linear_unit`` with ``F.silu``) without biases,
    clamps, offsets, fp8/fp4 or expert tensor parallelism; otherwise Megatron's loop runs.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config_reason = self._megatron_reason()  # config and expert layout are fixed once built

    def _megatron_reason(self) -> str | None:
        c = self.config
        if not (c.gated_linear_unit and c.activation_func is F.silu):
            return "experts are not SwiGLU"
        if c.add_bias_linear:
            return "expert biases"
        if getattr(c, "activation_func_clamp_value", None) is not None or getattr(c, "glu_linear_offset", None):
            return "GLU clamp/offset"
        if c.fp8 or getattr(c, "fp4", None):
            return "fp8/fp4"
        if c.moe_apply_probs_on_input:
            return "moe_apply_probs_on_input"
        if any(e.linear_fc1.tp_group.size() > 1 for e in self.local_experts):
            return "expert tensor parallelism"
        return None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        reason = self._config_reason
        if reason is not None:
            counter.fallback("GraftSequentialMLP", reason)
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden = permuted_local_hidden_states
        w13 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2I, H]: gate rows, then up
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, I]
        counts = torch.as_tensor(tokens_per_expert, device=hidden.device).long()
        expert_ids = torch.repeat_interleave(torch.arange(len(self.local_experts), device=hidden.device), counts)
        topk_ids = expert_ids.to(torch.int32).unsqueeze(1)
        topk_weights = permuted_probs.to(hidden.dtype).unsqueeze(1)
        out = call_with_reference_grad("moe.fused_experts", fused_experts_reference,
                                       hidden, w13, w2, topk_weights, topk_ids, "silu")
        return out, None


__all__ = [
    "GraftColumnParallelLinear",
    "GraftRowParallelLinear",
    "GraftNorm",
    "GraftRMSNorm",
    "GraftLayerNorm",
    "GraftDotProductAttention",
    "GraftSequentialMLP",
]
