"""The HIP backend's hooks; its kernels are the other modules of ``graft.kernels.hip``.

Sources are CUDA-flavoured C++ that PyTorch's extension builder compiles with nvcc,
or hipifies and compiles with hipcc on ROCm. They are built lazily, on first use, and
only where a GPU and a toolchain exist; elsewhere the implementations report why
they are unavailable instead of failing.
"""
from graft.hookspecs import hookimpl
from graft.plugins import register_kernel_modules


@hookimpl
def graft_adapter_info():
    return {"description": "HIP/CUDA C++ kernels, built lazily with torch.utils.cpp_extension"}


@hookimpl
def graft_register_kernels(registry):
    register_kernel_modules("graft.kernels.hip", registry)
