"""Launch helper shared by the MoE Triton kernel modules."""
from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device):
    """Make ``device`` current for a launch: Triton launches on the current CUDA device,
    which need not be the one the tensors live on."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
