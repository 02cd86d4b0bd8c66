"""TorchTitan modules whose compute goes through graft ops.

Each class subclasses the TorchTitan module it stands in for and keeps its constructor,
parameters and their names, ``param_init`` and ``sharding_config``, so FSDP2, TP/SP plans,
activation checkpointing and checkpoints see the same module. Only ``forward`` changes:

* ``GraftRMSNorm``: ``fused.rms_norm``;
* ``GraftFeedForward``: the SwiGLU activation ``silu(w1 x) * w3 x`` as ``fused.silu_and_mul``
  (w1, w2, w3 stay TorchTitan's Linears, so their sharding is untouched).

Where a call arrives in a form the graft path does not take (a DTensor activation, which
TorchTitan's ``partial_dtensor`` SPMD backend passes; its default ``spmd_types`` backend
passes local tensors), the module runs TorchTitan's own forward, counts
``fallback.<Module>`` and logs the reason once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.nn_modules import RMSNorm

from graft.adapters.torchtitan.integration import counter

_DTENSOR = "DTensor activation (partial_dtensor SPMD backend): TorchTitan's own code serves it"


class GraftRMSNorm(RMSNorm):
    """TorchTitan's ``RMSNorm`` (``torch.nn.RMSNorm``) on ``fused.rms_norm``."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if isinstance(x, DTensor) or isinstance(weight, DTensor):
            counter.fallback("GraftRMSNorm", _DTENSOR)
            return super().forward(x)
        if weight is None:  # elementwise_affine=False: the converter does not swap these
            counter.fallback("GraftRMSNorm", "no weight (elementwise_affine=False)")
            return super().forward(x)
        # torch.nn.RMSNorm's eps=None means the input dtype's machine epsilon
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return counter.run("fused.rms_norm", x, weight, eps)


class GraftFeedForward(FeedForward):
    """TorchTitan's SwiGLU ``FeedForward`` with its activation on ``fused.silu_and_mul``."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if isinstance(gate, DTensor) or isinstance(up, DTensor):
            counter.fallback("GraftFeedForward", _DTENSOR)
            return self.w2(F.silu(gate) * up)
        # silu_and_mul takes [..., 2*H]: one copy of the two projections side by side
        return self.w2(counter.run("fused.silu_and_mul", torch.cat((gate, up), dim=-1)))
