"""The op catalogue: one package per family, split by job:

* ``graft/ops/<family>/__init__.py``: ``OPS`` (a list of OpSpec), input validation and the
  public entry points (e.g. ``graft.ops.gemm.linear(x, weight)``) that dispatch through
  backend selection; it re-exports the two modules below.
* ``reference.py``: the torch references (each op's definition and last resort).
* ``cases.py``: ``CASES``, the conformance cases, and their input builders.

The torch fast paths (torch kernels for the same math, ranked above the references) are
kernels like any other backend's: ``graft/kernels/torch/<family>.py``.

Families are discovered, so adding a family package needs no edit here.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil


def family_modules():
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"{__name__}.{info.name}")


def all_op_specs() -> list:
    specs: list = []
    for module in family_modules():
        specs.extend(getattr(module, "OPS", ()))
    return specs


def __getattr__(name):
    # `graft.ops.gemm` works without importing graft.ops.gemm first (as the README shows).
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
