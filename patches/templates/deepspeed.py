"""DeepSpeed: graft's Triton RMSNorm beside DeepSpeed's Triton inference kernels
(``deepspeed/ops/transformer/inference/triton/``), exported like ``layer_norm``."""
from __future__ import annotations

from graft.patches.template import CreateFile, InsertAfter, PatchTemplate
from graft.patches.templates import _rms_norm

MODULE_PATH = "deepspeed/ops/transformer/inference/triton/rms_norm.py"
INIT_PATH = "deepspeed/ops/transformer/inference/triton/__init__.py"

HEADER = '''\
# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Triton RMSNorm for inference, plain and fused with the residual add."""

import torch
import triton
import triton.language as tl

'''

API = '''

def rms_norm(x, weight, eps=1e-6):
    return rms_norm_triton(x, weight, eps)[0]


def rms_norm_residual(x, residual, weight, eps=1e-6):
    """Returns (rms_norm(x + residual) * weight, x + residual)."""
    return rms_norm_triton(x, weight, eps, residual=residual)
'''


def _changes() -> list:
    return [
        CreateFile(MODULE_PATH, HEADER + _rms_norm.kernel_and_launcher() + API),
        InsertAfter(INIT_PATH, r"^from \.layer_norm import layer_norm, layer_norm_residual$",
                    "from .rms_norm import rms_norm, rms_norm_residual"),
    ]


def templates() -> list:
    return [
        PatchTemplate(
            name="deepspeed-triton-rms-norm",
            framework="deepspeed",
            supported=">=0.19,<0.20",
            subject="Add Triton RMSNorm (with fused residual add) to the inference Triton ops",
            body=_rms_norm.BODY + """

Exported from deepspeed.ops.transformer.inference.triton as rms_norm and
rms_norm_residual, next to layer_norm/layer_norm_residual, for models
(Llama, Mistral, Qwen...) that normalise with RMSNorm.""",
            changes=_changes,
            ops=("fused.rms_norm",),
            import_checks=("deepspeed.ops.transformer.inference.triton.rms_norm",),
        )
    ]
