"""What every Triton kernel module needs: where Triton can run, one way to declare a
triton implementation, and the launch device guard."""
from __future__ import annotations

import contextlib

import torch

from graft.platform import triton_interpret
from graft.registry import Implementation

BACKEND = "triton"


def triton_devices() -> frozenset:
    """Device types Triton kernels can serve in this process.

    CUDA/ROCm GPUs always; the CPU only under TRITON_INTERPRET=1, which must be set
    before triton is imported (kernels are wrapped for the interpreter at definition).
    """
    return frozenset({"cuda", "cpu"}) if triton_interpret() else frozenset({"cuda"})


def triton_unavailable() -> str | None:
    """Environment check for Implementation.available: None when Triton can run here."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton not installed ({exc})"
    if not triton_interpret() and not torch.cuda.is_available():
        return "no GPU, and TRITON_INTERPRET=1 is not set (Triton runs on the CPU only in its interpreter)"
    return None


def on_device(where: "torch.Tensor | torch.device"):
    """Make a tensor's (or device's) GPU current for a launch: Triton launches on the
    current CUDA device, which need not be the one the tensors live on."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_implementation(
    op: str, fn, *, custom_op, description: str, dtypes, check=None, check_scalars=None, priority: int = 0
) -> Implementation:
    """A triton Implementation: on the devices Triton can run on here (see
    :func:`triton_devices`), available when :func:`triton_unavailable` finds nothing missing.

    ``custom_op`` is the torch.library op ``fn`` calls; ``check`` a per-call reason to fall back
    (``check_scalars``: see :class:`graft.registry.Implementation`).
    """
    return Implementation(
        op=op,
        backend=BACKEND,
        fn=fn,
        description=description,
        devices=triton_devices(),
        dtypes=frozenset(dtypes),
        available=triton_unavailable,
        check=check,
        check_scalars=check_scalars,
        custom_op=custom_op,
        priority=priority,
    )
