"""Environment-variable configuration of backend selection.

Variables (all optional; values are comma-separated, case-insensitive, spaces ignored):

``GRAFT_BACKENDS``
    Global backend priority list, highest first. Default: ``hip,triton,torch``.
    Backends not listed are still tried after the listed ones unless disabled, so a
    partial list only reorders; ``torch`` (the reference) is always the last resort.
``GRAFT_<FAMILY>`` / ``GRAFT_<OP>``
    Priority override for one op family (``GRAFT_ATTENTION=triton,torch``) or one op
    (``GRAFT_ATTENTION_DECODE_PAGED=torch``; dots in op names become underscores).
    The op-level variable wins over the family-level one, which wins over GRAFT_BACKENDS.
``GRAFT_DISABLE``
    Things to switch off: backend names, family names, op names, or ``all``
    (``all`` makes every op use the torch reference and keeps framework
    integrations from activating). ``torch``, the reference, cannot be disabled
    (an error).
``GRAFT_DISABLE_PLUGINS``
    Adapter plugin (entry-point) names not to load.
``GRAFT_STRICT``
    ``1``: raise instead of falling back when an explicitly requested backend cannot
    serve a call. Default ``0``.
``GRAFT_LOG_LEVEL``
    Log level of the ``graft`` logger (``DEBUG``, ``INFO``, ``WARNING``...).

An empty value means the same as an unset variable (its default), for every variable.

The variables are read once, on first use, into a :class:`Snapshot`; changing
``os.environ`` afterwards has no effect until :func:`reload` (``graft.reload_config()``).
:func:`override` changes them temporarily (tests, benchmarks)::

    with graft.override_config(GRAFT_BACKENDS="torch"):
        ...

Every ``GRAFT_*`` variable graft reads (these and the other modules') is declared once in
:mod:`graft.settings` (type, default, description, owner), whose typed accessors read
through this snapshot; ``graft info`` lists them and flags unknown (probably misspelt)
``GRAFT_*`` names.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from graft.errors import GraftConfigError

DEFAULT_BACKEND_PRIORITY = ("hip", "triton", "torch")
REFERENCE_BACKEND = "torch"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

def declare_env_var(name: str, description: str = "") -> str:
    """Deprecated: every GRAFT_* variable is declared in :data:`graft.settings.TABLE`.

    Checks that ``name`` is declared there (ValueError otherwise) and returns it; it adds
    nothing (``description`` is ignored: the table's one-line doc is the description)."""
    from graft import settings

    if not name.startswith("GRAFT_"):
        raise ValueError(f"graft environment variables must start with GRAFT_, got {name!r}")
    if name not in settings.TABLE:
        raise ValueError(f"{name} is not declared in graft.settings.TABLE; add a row there")
    return name


def __getattr__(name: str):
    if name == "KNOWN_ENV_VARS":  # name -> one-line description, from graft.settings.TABLE
        from graft import settings

        return {s.name: s.doc for s in settings.rows()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def op_env_var(name: str) -> str:
    """``attention.decode_paged`` -> ``GRAFT_ATTENTION_DECODE_PAGED``; ``gemm`` -> ``GRAFT_GEMM``."""
    return "GRAFT_" + name.upper().replace(".", "_").replace("-", "_")


def split_list(value: str | None) -> list[str]:
    if value is None:
        return []
    return [item.strip().lower() for item in value.split(",") if item.strip()]


def parse_bool(name: str, default: bool = False, environ=None) -> bool:
    """A boolean variable: 1/0, true/false, yes/no, on/off; unset or empty gives ``default``.

    ``environ`` defaults to graft's configuration snapshot (not a fresh read of os.environ).
    """
    env = current() if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise GraftConfigError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def validate_backends(var: str, names: list[str], valid: set[str]) -> list[str]:
    """Reject unknown backend names with an error naming the valid ones."""
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise GraftConfigError(
            f"{var}: unknown backend(s) {', '.join(repr(u) for u in unknown)}; "
            f"valid backends are: {', '.join(sorted(valid))}"
        )
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


@dataclass(frozen=True)
class Settings:
    """A parsed, validated snapshot of the selection variables."""

    global_priority: tuple[str, ...]
    overrides: dict = field(default_factory=dict)  # family-or-op name -> (var, tuple of backends)
    disabled: frozenset = frozenset()
    strict: bool = False
    global_var: str | None = None  # "GRAFT_BACKENDS" when that variable set global_priority

    @property
    def disable_all(self) -> bool:
        return "all" in self.disabled

    def priority_for(self, op: str, family: str) -> tuple[tuple[str, ...], str | None]:
        """The priority list for an op, and the variable that set it (None = default)."""
        if op in self.overrides:
            return self.overrides[op]
        if family in self.overrides:
            return self.overrides[family]
        return self.global_priority, self.global_var

    def is_disabled(self, *names: str) -> str | None:
        for n in names:
            if n in self.disabled:
                return n
        return None


class Snapshot(Mapping):
    """The ``GRAFT_*`` variables as they were when read: a read-only mapping.

    ``generation`` grows with every :func:`reload`; caches key on it instead of
    re-reading the environment on every call. Empty values are dropped (empty = unset).
    """

    def __init__(self, values: dict, generation: int):
        self._values = values
        self.generation = generation
        self.key = tuple(sorted(values.items()))

    def __getitem__(self, name: str) -> str:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Snapshot(generation={self.generation}, {self._values!r})"


_snapshot: Snapshot | None = None
_generation = 0
_reload_lock = threading.Lock()
# Called with the new snapshot after every reload (selection drops its cached decisions).
_listeners: list = []


def _read_environ() -> dict:
    """The non-empty GRAFT_* variables of os.environ, read safely while other threads change it.

    Iterating os.environ looks each key up again after listing it, so another thread's
    unsetenv in between raises KeyError; copying its underlying dict is one step under the
    GIL. (Other Python implementations: retry the plain read.)
    """
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        snapshot = data.copy()
        decode = os.environ.decodekey, os.environ.decodevalue
        pairs = ((decode[0](k), decode[1](v)) for k, v in snapshot.items())
        return {k: v for k, v in pairs if k.startswith("GRAFT_") and v.strip()}
    while True:  # pragma: no cover - CPython takes the branch above
        try:
            return {k: v for k, v in os.environ.items() if k.startswith("GRAFT_") and v.strip()}
        except (KeyError, RuntimeError):
            continue


def current() -> Snapshot:
    """graft's configuration: read from the environment on first use, then cached."""
    snap = _snapshot
    if snap is not None:  # lock-free fast path: every op call comes through here
        return snap
    return reload(_only_if_unread=True)


def reload(_only_if_unread: bool = False) -> Snapshot:
    """Read the ``GRAFT_*`` variables again (``graft.reload_config()``); cached decisions are dropped.

    A reload checks and applies what the first load does (GRAFT_LOG_LEVEL: validated, then
    set on the ``graft`` logger); an invalid value raises GraftConfigError and the
    configuration in force stays as it was (nothing is half applied).
    """
    global _snapshot, _generation
    with _reload_lock:
        if _only_if_unread and _snapshot is not None:
            return _snapshot
        values = _read_environ()
        # The first read (from current(), possibly deep in an import) must not raise: the
        # plugin host validates the level when it loads (configure_logging). An explicit
        # reload validates it here, before anything changes.
        level = None if _only_if_unread else _log_level(values.get("GRAFT_LOG_LEVEL"))
        _generation += 1
        snap = Snapshot(values, _generation)
        _snapshot = snap
    if not _only_if_unread:
        _apply_log_level(level)
    # Listeners (selection, dispatch) drop what was built under the old snapshot; dispatch
    # refuses to keep anything built under an older generation (see graft.dispatch), so no
    # call in flight in another thread can put a stale plan back after this returns.
    for listener in list(_listeners):
        listener(snap)
    return snap


def on_reload(listener: Callable[[Snapshot], None]) -> None:
    """Call ``listener(snapshot)`` after every :func:`reload` (for caches derived from the config)."""
    _listeners.append(listener)


def env_snapshot(environ=None) -> tuple:
    """Hashable snapshot of every GRAFT_* variable (the cached configuration by default)."""
    if environ is None:
        return current().key
    return tuple(sorted((k, v) for k, v in environ.items() if k.startswith("GRAFT_")))


# Active override() blocks, oldest first: (token, {name: value}). With the values the
# variables had before the first block that changed them, they say what os.environ must hold
# whatever order the blocks exit in.
_overrides: list = []
_override_base: dict = {}  # name -> value before the oldest active block changing it
_override_lock = threading.Lock()


@contextlib.contextmanager
def override(values: Mapping[str, str | None] | None = None, **variables: str | None) -> Iterator[Snapshot]:
    """Set (or, with ``None``, unset) ``GRAFT_*`` variables for the duration of a ``with`` block.

    ``os.environ`` is changed too (child processes see the same settings) and restored on
    exit; graft's configuration is reloaded on entry and exit. Blocks may exit in any order
    (two generators, two threads): on exit each variable takes the value of the newest block
    still active that sets it, else the value it had before the first of them. Changing the
    same variables in ``os.environ`` by hand inside a block is undone on exit.
    """
    changes = dict(values or {}, **variables)
    for name in changes:
        if not name.startswith("GRAFT_"):
            raise ValueError(f"override() changes GRAFT_* variables only, got {name!r}")
    token = object()
    with _override_lock:
        for name in changes:
            if not any(name in layer for _, layer in _overrides):
                _override_base[name] = os.environ.get(name)
        _overrides.append((token, changes))
        for name, value in changes.items():
            _set_env(name, value)
    try:
        yield reload()
    finally:
        with _override_lock:
            _overrides[:] = [(t, layer) for t, layer in _overrides if t is not token]
            for name in changes:
                newest = [layer for _, layer in _overrides if name in layer]
                if newest:
                    _set_env(name, newest[-1][name])
                else:
                    _set_env(name, _override_base.pop(name, None))
        reload()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)


def load_settings(valid_backends: set[str], ops: dict[str, str], environ=None, default_priority=None) -> Settings:
    """Parse and validate the selection variables.

    ``ops`` maps every known op name to its family; ``default_priority`` replaces
    DEFAULT_BACKEND_PRIORITY (an adapter's graft_default_backend_priority hook). Raises GraftConfigError on any
    invalid value, naming the valid choices.
    """
    env = current() if environ is None else environ
    valid_backends = set(valid_backends) | {REFERENCE_BACKEND}
    families = set(ops.values())

    raw_global = env.get("GRAFT_BACKENDS") or None
    if raw_global is not None and not split_list(raw_global):
        raise GraftConfigError(
            f"GRAFT_BACKENDS is set but empty; give a comma-separated list of: {', '.join(sorted(valid_backends))}"
        )
    if raw_global is None:
        # Backends of installed plugins that the default does not name still rank above the
        # torch reference: installing a vendor plugin is enough to make it active.
        default = tuple(default_priority or DEFAULT_BACKEND_PRIORITY)
        global_priority = [b for b in default if b in valid_backends and b != REFERENCE_BACKEND]
        global_priority += sorted(valid_backends - set(global_priority) - {REFERENCE_BACKEND})
        global_priority.append(REFERENCE_BACKEND)
    else:
        global_priority = validate_backends("GRAFT_BACKENDS", split_list(raw_global), valid_backends)

    overrides = {}
    for name in sorted(families | set(ops)):
        var = op_env_var(name)
        if env.get(var, "").strip():
            backends = split_list(env[var])
            if not backends:
                raise GraftConfigError(
                    f"{var} is set but empty; give a comma-separated list of: {', '.join(sorted(valid_backends))}"
                )
            overrides[name] = (tuple(validate_backends(var, backends, valid_backends)), var)

    disabled = set(split_list(env.get("GRAFT_DISABLE")))
    valid_disable = valid_backends | families | set(ops) | {"all"}
    unknown = sorted(disabled - valid_disable)
    if unknown:
        raise GraftConfigError(
            f"GRAFT_DISABLE: unknown name(s) {', '.join(repr(u) for u in unknown)}; valid are 'all', "
            f"backends ({', '.join(sorted(valid_backends))}), families ({', '.join(sorted(families))}) "
            f"or ops ({', '.join(sorted(ops))})"
        )
    if REFERENCE_BACKEND in disabled:
        # The reference is what serves when every other backend is off or declines: it
        # defines the ops and cannot be switched off (GRAFT_DISABLE=all leaves only it).
        raise GraftConfigError(
            f"GRAFT_DISABLE: {REFERENCE_BACKEND!r} is graft's torch reference, which defines every op and "
            f"serves when nothing else can; it cannot be disabled (GRAFT_DISABLE=all leaves only the reference; "
            f"to keep graft out of a framework, use its switch, e.g. GRAFT_VLLM=0)"
        )
    strict = parse_bool("GRAFT_STRICT", False, env)
    return Settings(tuple(global_priority), overrides, frozenset(disabled), strict,
                    "GRAFT_BACKENDS" if raw_global is not None else None)


def unknown_env_vars(ops: dict[str, str], environ=None) -> list[str]:
    """GRAFT_* variables set in the environment that nothing reads (likely typos)."""
    from graft import settings

    env = current() if environ is None else environ
    return sorted(k for k in env if k.startswith("GRAFT_") and not settings.is_declared(k, ops))


def _log_level(raw: str | None) -> int | None:
    """GRAFT_LOG_LEVEL's numeric level (None: unset), or GraftConfigError naming the value."""
    if raw is None or not raw.strip():
        return None
    numeric = logging.getLevelName(raw.strip().upper())
    if not isinstance(numeric, int):
        raise GraftConfigError(
            f"GRAFT_LOG_LEVEL={raw!r} is not a log level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return numeric


_level_set = False  # whether graft set the 'graft' logger's level (a reload without the variable undoes it)


def _apply_log_level(numeric: int | None) -> None:
    global _level_set
    logger = logging.getLogger("graft")
    if numeric is None:
        if _level_set:
            logger.setLevel(logging.NOTSET)
            _level_set = False
        return
    logger.setLevel(numeric)
    _level_set = True
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[graft %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def configure_logging() -> None:
    """Apply GRAFT_LOG_LEVEL from the configuration in force (GraftConfigError when invalid)."""
    _apply_log_level(_log_level(current().get("GRAFT_LOG_LEVEL")))
