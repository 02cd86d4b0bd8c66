"""Lazy build of graft's CUDA/HIP C++ kernels with ``torch.utils.cpp_extension``.

The sources in ``csrc/`` are CUDA-flavoured C++. On an NVIDIA build of torch,
``cpp_extension.load`` compiles them with nvcc; on a ROCm build it hipifies them
first and compiles with hipcc. Nothing is compiled at import or registration: the
first call of a hip implementation builds (or loads the cached build of) the
extension. Where it cannot work — a CPU-only torch, no GPU, no compiler, a failed
build — :func:`unavailable_reason` says why, so selection falls back with that
reason and ``graft info`` shows it.

The build lives under ``$GRAFT_CACHE_DIR/hip_ext/<key>`` (default
``~/.cache/graft``), keyed by the sources, torch version and CUDA/HIP version, so an
upgrade or a source change never reuses a stale binary. GPU architectures come from
torch's own variables (``TORCH_CUDA_ARCH_LIST``, ``PYTORCH_ROCM_ARCH``), else the
visible device.
"""
from __future__ import annotations

import functools
import logging
import shutil
import threading
from pathlib import Path

import torch

from graft.errors import GraftUnsupportedError
from graft.kernels import _extension
from graft.kernels._extension import cache_dir, summarize

log = logging.getLogger("graft.kernels.hip")

VERBOSE_VAR = _extension.VERBOSE_VAR  # declared in graft.settings, shared with the cpp backend
BUILD_VAR = "GRAFT_HIP_BUILD"  # declared in graft.settings
BUILD_MODES = ("lazy", "off")


def build_mode() -> str:
    return _extension.build_mode(BUILD_VAR)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# Torch-free kernel translation units: each compiles standalone with nvcc (or hipcc after hipify).
KERNEL_SOURCES = ("fused_kernels.cu", "attention_kernels.cu", "gemm_kernels.cu", "moe_kernels.cu")
BINDING_SOURCE = "bindings.cpp"  # the only file that includes torch headers
HEADERS = ("compat.cuh", "graft_kernels.h")
EXTENSION_NAME = "graft_hip_kernels"

NVCC_FLAGS = ("-O3", "--expt-relaxed-constexpr")
HIPCC_FLAGS = ("-O3",)
CXX_FLAGS = ("-O3",)


def vendor() -> str | None:
    """``"rocm"``, ``"cuda"``, or None for a CPU-only torch build."""
    if getattr(torch.version, "hip", None):
        return "rocm"
    if getattr(torch.version, "cuda", None):
        return "cuda"
    return None


def _tool(home: str | None, name: str) -> str | None:
    if home:
        candidate = Path(home) / "bin" / name
        if candidate.exists():
            return str(candidate)
    return shutil.which(name)


@functools.lru_cache(maxsize=None)
def toolchain_reason() -> str | None:
    """Why the extension cannot be compiled here (compiler or ninja missing), or None."""
    from torch.utils import cpp_extension

    if vendor() == "rocm":
        if _tool(cpp_extension.ROCM_HOME, "hipcc") is None:
            return "hipcc not found (install ROCm or set ROCM_HOME)"
    else:
        home = cpp_extension.CUDA_HOME
        if home is None:
            return "nvcc not found: CUDA_HOME is unset and no CUDA toolkit was found"
        if _tool(home, "nvcc") is None:
            return f"nvcc not found under CUDA_HOME={home} or on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja not installed (torch.utils.cpp_extension needs it: pip install ninja)"
    return None


@functools.lru_cache(maxsize=None)
def environment_reason() -> str | None:
    """Why this process can never run the kernels (cached: none of it changes at runtime)."""
    if vendor() is None:
        return f"torch {torch.__version__} has no CUDA/HIP support (CPU-only build)"
    if not torch.cuda.is_available():
        return "no CUDA/ROCm device"
    return toolchain_reason()


class _State:
    lock = threading.Lock()
    module = None
    error: str | None = None


def unavailable_reason() -> str | None:
    """None when the kernels can be built and run here, else the reason (for Implementation.available)."""
    mode = build_mode()  # an invalid GRAFT_HIP_BUILD is an error on every machine
    reason = environment_reason()
    if reason:
        return reason
    if _State.module is None and mode == "off" and not prebuilt():
        return f"{BUILD_VAR}=off and no prebuilt kernels (build them with `python -m graft.kernels.hip build`)"
    if reason:
        return reason
    if _State.error is not None:
        return f"building the HIP/CUDA kernels failed: {_State.error}"
    return None


def reset(keep_module: bool = False) -> None:
    """Forget cached reasons, a recorded build failure and (unless ``keep_module``) the loaded module."""
    toolchain_reason.cache_clear()
    environment_reason.cache_clear()
    with _State.lock:
        if not keep_module:
            _State.module = None
        _State.error = None


def source_files() -> list[Path]:
    return [CSRC_DIR / name for name in (*HEADERS, *KERNEL_SOURCES, BINDING_SOURCE)]


def build_key() -> str:
    """Hash of everything the binary depends on: sources, flags, torch and toolkit versions."""
    toolkit = f"{vendor()}-{torch.version.hip or torch.version.cuda}"
    return _extension.build_key(source_files(), f"{torch.__version__}|{toolkit}|{NVCC_FLAGS}|{HIPCC_FLAGS}|{CXX_FLAGS}")


def _stage_sources(src_dir: Path) -> None:
    # hipify writes its output next to the sources it converts: give it a private copy
    # (the installed package may be read-only), and compile that same copy on CUDA.
    src_dir.mkdir(parents=True, exist_ok=True)
    for path in source_files():
        target = src_dir / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)


def _paths() -> tuple:
    """(extension name, source dir, build dir) for this build key."""
    key = build_key()
    root = cache_dir() / "hip_ext" / f"{EXTENSION_NAME}-{key}"
    return f"{EXTENSION_NAME}_{key}", root / "src", root / "build"


def prebuilt() -> bool:
    """Whether this build key's library is already in the cache (built ahead of time)."""
    name, _, build_dir = _paths()
    return (build_dir / f"{name}.so").is_file()


def _build():
    from torch.utils.cpp_extension import load

    name, src_dir, build_dir = _paths()
    _stage_sources(src_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    device_flags = HIPCC_FLAGS if vendor() == "rocm" else NVCC_FLAGS
    log.info("building graft HIP/CUDA kernels in %s (first use; cached afterwards)", build_dir)
    return load(
        name=name,
        sources=[str(src_dir / name) for name in (BINDING_SOURCE, *KERNEL_SOURCES)],
        extra_include_paths=[str(src_dir)],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(device_flags),
        build_directory=str(build_dir),
        verbose=_extension.verbose(),
    )


def load_extension(ahead_of_time: bool = False):
    """The compiled extension module, built on first use (or ahead of time, whatever
    GRAFT_HIP_BUILD says: `python -m graft.kernels.hip build`).

    Raises GraftUnsupportedError with the reason when the kernels cannot run here; a
    failed build is remembered so later selections skip the hip backend with it.
    """
    if _State.module is not None:
        return _State.module
    with _State.lock:
        if _State.module is not None:
            return _State.module
        reason = environment_reason() if ahead_of_time else unavailable_reason()
        if reason:
            raise GraftUnsupportedError(f"graft HIP/CUDA kernels unavailable: {reason}")
        try:
            _State.module = _build()
        except Exception as exc:
            _State.error = summarize(exc)
            from graft import selection

            selection.forget()  # cached decisions still think the hip backend is usable
            raise GraftUnsupportedError(f"building the graft HIP/CUDA kernels failed: {_State.error}") from exc
        return _State.module
