"""Built-in adapter: graft's collective implementations (``graft.kernels.collectives``).

Registers the one-shot/two-shot all-reduce, the int8 quantized all-gather and the
GEMM + collective overlap ops. The references (plain torch.distributed collectives) are
registered by the torch adapter like every other op's.
"""
from __future__ import annotations

import importlib

from graft.hookspecs import hookimpl

MODULES = ("allreduce", "quantized_gather", "overlap")


@hookimpl
def graft_adapter_info():
    import torch.distributed as dist

    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    return {"description": "collectives: one-shot/two-shot all-reduce, int8 all-gather, GEMM/comm overlap",
            "process_group_backends": backends}


@hookimpl
def graft_register_kernels(registry):
    for name in MODULES:
        importlib.import_module(f"graft.kernels.collectives.{name}").register(registry)
