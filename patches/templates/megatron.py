"""Megatron-core: graft's Triton RMSNorm as a norm module under ``megatron/core/fusions``,
usable as a ``ModuleSpec`` norm submodule (``TritonRMSNorm(config, hidden_size, eps)``)."""
from __future__ import annotations

from graft.patches.template import CreateFile, PatchTemplate
from graft.patches.templates import _rms_norm

MODULE_PATH = "megatron/core/fusions/fused_rms_norm_triton.py"

HEADER = '''\
# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
"""Triton RMSNorm module for layer specs (``submodules.input_layernorm`` etc.)."""

import torch
import triton
import triton.language as tl

'''

MODULE = '''

class TritonRMSNorm(torch.nn.Module):
    """RMSNorm with the norm-module signature layer specs build: (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.config = config
        self.eps = eps
        dtype = getattr(config, "params_dtype", None) or torch.float32
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        setattr(self.weight, "sequence_parallel", getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_triton(x, self.weight, self.eps)[0]
'''


def _changes() -> list:
    return [CreateFile(MODULE_PATH, HEADER + _rms_norm.kernel_and_launcher() + MODULE)]


def templates() -> list:
    return [
        PatchTemplate(
            name="megatron-triton-rms-norm",
            framework="megatron",
            supported=">=0.16,<0.17",
            subject="Add a Triton RMSNorm module for layer specs",
            body=_rms_norm.BODY + """

TritonRMSNorm has the (config, hidden_size, eps) constructor that
ModuleSpec norm submodules are built with, so a spec can use it in place
of TENorm/WrappedTorchNorm without Transformer Engine or Apex.""",
            changes=_changes,
            ops=("fused.rms_norm",),
            import_checks=("megatron.core.fusions.fused_rms_norm_triton",),
        )
    ]
