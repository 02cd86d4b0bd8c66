"""vLLM: graft's Triton RMSNorm as an implementation of vLLM's IR ops.

vLLM 0.33 routes ``RMSNorm`` through IR ops (``vllm.ir.ops.rms_norm`` and
``fused_add_rms_norm``) whose providers live in ``vllm/kernels/``; the patch adds a
provider module there and imports it with the other Triton kernels.
"""
from __future__ import annotations

from graft.patches.template import CreateFile, PatchTemplate, ReplaceText
from graft.patches.templates import _rms_norm

PROVIDER = "triton_rms"
MODULE_PATH = "vllm/kernels/triton/rms_norm.py"

HEADER = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton RMSNorm implementations of the ``rms_norm`` and ``fused_add_rms_norm`` IR ops.

Select them with ``kernel_config.ir_op_priority`` (provider ``"{provider}"``).
"""

import torch
from torch import Tensor

from vllm import ir
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

'''

REGISTRATION = '''

def _supports(x, weight, epsilon, variance_size=None):
    # The kernel normalises over the whole last dim and needs a weight of x's dtype.
    return (
        variance_size is None
        and weight is not None
        and x.dtype in _SUPPORTED_DTYPES
        and weight.dtype == x.dtype
        and x.dim() >= 1
        and x.shape[-1] > 0
    )


def _supports_add(x, x_residual, weight, epsilon, variance_size=None):
    return _supports(x, weight, epsilon, variance_size) and x_residual.shape == x.shape


@ir.ops.rms_norm.register_impl(
    "{provider}", supports_args=_supports, supported=current_platform.is_cuda_alike()
)
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    return rms_norm_triton(x, weight, epsilon)[0]


@ir.ops.fused_add_rms_norm.register_impl(
    "{provider}", supports_args=_supports_add, supported=current_platform.is_cuda_alike()
)
def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    return rms_norm_triton(x, weight, epsilon, residual=x_residual)
'''

INIT_PATH = "vllm/kernels/triton/__init__.py"


def _changes() -> list:
    content = HEADER.format(provider=PROVIDER) + _rms_norm.kernel_and_launcher() + REGISTRATION.format(provider=PROVIDER)
    return [
        CreateFile(MODULE_PATH, content),
        ReplaceText(INIT_PATH, "from . import activation\n", "from . import activation, rms_norm\n"),
        ReplaceText(INIT_PATH, '__all__ = ["activation"]', '__all__ = ["activation", "rms_norm"]'),
    ]


def templates() -> list:
    return [
        PatchTemplate(
            name="vllm-triton-rms-norm",
            framework="vllm",
            supported=">=0.33,<0.34",
            subject="Add Triton RMSNorm provider for the rms_norm IR ops",
            body=_rms_norm.BODY + f"""

Registered as provider "{PROVIDER}" for both vllm.ir.ops.rms_norm and
vllm.ir.ops.fused_add_rms_norm, with the same schema as the native
implementation; it is only eligible on CUDA-alike platforms and for
inputs without variance_size (supports_args), and is opt-in through
kernel_config.ir_op_priority like the other providers.""",
            changes=_changes,
            ops=("fused.rms_norm",),
            import_checks=("vllm.kernels.triton.rms_norm",),
        )
    ]
