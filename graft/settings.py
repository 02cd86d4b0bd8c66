"""Every ``GRAFT_*`` environment variable graft reads, declared once, as data.

Each :class:`Setting` names a variable, its type (``bool``, ``int``, ``float``, ``str``,
``path``, ``list`` or ``choice`` with its choices), its default, a one-line description and
its owner (the module that reads it). The per-op and per-family priority variables
(``GRAFT_<OP>``, ``GRAFT_<FAMILY>``: :func:`graft.config.op_env_var` of an op or family name)
are one declared pattern (:data:`PATTERNS`), not a row per op.

Values are read through graft's one configuration snapshot (:func:`graft.config.current`),
so ``graft.reload_config()`` and ``graft.override_config()`` apply to all of them; a setting
marked ``read_at`` is read from ``os.environ`` at that moment instead (e.g. when graft is
imported), and its reader passes ``environ=os.environ``::

    from graft import settings
    settings.get("GRAFT_STRICT")        # False, or what GRAFT_STRICT parses to
    settings.raw("GRAFT_TUNING_TABLE")  # the text as set, or None

An invalid value raises :class:`graft.errors.GraftConfigError` naming the variable, the
value and what is valid. An empty value means the same as an unset variable.

``graft info`` lists the table and flags set ``GRAFT_*`` names it does not declare (likely
typos); ``python -m graft.tools.settings_doc`` writes it as ``docs/settings.md``.
Variables only graft's own test suite and CI read are declared in ``tests/conftest.py``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from graft import config
from graft.errors import GraftConfigError

TYPES = ("bool", "int", "float", "str", "path", "list", "choice")
INT_LIMIT = 1 << 62  # thresholds travel through int64 custom-op arguments


@dataclass(frozen=True)
class Setting:
    """One declared ``GRAFT_*`` variable."""

    name: str
    type: str
    default: Any
    doc: str
    owner: str
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None
    read_at: str = ""  # "" (through the snapshot) or when it is read from os.environ ("import", ...)
    aliases: tuple = ()  # deprecated old names, read when the new name is unset (a one-time warning)
    default_doc: str = ""  # the default in words, where it is not a plain value
    synonyms: tuple = ()  # (value, choice) pairs a choice also accepts, e.g. ("1", "signature")

    def __post_init__(self):
        if not self.name.startswith("GRAFT_"):
            raise ValueError(f"graft environment variables must start with GRAFT_, got {self.name!r}")
        if self.type not in TYPES:
            raise ValueError(f"{self.name}: type {self.type!r} is not one of {', '.join(TYPES)}")
        if self.type == "choice" and not self.choices:
            raise ValueError(f"{self.name}: a choice needs its choices")

    def parse(self, raw: str | None, var: str | None = None) -> Any:
        """The typed value of ``raw`` (None or blank: the default); GraftConfigError naming
        ``var`` (default: this setting's name), the value and what is valid when it is invalid."""
        if raw is None or not raw.strip():
            return self.default
        value = raw.strip()
        name = var or self.name
        if self.type == "bool":
            return config.parse_bool(name, bool(self.default), {name: raw})
        if self.type == "int":
            return _parse_int(self, name, raw)
        if self.type == "float":
            try:
                number = float(value)
            except ValueError:
                raise GraftConfigError(f"{name}={raw!r} is not a number; e.g. {self.default or 1}") from None
            return _bounded(self, name, raw, number)
        if self.type == "choice":
            lowered = dict(self.synonyms).get(value.lower(), value.lower())
            if lowered not in self.choices:
                raise GraftConfigError(
                    f"{name}={raw!r} is not valid; use one of: {', '.join(self.choices)}")
            return lowered
        if self.type == "list":
            items = config.split_list(raw)
            if self.choices:
                unknown = [i for i in items if i not in self.choices]
                if unknown or not items:
                    raise GraftConfigError(
                        f"{name}={raw!r}: unknown or empty; give a comma-separated list of "
                        f"{', '.join(self.choices)}")
            return items
        return value  # str, path

    def describe_type(self) -> str:
        if self.type in ("choice", "list") and self.choices:
            return f"{self.type}: {' | '.join(self.choices)}"
        if self.type in ("int", "float") and (self.minimum is not None or self.maximum is not None):
            low = "" if self.minimum is None else f"{self.minimum:g} <= "
            high = "" if self.maximum is None or self.maximum >= INT_LIMIT else f" <= {self.maximum:g}"
            return f"{self.type} ({low}n{high})"
        return self.type

    def describe_default(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, (list, tuple)):
            return ",".join(self.default) or "(empty)"
        return str(self.default)


@dataclass(frozen=True)
class Pattern:
    """A declared family of variables, e.g. ``GRAFT_<OP>``: one per op and op family."""

    pattern: str
    type: str
    doc: str
    owner: str
    default_doc: str = ""


def _parse_int(s: Setting, name: str, raw: str) -> int:
    text = raw.strip().lower().replace("_", "")
    scale = 1
    for suffix, factor in (("kib", 1024), ("mib", 1024**2), ("gib", 1024**3), ("k", 1024), ("m", 1024**2)):
        if text.endswith(suffix):
            text, scale = text[: -len(suffix)], factor
            break
    try:
        value = int(text) * scale
    except ValueError:
        raise GraftConfigError(
            f"{name}={raw!r} is not an integer; give a whole number (suffixes KiB/MiB/GiB allowed), e.g. {s.default}"
        ) from None
    return int(_bounded(s, name, raw, value))


def _bounded(s: Setting, name: str, raw: str, value):
    if s.minimum is not None and value < s.minimum:
        raise GraftConfigError(f"{name}={raw!r} must be >= {s.minimum}")
    if s.maximum is not None and value > s.maximum:
        raise GraftConfigError(f"{name}={raw!r} must be <= {s.maximum}")
    return value


_BACKENDS_DOC = "comma-separated backend names, highest priority first"

_ROWS = (
    # --- selection (graft.config, graft.selection, graft.dispatch)
    Setting("GRAFT_BACKENDS", "list", None,
            "global backend priority list, highest first; backends not listed are still tried after the listed "
            "ones, and torch (the reference) is always the last resort", "graft.config",
            default_doc="hip,triton,torch (then other installed backends, then torch)"),
    Setting("GRAFT_DISABLE", "list", None,
            "backends, op families, ops, or 'all' to switch off ('all': every op uses the torch reference and no "
            "framework integration activates; torch itself cannot be disabled)", "graft.config"),
    Setting("GRAFT_DISABLE_PLUGINS", "list", None, "adapter plugin (entry-point) names not to load", "graft.plugins"),
    Setting("GRAFT_STRICT", "bool", False,
            "1: raise instead of falling back from an explicitly requested backend", "graft.selection"),
    Setting("GRAFT_LOG_LEVEL", "str", None,
            "log level of the 'graft' logger: DEBUG, INFO, WARNING, ERROR or CRITICAL", "graft.config"),
    Setting("GRAFT_DISPATCH_C", "bool", True,
            "0: dispatch through the Python entries only (for debugging)", "graft.dispatch", read_at="import"),
    Setting("GRAFT_CHECK_VALUES", "bool", None,
            "input checks that read tensor values (cu_seqlens, expert ids...): default on for CPU tensors (free), "
            "off on GPUs (each is a device sync) unless 1 or GRAFT_STRICT=1", "graft.ops._validate",
            default_doc="1 on the CPU; on GPUs 0 unless GRAFT_STRICT=1"),
    Setting("GRAFT_TUNING_TABLE", "str", None,
            "tuning tables (graft tune's JSON) to read, ':' or ',' separated; first match wins", "graft.tuning"),
    Setting("GRAFT_TUNING_BATCH_INVARIANT", "bool", False,
            "1: one backend per shape for every token count (set by VLLM_BATCH_INVARIANT=1 too)", "graft.tuning"),
    # --- compiled kernels (graft.kernels.*)
    Setting("GRAFT_CACHE_DIR", "path", None, "cache directory for built kernels", "graft.kernels._extension",
            default_doc="~/.cache/graft"),
    Setting("GRAFT_HIP_BUILD", "choice", "lazy",
            "lazy: build the HIP/CUDA kernels on first use; off: never build them (hip backend unavailable unless "
            "built ahead of time with `python -m graft.kernels.hip build`)", "graft.kernels.hip._build",
            choices=("lazy", "off")),
    Setting("GRAFT_CPP_BUILD", "choice", "lazy",
            "lazy: build graft's CPU C++ kernels on first use; off: never build them (cpp backend unavailable "
            "unless built ahead of time with `python -m graft.kernels.cpp build`)", "graft.kernels.cpp._build",
            choices=("lazy", "off")),
    Setting("GRAFT_BUILD_VERBOSE", "bool", False,
            "1: show compiler output when building graft's compiled kernels (HIP/CUDA and CPU C++)",
            "graft.kernels._extension", aliases=("GRAFT_HIP_VERBOSE",)),
    # --- collectives (graft.kernels.collectives)
    Setting("GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES", "int", 512 * 1024,
            "largest message (bytes) the one-shot custom all-reduce serves (suffixes KiB/MiB/GiB)",
            "graft.kernels.collectives._common", minimum=0, maximum=INT_LIMIT),
    Setting("GRAFT_TWOSHOT_ALLREDUCE_MAX_BYTES", "int", 8 * 1024 * 1024,
            "largest message (bytes) the two-shot custom all-reduce serves", "graft.kernels.collectives._common",
            minimum=0, maximum=INT_LIMIT),
    Setting("GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD", "int", 8,
            "largest group size the one-shot/two-shot all-reduce serves", "graft.kernels.collectives._common",
            minimum=1, maximum=INT_LIMIT),
    Setting("GRAFT_OVERLAP_CHUNKS", "int", 4, "pipeline depth (chunks) of the GEMM + collective overlap ops",
            "graft.kernels.collectives._common", minimum=1, maximum=1024),
    Setting("GRAFT_OVERLAP_MIN_BYTES", "int", 1024 * 1024,
            "smallest collective (bytes) the GEMM + collective overlap ops pipeline",
            "graft.kernels.collectives._common", minimum=0, maximum=INT_LIMIT),
    Setting("GRAFT_QUANTIZED_GATHER_MIN_BYTES", "int", 64 * 1024,
            "smallest per-rank input (bytes) the int8 all-gather quantizes; smaller ones gather exactly",
            "graft.kernels.collectives._common", minimum=0, maximum=INT_LIMIT),
    Setting("GRAFT_COLLECTIVES_VALIDATE", "choice", "signature",
            "signature: ranks agree on shapes, dtypes, algorithm and settings on the first call of each signature "
            "(it cannot be switched off: 1/0 mean signature too); always: before every call",
            "graft.kernels.collectives._common", choices=("signature", "always"),
            synonyms=tuple((v, "signature") for v in ("1", "true", "yes", "on", "0", "false", "no", "off"))),
    Setting("GRAFT_COLLECTIVES_TIMEOUT", "float", None,
            "seconds (> 0) a graft collective may wait for its peers before raising", "graft.kernels.collectives._common",
            minimum=0, default_doc="the process group's timeout"),
    # --- frameworks (graft.adapters.*)
    Setting("GRAFT_VLLM", "bool", True, "0: keep graft out of vLLM (no custom ops, no attention backend)",
            "graft.adapters.vllm"),
    Setting("GRAFT_VLLM_OPS", "list", None, "which vLLM layers graft replaces (comma-separated)",
            "graft.adapters.vllm.plugin", choices=("rms_norm", "silu_and_mul", "rotary_embedding", "linear", "moe",
                                                  "attention"), default_doc="all of them"),
    Setting("GRAFT_VLLM_ATTENTION_OVERRIDE", "str", None,
            "name of a built-in vLLM attention backend (e.g. TRITON_ATTN; CPU_ATTN on vLLM's CPU platform, which "
            "ignores --attention-backend) to serve with graft's backend instead", "graft.adapters.vllm.attention"),
    Setting("GRAFT_MEGATRON", "bool", True,
            "0: get_gpt_layer_graft_spec() returns Megatron's own local spec (no graft modules)",
            "graft.adapters.megatron"),
    Setting("GRAFT_MEGATRON_FUSED_LOSS", "bool", False,
            "1: graft.adapters.megatron.GraftGPTModel computes its output layer and loss with "
            "loss.fused_linear_cross_entropy when labels are given (no logits tensor)",
            "graft.adapters.megatron.output_loss"),
    Setting("GRAFT_TORCHTITAN", "bool", True, "0: graft's TorchTitan converter leaves the model config unchanged",
            "graft.adapters.torchtitan"),
    Setting("GRAFT_DEEPSPEED", "bool", True,
            "0: leave DeepSpeed alone (no graft accelerator, op builders or comm routing)", "graft.adapters.deepspeed"),
    # --- profiling (read when the interpreter of a profiled command starts)
    Setting("GRAFT_PROFILE_DIR", "path", None, "set by graft profile: the folder each process of the job records into",
            "graft.profiling.boot", read_at="interpreter start"),
    Setting("GRAFT_PROFILE_STEPS", "int", 0, "set by graft profile: steps in each process's window (0: to exit)",
            "graft.profiling.boot", minimum=0, maximum=INT_LIMIT, read_at="interpreter start"),
    Setting("GRAFT_PROFILE_WARMUP", "int", 0, "set by graft profile: steps before the window opens",
            "graft.profiling.boot", minimum=0, maximum=INT_LIMIT, read_at="interpreter start"),
    # --- tools (graft.tools.*)
    Setting("GRAFT_PATCH_LINTERS", "path", None, "folder of the pinned linters graft patches checks with",
            "graft.tools.patches.linters", default_doc="~/.cache/graft-patch-linters"),
    Setting("GRAFT_BENCH_ENGINE", "str", None, "set by graft bench vllm: the engine process's options (JSON)",
            "graft.tools.bench.vllm_engine", default_doc="{}"),
    Setting("GRAFT_BENCH_TITAN_SPMD", "str", "partial_dtensor",
            "TorchTitan SPMD backend of the TorchTitan bench and training runs (spmd_types: TorchTitan's default, "
            "where it builds)", "graft.tools.bench.torchtitan_step"),
    Setting("GRAFT_CONFORMANCE_DEVICE", "str", "cpu",
            "device of the conformance pytest plugin's cases (--graft-conformance-device wins)",
            "graft.tools.conformance.pytest_plugin", read_at="pytest start"),
)

TABLE: dict[str, Setting] = {}
for _row in _ROWS:
    if _row.name in TABLE:
        raise ValueError(f"{_row.name} is declared twice")
    TABLE[_row.name] = _row
del _row

# Deprecated old name -> the setting that replaced it.
ALIASES: dict[str, str] = {alias: s.name for s in _ROWS for alias in s.aliases}

PATTERNS = (
    Pattern("GRAFT_<OP>", "list",
            "priority list of one op (GRAFT_ATTENTION_DECODE_PAGED=torch; dots in op names become underscores); "
            "wins over GRAFT_<FAMILY> and GRAFT_BACKENDS; " + _BACKENDS_DOC, "graft.config",
            default_doc="GRAFT_<FAMILY>, else GRAFT_BACKENDS"),
    Pattern("GRAFT_<FAMILY>", "list",
            "priority list of one op family (GRAFT_ATTENTION=triton,torch); wins over GRAFT_BACKENDS; "
            + _BACKENDS_DOC, "graft.config", default_doc="GRAFT_BACKENDS"),
)

_warned: set = set()


def setting(name: str) -> Setting:
    """The declared row of ``name`` (KeyError naming the table when it is not declared)."""
    try:
        return TABLE[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in graft.settings.TABLE") from None


def _lookup(name: str, environ: Mapping[str, str] | None) -> tuple[str, str | None]:
    """(the variable that is set, its text): ``name`` itself, else a deprecated alias (logged once)."""
    s = setting(name)
    env = config.current() if environ is None else environ
    value = env.get(name)
    if value is not None and value.strip():
        return name, value
    for alias in s.aliases:
        old = env.get(alias)
        if old is not None and old.strip():
            if alias not in _warned:
                _warned.add(alias)
                logging.getLogger("graft").warning("%s is deprecated; set %s instead", alias, name)
            return alias, old
    return name, None


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of a declared variable (None when unset or empty), from graft's snapshot by
    default (``environ``: another mapping, e.g. os.environ for a setting read at import)."""
    return _lookup(name, environ)[1]


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of a declared variable (its default when unset): bool, int, float,
    str, list or the chosen choice. GraftConfigError names the bad value and what is valid."""
    var, text = _lookup(name, environ)
    return setting(name).parse(text, var)


def is_declared(name: str, ops: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is a declared variable, a deprecated alias, or (given ``ops``, op name ->
    family) one of the GRAFT_<OP> / GRAFT_<FAMILY> pattern's variables."""
    if name in TABLE or name in ALIASES:
        return True
    if ops is None:
        return False
    return name in {config.op_env_var(n) for n in set(ops) | set(ops.values())}


def rows() -> list[Setting]:
    """The declared settings, in table order."""
    return list(_ROWS)
