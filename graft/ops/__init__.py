"""The op catalogue: one module per family, each defining ``OPS`` (a list of OpSpec),
the torch references, input validation and the public entry points
(e.g. ``graft.ops.gemm.linear(x, weight)``) that dispatch through backend selection.

Modules are discovered, so adding a family module needs no edit here.
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
