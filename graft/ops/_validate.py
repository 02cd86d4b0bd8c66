"""Shared input checks for op entry points: each raises GraftInputError with a clear message."""
from __future__ import annotations

from typing import Any

import torch

from graft import config, settings
from graft.errors import GraftInputError
from graft.platform import dtype_name

CHECK_VALUES_VAR = "GRAFT_CHECK_VALUES"  # declared in graft.settings


def check_tensor(name: str, t, *, dtypes=None, ndim=None, device=None, contiguous=False) -> None:
    # Every op call validates its inputs: the passing case is kept to a few attribute reads.
    if (isinstance(t, torch.Tensor) and (dtypes is None or t.dtype in dtypes) and (ndim is None or t.ndim == ndim)
            and device is None and not contiguous):
        return
    if not isinstance(t, torch.Tensor):
        raise GraftInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(dtype_name(d) for d in dtypes)
        raise GraftInputError(f"{name} has dtype {dtype_name(t.dtype)}; expected one of: {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise GraftInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise GraftInputError(f"{name} is on {t.device}, expected {device} (all inputs must share a device)")
    if contiguous and not t.is_contiguous():
        raise GraftInputError(f"{name} must be contiguous (call .contiguous() first)")


def check_same_device(**tensors) -> None:
    first = None
    for t in tensors.values():
        if isinstance(t, torch.Tensor):
            if first is None:
                first = t.device
            elif t.device != first:
                break
    else:
        return
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
    raise GraftInputError(f"inputs must be on one device: {listing}")


def check_same_dtype(**tensors) -> None:
    first = None
    for t in tensors.values():
        if isinstance(t, torch.Tensor):
            if first is None:
                first = t.dtype
            elif t.dtype != first:
                break
    else:
        return
    dtypes = {name: t.dtype for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    listing = ", ".join(f"{n}: {dtype_name(d)}" for n, d in dtypes.items())
    raise GraftInputError(f"inputs must share a dtype: {listing}")


def checks_values_on(t: torch.Tensor) -> bool:
    """Cheap pre-test for validators' fast paths: False when no value check will run for ``t``
    by configuration (a fast path may then skip everything but the metadata checks)."""
    return value_checks_on(t.device.type)


def value_checks_on(device_type: str) -> bool:
    """Whether value checks run, by configuration, for tensors on ``device_type``."""
    checks = _value_checks()
    return checks[0] if device_type == "cpu" else checks[1]


def can_read_values(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values (``int(t.max())``...).

    Not while torch.compile traces (no graph break), for fake/meta tensors, or while a
    CUDA graph is captured (a sync there is illegal). On the CPU reading values is free and
    the checks run unless GRAFT_CHECK_VALUES=0; on a GPU each is a device sync, so they run
    only with GRAFT_CHECK_VALUES=1 or GRAFT_STRICT=1. Kernels never rely on these checks
    for memory safety: they mask out-of-range values themselves.
    """
    # Runs on every call of an op with value checks: tensor flags (is_cpu...) rather than
    # t.device, which builds a device object each time.
    if not t.numel() or torch.compiler.is_compiling() or isinstance(t, _FakeTensor):
        return False
    if t.is_cpu:
        return _value_checks()[0]
    if t.is_meta or t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return _value_checks()[1]


from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor  # noqa: E402  (after the doc above)


_value_check_cache: list = [None, (True, False)]  # [generation, (on CPU, on GPUs)]


def values_in_range(t: torch.Tensor, low, high) -> bool:
    """Whether every value of ``t`` lies in ``[low, high)``: one pass, the common case of a
    value check (a caller finds the offending values only when this is False). A contiguous
    CPU int32/int64 tensor is read in C (graft/_fastcall.c: a fraction of a microsecond);
    anything else through one torch.aminmax."""
    bounds = _int_bounds(t) if _int_bounds is not None else None
    if bounds is not None:
        return bounds[0] >= low and bounds[1] < high
    lo, hi = torch.aminmax(t)
    return lo.item() >= low and hi.item() < high


def readable_bounds(t: torch.Tensor):
    """``(min, max)`` of ``t``'s values where a value check may read them (:func:`can_read_values`),
    else None (also for an empty ``t``). The common case, a plain contiguous CPU index tensor
    with value checks on, costs one Python call and one C loop (graft/_fastcall.c)."""
    if _int_bounds is not None and type(t) is _Tensor and t.is_cpu:  # plain: neither fake nor meta
        if not _value_checks()[0] or _is_compiling():
            return None
        bounds = _int_bounds(t)
        if bounds is not None:
            return bounds
    if not can_read_values(t):
        return None
    lo, hi = torch.aminmax(t)
    return lo.item(), hi.item()


def int_steps(t: torch.Tensor):
    """``(first, last, smallest step, largest step)`` of a plain contiguous CPU int32/int64
    tensor read in C (cu_seqlens), else None: the caller reads the values with torch. The
    caller has already decided that values may be read (:func:`can_read_values`)."""
    return _int_steps(t) if _int_steps is not None else None


_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling


_int_bounds: Any
_int_steps: Any
try:
    from graft._fastcall import configure_bounds as _configure_bounds, int_bounds as _int_bounds, int_steps as _int_steps
except ImportError:  # the C extension is optional (built where a compiler is); torch reads the values then
    _int_bounds = _int_steps = None
else:
    _configure_bounds(torch.Tensor, torch.int32, torch.int64)


def _value_checks() -> tuple:
    snap = config.current()
    if _value_check_cache[0] != snap.generation:
        explicit = settings.get(CHECK_VALUES_VAR, snap)  # None: unset
        on_cpu = True if explicit is None else explicit
        on_gpu = settings.get("GRAFT_STRICT", snap) if explicit is None else explicit
        _value_check_cache[1] = (on_cpu, on_gpu)
        _value_check_cache[0] = snap.generation
    return _value_check_cache[1]


def acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the references' compute dtype: at least fp32 (fp16/bf16/fp8/integers -> fp32),
    float64 kept, so that a float64 call (``torch.autograd.gradcheck``, bypassing the public
    dtype checks) computes in float64 rather than silently in fp32."""
    return t if t.dtype is torch.float64 else t.float()


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype :func:`acc` gives ``t``."""
    return torch.float64 if t.dtype is torch.float64 else torch.float32
