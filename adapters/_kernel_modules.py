"""Shared helper of the Triton and HIP adapters: import every kernel module of a package
and let each register its implementations."""
from __future__ import annotations

import importlib
import logging
import pkgutil

log = logging.getLogger("graft.adapters")


def register_package(package_name: str, registry) -> list:
    """Call ``register(registry)`` of every public module under ``package_name``.

    Returns ``[(module_name, error_or_None)]``. A module that fails to import (a missing
    dependency, say) is reported and skipped so the other kernels still register.
    """
    package = importlib.import_module(package_name)
    outcomes: list[tuple[str, str | None]] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        name = f"{package_name}.{info.name}"
        try:
            module = importlib.import_module(name)
            register = getattr(module, "register", None)
            if register is not None:
                register(registry)
            outcomes.append((name, None))
        except Exception as exc:
            log.warning("kernel module %s not registered: %s: %s", name, type(exc).__name__, exc)
            outcomes.append((name, f"{type(exc).__name__}: {exc}"))
    return outcomes
