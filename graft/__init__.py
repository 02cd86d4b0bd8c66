"""graft: plugin-based hardware backend adapter for ML frameworks.

Public entry points:

* :func:`graft.get_registry` - the op registry, populated by every installed adapter plugin.
* :func:`graft.call` - run an op through backend selection (``graft.call("gemm.linear", x, weight)``);
  ``graft.run`` also returns the implementation that served it.
* :func:`graft.select` / :func:`graft.explain` - what would run, and why (``graft.explain(op, *args)``
  for one call's shapes).
"""
from graft._version import __version__
from graft.errors import GraftConfigError, GraftError, GraftInputError, GraftUnsupportedError


def get_registry():
    from graft.plugins import get_registry as _get

    return _get()




def reload_config():
    """Read the GRAFT_* environment variables again (they are read once, on first use)."""
    from graft.config import reload

    return reload()


def override_config(values=None, **variables):
    """Context manager: set (None: unset) GRAFT_* variables for a block, then restore them."""
    from graft.config import override

    return override(values, **variables)


def served_calls(framework=None):
    """What graft served inside each framework integration: ``{framework: {"op:backend": n}}``,
    or one framework's dict when ``framework`` is given."""
    from graft.integration import served_calls as _served

    return _served(framework)


def __getattr__(name):
    # Loaded on first use, so that `import graft` stays light (no torch): `graft.ops.gemm`
    # without importing graft.ops first, and graft.call/graft.select bound to the dispatcher
    # itself (no wrapper on the per-call path).
    import importlib

    if name in ("ops", "dispatch"):
        return importlib.import_module(f"graft.{name}")
    if name == "profile":  # `with graft.profile(out): ...` (graft.profiling holds the rest)
        from graft.profiling import profile

        return profile
    if name in ("call", "select", "run"):
        value = getattr(importlib.import_module("graft.dispatch"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graft' has no attribute {name!r}")


def explain(op, *args, **kwargs):
    """Why an implementation serves ``op`` (a :class:`graft.selection.Decision`).

    With a call's arguments, ``graft.explain("fused.rms_norm", x, w, 1e-6)``: the decision
    dispatch takes for exactly that call (per-call checks, the tuning table entry of its shape
    bucket). Without, ``graft.explain(op, device=..., dtype=..., arch=...)``: what serves that
    device and dtype before any shape is known."""
    from graft import selection

    if args:
        return selection.explain_call(get_registry(), op, args, kwargs)
    return selection.explain(get_registry(), op, **kwargs)


__all__ = [
    "__version__",
    "GraftError",
    "GraftConfigError",
    "GraftInputError",
    "GraftUnsupportedError",
    "get_registry",
    "call",
    "select",
    "run",
    "explain",
    "reload_config",
    "override_config",
    "served_calls",
    "profile",
]
