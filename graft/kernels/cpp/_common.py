"""What every cpp kernel module needs: one way to declare a cpp implementation."""
from __future__ import annotations

import torch

from graft.kernels.cpp._build import unavailable_reason
from graft.registry import Implementation

BACKEND = "cpp"
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def cpp_implementation(op: str, fn, custom_op, description: str, check=None, dtypes=FLOAT_DTYPES,
                       check_scalars=None) -> Implementation:
    """A cpp Implementation: CPU only, available where the library is built or can be.

    ``custom_op`` is the graft custom op whose real impl triggers the lazy build.
    """
    return Implementation(op=op, backend=BACKEND, fn=fn, description=description, devices=frozenset({"cpu"}),
                          dtypes=dtypes, available=unavailable_reason, check=check, check_scalars=check_scalars,
                          custom_op=custom_op)
