"""Started by ``graft profile`` in every Python process of the profiled job (this folder is
put first on PYTHONPATH): profile this process, then run the sitecustomize this one hides."""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    from graft.profiling import boot

    boot.start_from_environment()
except Exception as exc:  # the job must run even where graft cannot profile it
    print(f"[graft profile] not profiling process {os.getpid()} ({sys.executable}): "
          f"{type(exc).__name__}: {exc}", file=sys.stderr)

_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _hidden = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_hidden)
