"""The cpp backend's hooks; its kernels are the other modules of ``graft.kernels.cpp``.

C++ kernels for the CPU, built lazily against the running torch (seconds, once per torch
version and source change) wherever a C++ compiler and ninja exist; elsewhere the
implementations report why they are unavailable and the next backend serves.
"""
from graft.hookspecs import hookimpl
from graft.plugins import register_kernel_modules


@hookimpl
def graft_adapter_info():
    return {"description": "CPU C++ kernels (at::parallel_for), built lazily with torch.utils.cpp_extension"}


@hookimpl
def graft_register_kernels(registry):
    register_kernel_modules("graft.kernels.cpp", registry)
