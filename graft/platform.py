"""What hardware is this? Device type, vendor and architecture names.

Architecture names follow each vendor's compiler: ``sm_90`` (Hopper), ``sm_80``
(Ampere) on NVIDIA; ``gfx942`` (MI300/CDNA3), ``gfx90a`` (MI200/CDNA2) on AMD.
ROCm builds of PyTorch report AMD GPUs as device type ``cuda`` too, so the vendor
comes from ``torch.version.hip``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how graft names dtypes in messages and reports."""
    return str(dtype).replace("torch.", "")


# Architecture generation names used by autotune tables (see graft.kernels.triton.autotune).
_GENERATIONS = (
    ("gfx94", "cdna3"),
    ("gfx95", "cdna4"),
    ("gfx90a", "cdna2"),
    ("gfx908", "cdna1"),
    ("gfx11", "rdna3"),
    ("gfx12", "rdna4"),
    ("sm_100", "blackwell"),
    ("sm_90", "hopper"),
    ("sm_89", "ada"),
    ("sm_8", "ampere"),
    ("sm_7", "volta"),
)


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # torch device type: "cpu" or "cuda" (also for ROCm)
    vendor: str  # "cpu", "nvidia" or "amd"
    arch: str  # "cpu", "sm_90", "gfx942", ...
    name: str  # marketing name, for reports

    @property
    def generation(self) -> str:
        return arch_generation(self.arch)

    def as_dict(self) -> dict:
        return {"type": self.type, "vendor": self.vendor, "arch": self.arch, "generation": self.generation, "name": self.name}


def arch_generation(arch: str) -> str:
    for prefix, generation in _GENERATIONS:
        if arch.startswith(prefix):
            return generation
    return "cpu" if arch == "cpu" else "unknown"


# The fp8 e4m3 flavour each architecture's MMAs take. MI300 (gfx940-gfx942) has AMD's fnuz
# e4m3 only: OCP float8_e4m3fn there compiles to bf16 MFMAs on converted operands (slower, and
# spilling at the GEMM tiles). NVIDIA (sm_89, sm_90) has OCP e4m3fn only: fnuz does not lower
# and the launch raises. Later AMD parts (gfx950) take OCP e4m3fn, so only these are fnuz-only.
FNUZ_ONLY_ARCHS = ("gfx940", "gfx941", "gfx942")


def fp8_flavour_reason(dtype: torch.dtype, arch: str) -> str | None:
    """Why ``dtype`` is the wrong fp8 e4m3 flavour for ``arch`` (None: it is the right one,
    or the architecture takes both, like the CPU interpreter)."""
    if dtype == torch.float8_e4m3fn and arch in FNUZ_ONLY_ARCHS:
        return (f"{dtype} on {arch}: its MMAs take torch.float8_e4m3fnuz (e4m3fn would run as bf16 MFMAs "
                f"on converted operands); quantise to torch.float8_e4m3fnuz")
    if dtype == torch.float8_e4m3fnuz and arch.startswith("sm_"):
        return (f"{dtype} on {arch}: NVIDIA fp8 MMAs take torch.float8_e4m3fn (OCP) and fnuz does not "
                f"compile there; quantise to torch.float8_e4m3fn")
    return None


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    if is_rocm():
        arch = getattr(props, "gcnArchName", "gfx").split(":")[0]
        return DeviceInfo("cuda", "amd", arch, props.name)
    return DeviceInfo("cuda", "nvidia", f"sm_{props.major}{props.minor}", props.name)


def device_info(device: torch.device | str | None = None, arch: str | None = None) -> DeviceInfo:
    """Describe ``device`` (default: the current accelerator if there is one, else the CPU).

    ``arch`` describes a hypothetical GPU of that architecture instead (``graft info --arch``);
    a CUDA device on a machine without one is described as architecture "unknown".
    """
    if device is None:
        device = torch.device("cuda") if arch else default_device()
    device = torch.device(device)
    if device.type == "cuda" and arch:
        vendor = "amd" if arch.startswith("gfx") else "nvidia" if arch.startswith("sm_") else "unknown"
        return DeviceInfo("cuda", vendor, arch, f"{arch} (not this machine's)")
    if device.type == "cuda" and not torch.cuda.is_available():
        return DeviceInfo("cuda", "unknown", "unknown", "no GPU visible to torch")
    if device.type == "cuda":
        return _cuda_device_info(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceInfo(device.type, "cpu" if device.type == "cpu" else device.type, device.type, device.type)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on"}
