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
    integrations from activating).
``GRAFT_DISABLE_PLUGINS``
    Adapter plugin (entry-point) names not to load.
``GRAFT_STRICT``
    ``1``: raise instead of falling back when an explicitly requested backend cannot
    serve a call. Default ``0``.
``GRAFT_LOG_LEVEL``
    Log level of the ``graft`` logger (``DEBUG``, ``INFO``, ``WARNING``...).

Other modules declare their own variables with :func:`declare_env_var` so that
``graft info`` can list them and flag unknown (probably misspelt) ``GRAFT_*`` names.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from graft.errors import GraftConfigError

DEFAULT_BACKEND_PRIORITY = ("hip", "triton", "torch")
REFERENCE_BACKEND = "torch"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# name -> one-line description; filled by declare_env_var.
KNOWN_ENV_VARS: dict[str, str] = {}


def declare_env_var(name: str, description: str) -> str:
    """Record a GRAFT_* variable a module reads, for `graft info` and typo detection."""
    if not name.startswith("GRAFT_"):
        raise ValueError(f"graft environment variables must start with GRAFT_, got {name!r}")
    KNOWN_ENV_VARS[name] = description
    return name


declare_env_var("GRAFT_BACKENDS", "global backend priority list, highest first")
declare_env_var("GRAFT_DISABLE", "backends, op families, ops, or 'all' to switch off")
declare_env_var("GRAFT_DISABLE_PLUGINS", "adapter plugin names not to load")
declare_env_var("GRAFT_STRICT", "1: raise instead of falling back from an explicitly requested backend")
declare_env_var("GRAFT_LOG_LEVEL", "log level of the 'graft' logger")
declare_env_var("GRAFT_TEST_DEVICE", "device graft's own test suite runs on (cpu, or cuda in ci/gpu_check.sh)")


def op_env_var(name: str) -> str:
    """``attention.decode_paged`` -> ``GRAFT_ATTENTION_DECODE_PAGED``; ``gemm`` -> ``GRAFT_GEMM``."""
    return "GRAFT_" + name.upper().replace(".", "_").replace("-", "_")


def split_list(value: str | None) -> list[str]:
    if value is None:
        return []
    return [item.strip().lower() for item in value.split(",") if item.strip()]


def parse_bool(name: str, default: bool = False, environ=None) -> bool:
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
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

    @property
    def disable_all(self) -> bool:
        return "all" in self.disabled

    def priority_for(self, op: str, family: str) -> tuple[tuple[str, ...], str | None]:
        """The priority list for an op, and the variable that set it (None = default)."""
        if op in self.overrides:
            return self.overrides[op]
        if family in self.overrides:
            return self.overrides[family]
        var = "GRAFT_BACKENDS" if "GRAFT_BACKENDS" in os.environ else None
        return self.global_priority, var

    def is_disabled(self, *names: str) -> str | None:
        for n in names:
            if n in self.disabled:
                return n
        return None


def env_snapshot(environ=None) -> tuple:
    """Hashable snapshot of every GRAFT_* variable, used as a cache key."""
    env = os.environ if environ is None else environ
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("GRAFT_")))


def load_settings(valid_backends: set[str], ops: dict[str, str], environ=None, default_priority=None) -> Settings:
    """Parse and validate the selection variables.

    ``ops`` maps every known op name to its family; ``default_priority`` replaces
    DEFAULT_BACKEND_PRIORITY (an adapter's graft_default_backend_priority hook). Raises GraftConfigError on any
    invalid value, naming the valid choices.
    """
    env = os.environ if environ is None else environ
    valid_backends = set(valid_backends) | {REFERENCE_BACKEND}
    families = set(ops.values())

    raw_global = env.get("GRAFT_BACKENDS")
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
        if var in env:
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
    strict = parse_bool("GRAFT_STRICT", False, env)
    return Settings(tuple(global_priority), overrides, frozenset(disabled), strict)


def unknown_env_vars(ops: dict[str, str], environ=None) -> list[str]:
    """GRAFT_* variables set in the environment that nothing reads (likely typos)."""
    env = os.environ if environ is None else environ
    known = set(KNOWN_ENV_VARS) | {op_env_var(n) for n in set(ops) | set(ops.values())}
    return sorted(k for k in env if k.startswith("GRAFT_") and k not in known)


def configure_logging() -> None:
    level = os.environ.get("GRAFT_LOG_LEVEL")
    if not level:
        return
    numeric = logging.getLevelName(level.strip().upper())
    if not isinstance(numeric, int):
        raise GraftConfigError(
            f"GRAFT_LOG_LEVEL={level!r} is not a log level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    logger = logging.getLogger("graft")
    logger.setLevel(numeric)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[graft %(levelname)s] %(message)s"))
        logger.addHandler(handler)
