"""The one tl.dot policy of every Triton kernel family (gemm, attention, moe).

Policy (launchers get the constexpr flags from :func:`dot_flags`, kernels call
:func:`dot_acc` / :func:`dot_f32`):

* Accumulation is always fp32 (int32 for the int8 GEMM, which needs no flags).
* fp32 operands: ``PRECISION`` follows torch's own fp32-matmul setting, so a Triton op
  rounds like the ``torch.matmul`` it replaces: TF32 tensor cores only when torch allows
  TF32 for matmuls (``torch.backends.cuda.matmul.allow_tf32`` / ``fp32_precision`` /
  ``torch.set_float32_matmul_precision``, off by default), else IEEE fp32. AMD backends
  other than gfx942 have no TF32 and always get IEEE. The interpreter always gets IEEE
  (it multiplies in numpy and ignores the flag anyway).
* fp16/bf16 operands: the native tensor-core dot; ``PRECISION`` only affects fp32
  operands, and is "ieee" for them so the flag does not multiply compiled variants.
* bf16 under the interpreter: Triton's CPU interpreter returns garbage from tl.dot on
  bf16 operands (fp16, fp32 and int8 are exact), so ``UPCAST`` widens bf16 tiles to fp32
  before the dot there. Compiled GPU kernels keep the native bf16 dot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.platform import device_info, is_rocm, triton_interpret


def _torch_allows_tf32() -> bool:
    matmul = torch.backends.cuda.matmul
    # fp32_precision (torch >= 2.9) reflects both the legacy allow_tf32 flag and the new API;
    # reading allow_tf32 after the new API was used raises, so it is only the fallback.
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(matmul.allow_tf32)


def fp32_precision(device: "torch.device | str | None" = None) -> str:
    """tl.dot ``input_precision`` for fp32 operands on ``device`` (see the policy above)."""
    if triton_interpret() or not _torch_allows_tf32():
        return "ieee"
    if is_rocm() and device_info(device).arch != "gfx942":  # Triton allows TF32 on gfx942 only
        return "ieee"
    return "tf32"


def dot_flags(dtype: torch.dtype, device: "torch.device | str | None" = None) -> dict:
    """Constexpr flags ``UPCAST`` and ``PRECISION`` for a kernel whose dot operands are ``dtype``."""
    return {
        "UPCAST": bool(triton_interpret() and dtype == torch.bfloat16),
        "PRECISION": fp32_precision(device) if dtype == torch.float32 else "ieee",
    }


@triton.jit
def dot_f32(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b as a new fp32 tile."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in the dot (acc is fp32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)
