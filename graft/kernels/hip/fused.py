"""HIP/CUDA kernels for fused.rms_norm (plain and with the residual add) and
fused.silu_and_mul (csrc/fused_kernels.cu), exposed as torch.library custom ops."""
from __future__ import annotations

import torch

from graft.custom_ops import define_op
from graft.kernels.hip._build import load_extension
from graft.kernels.hip._common import hip_implementation


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load_extension().rms_norm(x, weight, eps)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(load_extension().add_rms_norm(x, residual, weight, eps))


def _add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return load_extension().silu_and_mul(x)


def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


rms_norm_op = define_op("fused_rms_norm_hip", _rms_norm, fake=_rms_norm_fake, device_types="cuda")
add_rms_norm_op = define_op("fused_add_rms_norm_hip", _add_rms_norm, fake=_add_rms_norm_fake, device_types="cuda")
silu_and_mul_op = define_op("fused_silu_and_mul_hip", _silu_and_mul, fake=_silu_and_mul_fake, device_types="cuda")


def rms_norm(x, weight, eps=1e-6, residual=None):
    if residual is None:
        return rms_norm_op(x, weight, float(eps))
    return add_rms_norm_op(x, residual, weight, float(eps))


def silu_and_mul(x):
    return silu_and_mul_op(x)


def register(registry) -> None:
    registry.add_impl(hip_implementation(
        "fused.rms_norm", rms_norm, rms_norm_op,
        "HIP/CUDA RMSNorm: block per row, warp-shuffle fp32 reduction, optional fused residual add"))
    registry.add_impl(hip_implementation(
        "fused.silu_and_mul", silu_and_mul, silu_and_mul_op, "HIP/CUDA SiLU-and-mul (fp32 math)"))
