"""Run code right after a module is imported, without importing it.

graft must not import heavy modules early (torch._dynamo takes over a second; a launcher
that never imports torch must not pay for it), yet must adapt once they load: dispatch
tells Dynamo how to trace its entries, ``graft profile`` starts its recorder once torch is
there. One meta-path finder serves both. It stays in place until the module really
executes: a bare ``importlib.util.find_spec(name)`` (vLLM asks whether torch is there before
importing it) also lands here, and that spec is thrown away.
"""
from __future__ import annotations

import sys
from typing import Callable


class _Watcher:
    """A meta-path finder that calls ``then(module)`` right after ``name`` executes."""

    def __init__(self, name: str, then: Callable):
        self.name, self.then, self.busy = name, then, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.busy:
            return None
        import importlib.util

        self.busy = True  # the lookup below asks the finders again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            run_module = loader.exec_module

            def exec_module(module):
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                run_module(module)
                self.then(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, then: Callable) -> None:
    """Call ``then(module)`` once ``name`` is imported: now, if it already is."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _Watcher(name, then))
