"""Shared input checks for op entry points: each raises GraftInputError with a clear message."""
from __future__ import annotations

import torch

from graft import config
from graft.errors import GraftInputError

config.declare_env_var(
    "GRAFT_CHECK_VALUES",
    "0: skip input checks that read tensor values (cu_seqlens, expert ids...), each a device sync on GPUs",
)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, *, dtypes=None, ndim=None, device=None, contiguous=False) -> None:
    if not isinstance(t, torch.Tensor):
        raise GraftInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise GraftInputError(f"{name} has dtype {_dtype_name(t.dtype)}; expected one of: {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise GraftInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise GraftInputError(f"{name} is on {t.device}, expected {device} (all inputs must share a device)")
    if contiguous and not t.is_contiguous():
        raise GraftInputError(f"{name} must be contiguous (call .contiguous() first)")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise GraftInputError(f"inputs must be on one device: {listing}")


def check_same_dtype(**tensors) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}: {_dtype_name(d)}" for n, d in dtypes.items())
        raise GraftInputError(f"inputs must share a dtype: {listing}")


def can_read_values(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values (``int(t.max())``...).

    Not while torch.compile traces (no graph break), for fake/meta tensors, or while a
    CUDA graph is captured (a sync there is illegal); and not with GRAFT_CHECK_VALUES=0,
    for production runs that cannot afford the device sync each such check costs.
    """
    if t.numel() == 0 or t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return config.parse_bool("GRAFT_CHECK_VALUES", True)
