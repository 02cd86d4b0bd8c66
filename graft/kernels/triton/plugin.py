"""The Triton backend's hooks; its kernels are the other modules of ``graft.kernels.triton``.

On a GPU they run compiled; on the CPU only in Triton's interpreter
(``TRITON_INTERPRET=1``, set before anything imports triton), which the
implementations declare through their supported devices.
"""
from graft.hookspecs import hookimpl
from graft.plugins import register_kernel_modules


@hookimpl
def graft_adapter_info():
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = None
    return {"description": "Triton kernels (GPU; CPU via TRITON_INTERPRET=1)", "triton": version}


@hookimpl
def graft_register_kernels(registry):
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"triton is not installed ({exc}); Triton kernels are unavailable") from exc
    register_kernel_modules("graft.kernels.triton", registry)
