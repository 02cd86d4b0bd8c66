"""Shared input checks for op entry points: each raises GraftInputError with a clear message."""
from __future__ import annotations

import torch

from graft.errors import GraftInputError


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
