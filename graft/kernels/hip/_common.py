"""What every HIP/CUDA kernel module needs: one way to declare a hip implementation."""
from __future__ import annotations

import torch

from graft.kernels.hip._build import unavailable_reason
from graft.registry import Implementation

BACKEND = "hip"  # one backend name for both vendors: the same source, hipified on ROCm
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def hip_implementation(op: str, fn, custom_op, description: str, check=None, dtypes=FLOAT_DTYPES,
                       check_scalars=None) -> Implementation:
    """A hip Implementation: GPU only, available when the extension can be built here.

    ``custom_op`` is the torch.library op whose real impl triggers the lazy build.
    """
    return Implementation(
        op=op,
        backend=BACKEND,
        fn=fn,
        description=description,
        devices=frozenset({"cuda"}),  # ROCm devices are "cuda" in torch too
        dtypes=dtypes,
        available=unavailable_reason,
        check=check,
        check_scalars=check_scalars,
        custom_op=custom_op,
    )
