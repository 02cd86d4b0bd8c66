"""Lazy build of graft's CPU C++ kernels (``csrc/*.cpp``) with ``torch.utils.cpp_extension``.

The sources include only ATen's core headers and ``torch/library.h`` (their ops register
through ``TORCH_LIBRARY(graft_cpp, ...)``, no pybind), so a build takes seconds. Nothing is
compiled at import or registration: the first call of a cpp implementation builds (or loads
the cached build of) the library, unless ``GRAFT_CPP_BUILD=off``; ``python -m
graft.kernels.cpp build`` builds it ahead of time (ci/setup.sh does, for each environment).
Where it cannot work (no C++ compiler or ninja, a failed build), :func:`unavailable_reason`
says why, so selection falls back to the next backend with that reason.

The build lives under ``$GRAFT_CACHE_DIR/cpp_ext/<key>``, keyed by the sources, the torch
version and the vector instruction flags, which follow the CPU capability torch itself
dispatches to (``torch.backends.cpu.get_cpu_capability()``): the library never uses an
instruction set torch does not use on this machine. Parallel loops use ``at::parallel_for``
compiled with OpenMP, which resolves to the OpenMP runtime torch loaded (its bundled
``libgomp.so.1``): one thread pool, sized by ``torch.set_num_threads``.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from graft.errors import GraftUnsupportedError
from graft.kernels import _extension

log = logging.getLogger("graft.kernels.cpp")

BUILD_VAR = "GRAFT_CPP_BUILD"  # declared in graft.settings
VERBOSE_VAR = _extension.VERBOSE_VAR  # declared in graft.settings, shared with the hip backend
BUILD_MODES = ("lazy", "off")
LIBRARY = "graft_cpp"  # the torch.ops namespace the sources register
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("decode_paged.cpp",)
CXX_FLAGS = ("-O3", "-fopenmp")
# Vector flags per torch CPU capability (what ATen's own kernels were dispatched to here).
# CPU_CAPABILITY selects ATen's vector implementation (at::vec::Vectorized) for that ISA.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
    "DEFAULT": ("-DCPU_CAPABILITY=DEFAULT",),
}


def build_mode() -> str:
    return _extension.build_mode(BUILD_VAR)


@functools.lru_cache(maxsize=None)
def isa_flags() -> tuple:
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # an older torch without it: plain x86-64 / aarch64 code
        capability = "DEFAULT"
    return ISA_FLAGS.get(capability, ISA_FLAGS["DEFAULT"])


def cxx_flags() -> list:
    return [*CXX_FLAGS, *isa_flags()]


@functools.lru_cache(maxsize=None)
def environment_reason() -> str | None:
    """Why the library cannot be built in this process (cached: none of it changes at runtime)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} not found on PATH (set CXX or install g++)"
    if not cpp_extension.is_ninja_available():
        return "ninja not installed (torch.utils.cpp_extension needs it: pip install ninja)"
    return None


class _State:
    lock = threading.Lock()
    loaded = False
    error: str | None = None


def source_files() -> list:
    return [CSRC_DIR / name for name in SOURCES]


def build_key() -> str:
    # torch's install path too: two environments with the same torch version compile with
    # different include paths, and sharing one build directory would make each rebuild it.
    return _extension.build_key(source_files(), f"{torch.__version__}|{Path(torch.__file__).parent}|{cxx_flags()}")


def _paths() -> tuple:
    """(library name, build dir) for this build key."""
    key = build_key()
    return f"{LIBRARY}_{key}", _extension.cache_dir() / "cpp_ext" / f"{LIBRARY}-{key}"


def prebuilt() -> bool:
    name, build_dir = _paths()
    return (build_dir / f"{name}.so").is_file()


def unavailable_reason() -> str | None:
    """None when the kernels can run here (built, buildable on first use), else why not."""
    mode = build_mode()
    if _State.loaded:
        return None
    if _State.error is not None:
        return f"building graft's CPU C++ kernels failed: {_State.error}"
    if mode == "off":
        return None if prebuilt() else (f"{BUILD_VAR}=off and no prebuilt kernels "
                                        "(build them with `python -m graft.kernels.cpp build`)")
    return environment_reason()


def reset() -> None:
    """Forget the cached reasons and a recorded build failure (a loaded library stays loaded:
    a process cannot unload it)."""
    environment_reason.cache_clear()
    isa_flags.cache_clear()
    with _State.lock:
        _State.error = None


def _build() -> None:
    name, build_dir = _paths()
    if prebuilt():  # built before (ahead of time or by an earlier process): load it, no ninja run
        torch.ops.load_library(str(build_dir / f"{name}.so"))
        return
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("building graft's CPU C++ kernels in %s (first use; cached afterwards)", build_dir)
    load(name=name, sources=[str(path) for path in source_files()], extra_cflags=cxx_flags(),
         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
         verbose=_extension.verbose())


def load_library(ahead_of_time: bool = False):
    """``torch.ops.graft_cpp``, the library built and loaded on first use (or ahead of time).

    Raises GraftUnsupportedError with the reason when it cannot run here; a failed build is
    remembered so that later selections skip the cpp backend with it.
    """
    if _State.loaded:
        return torch.ops.graft_cpp
    with _State.lock:
        if not _State.loaded:
            reason = (environment_reason() if ahead_of_time else unavailable_reason()) if not prebuilt() else None
            if reason:
                raise GraftUnsupportedError(f"graft's CPU C++ kernels unavailable: {reason}")
            try:
                _build()
            except Exception as exc:
                _State.error = _extension.summarize(exc)
                from graft import selection

                selection.forget()  # cached decisions still think the cpp backend is usable
                raise GraftUnsupportedError(f"building graft's CPU C++ kernels failed: {_State.error}") from exc
            _State.loaded = True
    return torch.ops.graft_cpp
