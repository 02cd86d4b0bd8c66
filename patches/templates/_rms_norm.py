"""The framework-neutral part of every RMSNorm patch: graft's Triton kernel, lifted from
``graft.kernels.triton.fused_norm``, and a dependency-free launcher for it."""
from __future__ import annotations

from graft import __version__
from graft.patches.kernel_source import function_source

KERNEL_MODULE = "graft.kernels.triton.fused_norm"
KERNEL_NAME = "_rms_norm_kernel"

LAUNCHER = '''

def rms_norm_triton(x, weight, eps, residual=None):
    """RMSNorm over the last dim, reduced in fp32: ``x * rsqrt(mean(x^2) + eps) * weight``.

    With ``residual`` it is the fused residual-add variant and returns
    ``(out, residual_out)`` where ``residual_out = x + residual``; else ``(out, None)``.
    """
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return out, (res_out if residual is not None else None)
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = x2
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    # Rows up to 8192 wide are normalised from registers; wider ones are streamed.
    block = min(triton.next_power_of_2(hidden), 8192)
    _rms_norm_kernel[(rows,)](
        x2, r2, weight.contiguous(), out, res_out,
        hidden, x2.stride(0), r2.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, ONE_TILE=block >= hidden,
        num_warps=8,
    )
    return out, (res_out if residual is not None else None)
'''


def kernel_and_launcher() -> str:
    return (
        f"# Kernel from graft {__version__} ({KERNEL_MODULE}.{KERNEL_NAME}), checked against a\n"
        f"# torch reference by graft's conformance suite over fp16/bf16/fp32 and odd widths.\n"
        + function_source(KERNEL_MODULE, KERNEL_NAME)
        + LAUNCHER
    )


BODY = """\
Adds a Triton RMSNorm kernel (plain and fused with the residual add) that
reduces in fp32 with one program per row: rows up to 8192 wide are
normalised from registers in a single pass, wider rows are streamed in two
passes, recomputing x + residual in fp32 so the norm sees the unrounded sum.
It runs on NVIDIA and AMD GPUs through Triton, with no extension build."""
