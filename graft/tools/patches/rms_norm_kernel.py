"""The framework-neutral part of every RMSNorm patch: graft's Triton kernel, lifted from
``graft.kernels.triton.fused_rms_norm`` (the very kernel graft's conformance suite checks),
and a dependency-free launcher for it.

The launcher takes ``weight=None`` (RMSNorm without a learned scale) and launches the
kernel through ``{launch}``, so a framework can wrap the launch (e.g. ``wrap_triton``).
The project's own formatter restyles all of it at generation time.
"""
from __future__ import annotations

from graft.tools.patches.kernel_source import function_source
from graft.tools.patches.template import PatchTemplate

KERNEL_MODULE = "graft.kernels.triton.fused_rms_norm"
KERNEL_NAME = "_rms_norm_kernel"

LAUNCHER = '''

def {name}(x, weight, eps, residual=None):
    """RMSNorm over the last dim in fp32: ``x * rsqrt(mean(x^2) + eps) * weight``.

    ``weight=None`` means no learned scale. With ``residual`` it is the fused
    residual-add variant and returns ``(out, x + residual)``; else ``(out, None)``.
    """
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return out, (res_out if residual is not None else None)
    if weight is None:
        weight = torch.ones(hidden, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = x2
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    # Rows up to 8192 wide are normalised from registers; wider ones are streamed.
    block = min(triton.next_power_of_2(hidden), 8192)
    {launch}[(rows,)](
        x2, r2, weight.contiguous(), out, res_out,
        hidden, x2.stride(0), r2.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, ONE_TILE=block >= hidden,
        num_warps=8,
    )
    return out, (res_out if residual is not None else None)
'''


def kernel_and_launcher(name: str = "rms_norm_triton", launch: str = KERNEL_NAME) -> str:
    return function_source(KERNEL_MODULE, KERNEL_NAME) + LAUNCHER.format(name=name, launch=launch)


HOW = """\
The kernel reduces in fp32 with one program per row: rows up to 8192 wide
are normalised from registers in a single pass, wider rows are streamed in
two passes, recomputing x + residual in fp32 so the norm sees the unrounded
sum. It runs on NVIDIA and AMD GPUs through Triton, with no extension build."""

REMOVAL = ("once a release carries this, graft's own {what} for {framework} checks for it and "
           "defers to it; the adapter code is then deleted when graft's minimum {framework} version "
           "includes that release.")


def rms_norm_template(*, framework_title: str, what: str, body: str, **fields) -> PatchTemplate:
    """A patch carrying graft's Triton RMSNorm: the shared explanation goes before ``body``,
    the shared removal plan into ``retire``; ``fields`` are the framework's own."""
    return PatchTemplate(body=HOW + "\n\n" + body, ops=("fused.rms_norm",),
                         retire=REMOVAL.format(what=what, framework=framework_title), **fields)

