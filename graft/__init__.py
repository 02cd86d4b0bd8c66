"""graft: plugin-based hardware backend adapter for ML frameworks.

Public entry points:

* :func:`graft.get_registry` - the op registry, populated by every installed adapter plugin.
* :func:`graft.call` - run an op through backend selection (``graft.call("gemm.linear", x, weight)``).
* :func:`graft.select` / :func:`graft.explain` - what would run, and why.
"""
from graft._version import __version__
from graft.errors import GraftConfigError, GraftError, GraftInputError, GraftUnsupportedError


def get_registry():
    from graft.plugins import get_registry as _get

    return _get()


def call(op, *args, **kwargs):
    from graft.dispatch import call as _call

    return _call(op, *args, **kwargs)


def select(op, *args, **kwargs):
    from graft.dispatch import select as _select

    return _select(op, *args, **kwargs)


def served_calls(framework=None):
    """Calls graft served inside frameworks, per ``"<op>:<backend>"`` (see graft.integration)."""
    from graft.integration import served_calls as _served

    return _served(framework)


def explain(op, **query):
    from graft.selection import explain as _explain

    return _explain(get_registry(), op, **query)


__all__ = [
    "__version__",
    "GraftError",
    "GraftConfigError",
    "GraftInputError",
    "GraftUnsupportedError",
    "get_registry",
    "call",
    "select",
    "explain",
    "served_calls",
]
