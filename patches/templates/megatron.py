"""Megatron-core: graft's Triton RMSNorm as a norm module under ``megatron/core/fusions``,
usable as a ``ModuleSpec`` norm submodule (``TritonRMSNorm(config, hidden_size, eps)``)."""
from __future__ import annotations

from graft.patches.kernel_source import function_source
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

BACKWARD = '''

def rms_norm_backward_triton(dy, x, weight, eps):
    """(dx, dweight) of ``rms_norm_triton(x, weight, eps)[0]`` for the output gradient ``dy``.

    Each program walks a block of rows and keeps its share of dweight in fp32, one row of
    a [programs, hidden] buffer that is summed afterwards (no atomics).
    """
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    dy2 = dy.reshape(-1, hidden).contiguous()
    rows = x2.shape[0]
    dx = torch.empty_like(x2)
    if rows == 0 or hidden == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    per = triton.cdiv(rows, min(rows, 2 * sms))
    programs = triton.cdiv(rows, per)
    dw = torch.empty((programs, hidden), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(hidden), 8192)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, x2, x2, dy2, weight.contiguous(), dx, dw,
        rows, hidden, per, dy2.stride(0), x2.stride(0), x2.stride(0), dy2.stride(0), float(eps),
        HAS_RESIDUAL=False, HAS_DRES=False, BLOCK=block, ONE_TILE=block >= hidden, num_warps=8,
    )
    return dx.view(x.shape), dw.sum(0).to(weight.dtype)


class _TritonRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_triton(x, weight, eps)[0]

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward_triton(dy, x, weight, ctx.eps)
        return dx, dw, None
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
        return _TritonRMSNormFunction.apply(x, self.weight, self.eps)
'''


def _changes() -> list:
    backward_kernel = "\n\n" + function_source(_rms_norm.KERNEL_MODULE, "_rms_norm_bwd_kernel")
    return [CreateFile(MODULE_PATH, HEADER + _rms_norm.kernel_and_launcher() + backward_kernel + BACKWARD + MODULE)]


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
of TENorm/WrappedTorchNorm without Transformer Engine or Apex. It trains:
a Triton backward gives dx per row and dweight from fp32 partial sums per
block of rows (no atomics).""",
            changes=_changes,
            ops=("fused.rms_norm",),
            import_checks=("megatron.core.fusions.fused_rms_norm_triton",),
        )
    ]
