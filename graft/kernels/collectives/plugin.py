"""The collectives backend's hooks; its implementations are the modules of ``graft.kernels.collectives``
that define ``register``.

Registers the one-shot/two-shot all-reduce, the int8 quantized all-gather and the
GEMM + collective overlap ops. The references (plain torch.distributed collectives) are
registered by the torch backend like every other op's.
"""
from __future__ import annotations

from graft.hookspecs import hookimpl
from graft.plugins import register_kernel_modules


@hookimpl
def graft_adapter_info():
    import torch.distributed as dist

    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    return {"description": "collectives: one-shot/two-shot all-reduce, int8 all-gather, GEMM/comm overlap",
            "process_group_backends": backends}


@hookimpl
def graft_register_kernels(registry):
    register_kernel_modules("graft.kernels.collectives", registry)
