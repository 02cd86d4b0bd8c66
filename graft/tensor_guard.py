"""graft's C++ tensor signature check (``graft/_tensor_guard.cpp``): built ahead of time
against the installed torch, used by the remembered argument signatures where it is built.

A remembered signature (graft.signature) checks a call's tensors against the metadata of
those it was made from on every call of the hot path. torch's own check
(``TensorGuards(...).check``) costs about 0.5 us for five tensors, and on a loaded CPU, where
the kernels between two calls push it out of the caches, two to three times that; graft's
reads the same fields straight off each TensorImpl in about 0.1 us. It needs a C++ compiler
and torch's headers, so it is never compiled on a call's path: ``python -m graft.tensor_guard
build`` (ci/setup.sh runs it in each environment) builds it into the cache, keyed by its
source and torch, and dispatch loads it from there when present; otherwise torch's check
serves, with the same answers (``graft info`` says which).
"""
from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import torch

from graft.kernels import _extension

log = logging.getLogger("graft.tensor_guard")

SOURCE = Path(__file__).resolve().parent / "_tensor_guard.cpp"
_NAME = "graft_tensor_guard"


def _paths() -> tuple:
    """(module name, build dir): keyed by the source, torch (version and install path) and Python."""
    key = _extension.build_key([SOURCE], f"{torch.__version__}|{Path(torch.__file__).parent}|{sys.version}")
    return f"{_NAME}_{key}", _extension.cache_dir() / "tensor_guard" / f"{_NAME}-{key}"


def built_path() -> Path | None:
    name, build_dir = _paths()
    matches = sorted(build_dir.glob(f"{name}*.so")) if build_dir.is_dir() else []
    return matches[0] if matches else None


@functools.lru_cache(maxsize=None)
def module():
    """The built module (``make(*tensors)``), or None where it is not built (or not loadable,
    said once in the log)."""
    path = built_path()
    if path is None:
        return None
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location(_paths()[0], path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except Exception as exc:  # built against another torch ABI, a damaged file
        log.info("graft's tensor guard at %s does not load (%s); torch's check serves", path, _extension.summarize(exc))
        return None
    return mod


def build() -> Path:
    """Compile the module into the cache now (raises with the compiler's error)."""
    from torch.utils.cpp_extension import load

    name, build_dir = _paths()
    build_dir.mkdir(parents=True, exist_ok=True)
    load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"], build_directory=str(build_dir),
         is_python_module=True, verbose=False)
    module.cache_clear()
    path = built_path()
    assert path is not None, f"the build left no module in {build_dir}"
    return path


def status() -> str:
    """For ``graft info``: which tensor check the remembered signatures use."""
    if module() is not None:
        return f"graft's C++ tensor guard ({built_path()})"
    return "torch's TensorGuards (graft's C++ tensor guard is not built: python -m graft.tensor_guard build)"


def main(argv) -> int:
    if argv != ["build"]:
        print("usage: python -m graft.tensor_guard build", file=sys.stderr)
        return 2
    try:
        path = build()
    except Exception as exc:
        print(f"not built: {_extension.summarize(exc)}", file=sys.stderr)
        return 1
    print(f"graft tensor guard ready: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
