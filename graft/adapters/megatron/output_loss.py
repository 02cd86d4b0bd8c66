"""Megatron's output layer and language-model loss as one ``loss.fused_linear_cross_entropy``
call (opt-in): the ``[seq, batch, vocab]`` logits are never materialised when labels are given.

Megatron builds the output layer inside ``GPTModel`` (a ``ColumnParallelLinear``, not from the
layer spec), so this is a ``GPTModel`` subclass, :class:`GraftGPTModel`, built exactly like
``GPTModel`` (same arguments, parameters and checkpoints). With the option on
(``fused_loss=True``, or ``GRAFT_MEGATRON_FUSED_LOSS=1`` read once through graft's configuration
when the model is built), a forward with ``labels`` hands the final hidden states and labels
to the op with ``reduction="none"`` and returns Megatron's per-token losses ``[batch, seq]``
(fp32); gradients reach the hidden states and the output weight (shared with the embedding
or not) through the op's backward, which recomputes the logits chunk by chunk.

Where the fused path cannot reproduce Megatron's computation, Megatron's own output layer and
loss run, counted as ``fallback.fused_output_loss`` with the reason logged once: a
vocab-parallel output layer (tensor parallel > 1: the loss needs the cross-rank log-sum-exp
Megatron's ``vocab_parallel_cross_entropy`` computes), sequence parallelism, gradient
accumulation fusion, deferred embedding wgrad, multi-token prediction, inference contexts,
and a forward without labels (the caller wants logits).
"""
from __future__ import annotations

import logging

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from graft import settings
from graft.adapters.megatron._autograd import call_with_reference_grad
from graft.adapters.megatron.integration import FUSED_LOSS_ENV_VAR
from graft.adapters.megatron.integration import counter
from graft.ops.loss import fused_linear_cross_entropy_reference

log = logging.getLogger("graft.integration.megatron")

ENV_VAR = FUSED_LOSS_ENV_VAR  # declared with the integration's switch (graft info knows it without Megatron)
OP = "loss.fused_linear_cross_entropy"
FALLBACK = "fused_output_loss"


def static_reason(model_config, tp_size: int) -> str | None:
    """Why the fused output loss cannot serve a model with this config at all (None: it can)."""
    if tp_size > 1:
        return (f"vocab-parallel output layer (tensor parallel size {tp_size}): the loss needs Megatron's "
                "cross-rank log-sum-exp")
    if model_config.sequence_parallel:
        return "sequence parallelism"
    if model_config.gradient_accumulation_fusion:
        return "gradient_accumulation_fusion"
    if getattr(model_config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute"
    if getattr(model_config, "mtp_num_layers", None):
        return "multi-token prediction"
    return None


class GraftOutputLayer(ColumnParallelLinear):
    """Megatron's output ``ColumnParallelLinear`` (same parameters) that, when its model hands it
    labels for this forward, returns per-token losses ``[seq, batch]`` instead of logits."""

    _graft_labels = None  # [batch, seq] labels of the current forward, set by GraftGPTModel
    _graft_losses = None  # what it returned in their place, recognised by the model's loss

    def forward(self, input_, weight=None, runtime_gather_output=None):
        labels = self._graft_labels
        if labels is None:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        self._graft_labels = None
        if weight is None:
            weight = self.weight
        seq, batch, hidden = input_.shape
        # Rows in Megatron's [seq, batch] order, so the labels are transposed the same way.
        target = labels.transpose(0, 1).reshape(seq * batch)
        losses = call_with_reference_grad(OP, fused_linear_cross_entropy_reference, input_.reshape(seq * batch, hidden),
                                          weight, target, self.bias, -100, "none")
        losses = losses.view(seq, batch)
        self._graft_losses = losses
        return losses, None


class GraftGPTModel(GPTModel):
    """``GPTModel`` whose output layer and loss can run as one ``loss.fused_linear_cross_entropy``
    call (see the module doc). ``fused_loss``: True/False, or None to follow
    ``GRAFT_MEGATRON_FUSED_LOSS`` (default off, when this plain ``GPTModel`` behaves as Megatron's)."""

    def __init__(self, *args, fused_loss: bool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_loss = settings.get(ENV_VAR) if fused_loss is None else bool(fused_loss)
        self._fused_reason = None
        if self.fused_loss and self.post_process:
            self.output_layer.__class__ = GraftOutputLayer  # same module, parameters and state dict
            tp = self.output_layer.tp_group.size() if self.output_layer.tp_group is not None else 1
            self._fused_reason = static_reason(self.config, tp)
            if self._fused_reason is not None:
                log.warning("graft's fused output loss was asked for but cannot serve this model (%s): Megatron's "
                            "output layer and loss run", self._fused_reason)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, inference_context=None,
                *args, **kwargs):
        if not (self.fused_loss and self.post_process):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, inference_context,
                                   *args, **kwargs)
        reason = self._fused_reason
        if reason is None:
            if labels is None:
                reason = "no labels (the caller wants logits)"
            elif inference_context is not None or kwargs.get("inference_params") is not None:
                reason = "inference context"
        if reason is not None:
            counter.fallback(FALLBACK, reason)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, inference_context,
                                   *args, **kwargs)
        self.output_layer._graft_labels = labels
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, inference_context,
                                   *args, **kwargs)
        finally:
            self.output_layer._graft_labels = self.output_layer._graft_losses = None

    def compute_language_model_loss(self, labels, logits):
        if logits is not None and logits is getattr(self.output_layer, "_graft_losses", None):
            return logits.transpose(0, 1).contiguous()  # already the per-token losses: [s, b] -> [b, s]
        return super().compute_language_model_loss(labels, logits)
