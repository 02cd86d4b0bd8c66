"""Tuning tables: which backend was measured fastest, per device, op, dtype and shape bucket.

``graft tune`` (:mod:`graft.tools.tune`) measures every implementation of an op that can serve a
shape on this device, the framework's own included (:mod:`graft.framework_backend`), and
writes the winner of each shape bucket to a table. Selection (:mod:`graft.selection`) reads
the tables on dispatch's cold path only (when a plan is built, and per argument signature
before it is remembered): a remembered call costs nothing more. Where no ``GRAFT_*`` variable sets an op's order:

* a bucket with a table entry is served by the entry's backend first (then the usual order);
* a bucket without one keeps the default order, in which the framework's own code, where it
  can serve, comes first: graft steps aside unless it is known faster here.

An explicit ``GRAFT_<OP>`` / ``GRAFT_<FAMILY>`` / ``GRAFT_BACKENDS`` always wins over tables.

Where tables come from, first match wins: the files in ``GRAFT_TUNING_TABLE`` (paths
separated by ``:`` or ``,``), then tables plugins ship (``graft_tuning_tables`` hook). A table
measured on another device (type, name, arch, driver) or with other torch/Triton versions is
ignored, and ``graft info`` says why. Choices are a pure function of the table and the call's
shapes, never of timings taken at run time, so every rank of a job reading the same table
chooses the same implementation. In batch-invariant mode (``GRAFT_TUNING_BATCH_INVARIANT=1``,
or ``VLLM_BATCH_INVARIANT=1``) one backend serves every token count of a shape: the one with
the least total measured time over the table's token buckets.

Table format (JSON, ``"format": "graft-tuning/1"``)::

    {"format": "graft-tuning/1",
     "device": {"type": "cpu", "name": "AMD EPYC 7B13", "arch": "x86_64", "driver": ""},
     "versions": {"torch": "2.13.0", "triton": "3.9.0"},
     "created": "2026-12-03T21:00:00Z", "source": "graft tune --model ...",
     "entries": [
       {"op": "fused.rms_norm", "dtype": "float32", "bucket": "t<=16 x=[t,256] weight=[256] residual=None",
        "backend": "vllm", "provider": "vllm", "ratio": 1.31,
        "median_us": {"vllm": 3.1, "torch": 4.1}, "spread": {"vllm": [2.9, 3.4], "torch": [3.8, 4.6]},
        "rejected": {"triton": "does not match the reference: ..."}}]}

``ratio``: the next-fastest candidate's median time over the winner's (how much faster the
winner is here). A graft backend wins a bucket only if it beats the framework's own code by
more than :data:`MARGIN`; within the margin the framework's code is recorded as the winner.

Shape buckets (:func:`bucket`): the token count ``T`` (first dimension of the op's key tensor)
rounded up to a power of two, ``t<=T``; every tensor argument's shape, its first dimension
written ``t`` for the arguments listed in :data:`TOKEN_ARGS` (the key tensor's for other ops);
int, bool and string arguments by value; float arguments (eps, scales) are left out.

Recorded shapes (what ``graft tune --shapes FILE`` reads; a profile can write them)::

    {"format": "graft-shapes/1",
     "shapes": [{"op": "fused.rms_norm", "dtype": "float32",
                 "args": [{"shape": [16, 256]}, {"shape": [256]}, 1e-06, null]},
                {"op": "fused.rotary_embedding", "dtype": "float32",
                 "args": [{"shape": [16], "dtype": "int64", "high": 4096}, {"shape": [16, 256]},
                          {"shape": [16, 128]}, 64, {"shape": [4096, 64]}, true]}]}

Each argument is a literal (number, bool, string, null) or a tensor ``{"shape": [...],
"dtype": ..., "high": N, "scale": S}``: floating tensors are random normal times ``scale``
(default 1; a weight's is 1/sqrt(fan-in), so that outputs stay near unit size as in a
trained model and a candidate's rounding is judged on values of that size) in the entry's
``dtype`` unless ``dtype`` says otherwise; integer tensors are random in ``[0, high)``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata

import torch

from graft import config, settings
from graft.errors import GraftConfigError
from graft.platform import dtype_name

log = logging.getLogger("graft.tuning")

FORMAT = "graft-tuning/1"
SHAPES_FORMAT = "graft-shapes/1"
MARGIN = 0.05  # a graft backend must beat the framework's own code by more than this to win

# Declared in graft.settings.
TABLE_VAR = "GRAFT_TUNING_TABLE"
INVARIANT_VAR = "GRAFT_TUNING_BATCH_INVARIANT"

# Arguments whose first dimension is the token count, per op (default: the key tensor's).
TOKEN_ARGS = {
    "fused.rms_norm": ("x", "residual"),
    "fused.layer_norm": ("x",),
    "fused.silu_and_mul": ("x",),
    "fused.rotary_embedding": ("positions", "q", "k"),
    "gemm.linear": ("x",),
    "moe.fused_experts": ("hidden", "topk_weights", "topk_ids"),
}


# --------------------------------------------------------------------------- keys


def token_bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 stays 0): ``t<=`` that value."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _parameters(op: str) -> tuple:
    import inspect

    from graft.plugins import get_registry

    spec = get_registry().op(op)
    return tuple(inspect.signature(spec.reference).parameters), spec.key_arg, frozenset(spec.varying_names)


def bucket(op: str, args: tuple, kwargs: dict | None = None) -> str:
    """The shape bucket of a call (see the module doc): the key of a tuning table entry.

    Scalars a remembered signature matches by type only (the op's ``varying_names``: a
    ``max_seqlen``, an optimizer's ``step``) are left out like floats, so every call a
    remembered signature serves falls in the bucket of the call that made it: the choice
    depends only on the call and the table, never on the order of calls (ranks agree)."""
    names, key_arg, varying = _parameters(op)
    values = dict(zip(names, args))
    values.update(kwargs or {})
    token_args = TOKEN_ARGS.get(op) or (names[key_arg],)
    key = values.get(names[key_arg]) if key_arg < len(names) else None
    tokens = key.shape[0] if isinstance(key, torch.Tensor) and key.dim() > 0 else 0
    parts = [f"t<={token_bucket(tokens)}"]
    for name in names:
        if name not in values:
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            dims = [str(d) for d in value.shape]
            if name in token_args and dims:
                dims[0] = "t"
            parts.append(f"{name}=[{','.join(dims)}]")
        elif name in varying:
            continue
        elif value is None or isinstance(value, (bool, int, str)):
            parts.append(f"{name}={value}")
    return " ".join(parts)


def _tokens_of(bucket_key: str) -> int:
    head = bucket_key.split(" ", 1)[0]
    return int(head[3:]) if head.startswith("t<=") and head[3:].isdigit() else -1


def without_tokens(bucket_key: str) -> str:
    """The bucket with its token count left out (batch-invariant lookups)."""
    return bucket_key.split(" ", 1)[1] if bucket_key.startswith("t<=") and " " in bucket_key else bucket_key


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_key(device_type: str | None = None) -> dict:
    """What a table's measurements are valid for: device type, name, architecture, driver."""
    from graft.platform import default_device, device_info

    device = torch.device(device_type) if device_type else default_device()
    if device.type == "cpu":
        return {"type": "cpu", "name": _cpu_name(), "arch": platform.machine(), "driver": ""}
    info = device_info(device)
    driver = getattr(torch.version, "hip", None) or getattr(torch.version, "cuda", None) or ""
    return {"type": info.type, "name": info.name, "arch": info.arch, "driver": str(driver)}


def versions() -> dict:
    """The software a table's measurements depend on (torch, Triton: kernels and compilers)."""
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__.split("+")[0], "triton": triton}


# --------------------------------------------------------------------------- tables


@dataclass
class Table:
    """One tuning table and whether it applies here."""

    source: str  # a path, or "<plugin>: <path or 'in memory'>"
    device: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    entries: dict = field(default_factory=dict)  # (op, dtype, bucket) -> entry dict
    ignored: str | None = None  # why it does not apply here (None: it applies)

    @property
    def used(self) -> bool:
        return self.ignored is None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The table's schema, one place: field -> (what it must be, a check). Entries' optional fields
# are checked too, so that a bad value is a clear error here, never an AttributeError or a
# TypeError in some later reader (dispatch, graft info, batch-invariant totals).
_TOP_FIELDS = {
    "device": ("an object of strings (type, name, arch, driver)",
               lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "versions": ("an object of strings or nulls (torch, triton)",
                 lambda v: isinstance(v, dict) and all(x is None or isinstance(x, str) for x in v.values())),
    "entries": ("a list of entry objects", lambda v: isinstance(v, list)),
    "created": ("a string", lambda v: isinstance(v, str)),
    "source": ("a string", lambda v: isinstance(v, str)),
}
_ENTRY_FIELDS = {
    "op": ("a string", lambda v: isinstance(v, str) and bool(v)),
    "dtype": ("a string", lambda v: isinstance(v, str) and bool(v)),
    "bucket": ("a string", lambda v: isinstance(v, str)),
    "backend": ("a string", lambda v: isinstance(v, str) and bool(v)),
    "provider": ("a string", lambda v: isinstance(v, str)),
    "ratio": ("a number or null", lambda v: v is None or _number(v)),
    "median_us": ("an object of numbers", lambda v: isinstance(v, dict) and all(_number(x) for x in v.values())),
    "spread": ("an object of [low, high] number pairs", lambda v: isinstance(v, dict) and all(
        isinstance(x, list) and len(x) == 2 and all(_number(y) for y in x) for x in v.values())),
    "providers": ("an object of strings", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "rejected": ("an object of strings", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "note": ("a string or null", lambda v: v is None or isinstance(v, str)),
}
_REQUIRED = ("op", "dtype", "bucket", "backend")


def parse(data, source: str) -> Table:
    """A table from its JSON data; a bad table is a GraftConfigError naming the file and
    the field that is wrong (the format, every top-level field, every entry's fields)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise GraftConfigError(f"tuning table {source}: format must be {FORMAT!r}, got {found!r}")
    for name, (what, ok) in _TOP_FIELDS.items():
        if name in data and not ok(data[name]):
            raise GraftConfigError(f"tuning table {source}: {name!r} must be {what}, got {data[name]!r:.200}")
    entries = {}
    for i, entry in enumerate(data.get("entries", [])):
        if not isinstance(entry, dict):
            raise GraftConfigError(f"tuning table {source}: entry {i} must be an object, got {entry!r:.200}")
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            raise GraftConfigError(f"tuning table {source}: entry {i} lacks {', '.join(missing)}: {entry!r:.200}")
        for name, (what, ok) in _ENTRY_FIELDS.items():
            if name in entry and not ok(entry[name]):
                raise GraftConfigError(f"tuning table {source}: entry {i} field {name!r} must be {what}, "
                                       f"got {entry[name]!r:.200}")
        entries[(entry["op"], entry["dtype"], entry["bucket"])] = entry
    return Table(source, dict(data.get("device") or {}), dict(data.get("versions") or {}), entries)


def load(path: str) -> Table:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise GraftConfigError(f"{TABLE_VAR}: cannot read tuning table {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise GraftConfigError(f"tuning table {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                               "graft tune writes UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise GraftConfigError(f"tuning table {path!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise GraftConfigError(f"tuning table {path!r} is nested too deeply to be a tuning table") from None
    return parse(data, path)


def mismatch(table: Table, device: dict, here_versions: dict) -> str | None:
    """Why a table measured elsewhere does not apply here (None: it does)."""
    for key in ("type", "name", "arch", "driver"):
        if table.device.get(key, "") != device.get(key, ""):
            return (f"measured on another device ({key} {table.device.get(key)!r}, this machine's is "
                    f"{device.get(key)!r})")
    for key in ("torch", "triton"):
        if table.versions.get(key) != here_versions.get(key):
            return f"measured with {key} {table.versions.get(key)}, this machine has {here_versions.get(key)}"
    return None


def _paths(value: str) -> list:
    return [p.strip() for p in value.replace(",", os.pathsep).split(os.pathsep) if p.strip()]


_loaded: dict = {}  # config generation -> the tables as read (before matching them to a device)
_tables_cache: dict = {}  # (config generation, device type) -> list[Table]


def tables(device_type: str | None = None) -> list:
    """Every table considered for ``device_type`` (default: this machine's device), in order of
    precedence, each marked used or ignored. The files are read once per configuration
    generation (``graft.reload_config()`` reads them again), whatever device types ask."""
    from graft.platform import default_device

    device_type = device_type or default_device().type
    snap = config.current()
    key = (snap.generation, device_type)
    cached = _tables_cache.get(key)
    if cached is not None:
        return cached
    read = _loaded.get(snap.generation)
    if read is None:
        read = [load(path) for path in _paths(settings.raw(TABLE_VAR) or "")]
        read += _plugin_tables()
        _loaded.clear()
        _loaded[snap.generation] = read
    # Each device type marks its own copies used or ignored; the entries are shared.
    found = [dataclasses.replace(t) for t in read]
    if any(t.used for t in found):
        here, here_versions = device_key(device_type), versions()
        for table in found:
            if table.ignored is None:
                table.ignored = mismatch(table, here, here_versions)
    # list() copies the keys in one step: another thread may be adding its device's tables.
    for stale in [k for k in list(_tables_cache) if k[0] != snap.generation]:
        _tables_cache.pop(stale, None)
    _tables_cache[key] = found
    return found


def _plugin_tables() -> list:
    from graft.plugins import get_host

    found = []
    for name, items in get_host().call_each("graft_tuning_tables"):
        for item in items or ():
            try:
                table = load(os.fspath(item)) if isinstance(item, (str, os.PathLike)) else parse(item, "in memory")
            except GraftConfigError as exc:  # a plugin's broken table must not break graft
                log.warning("graft: tuning table from plugin %s ignored: %s", name, exc)
                found.append(Table(f"{name}: {item if isinstance(item, str) else 'in memory'}", ignored=str(exc)))
                continue
            table.source = f"{name}: {table.source}"
            found.append(table)
    return found


_invariant: dict = {}  # config generation -> batch-invariant mode


def invariant() -> bool:
    """Batch-invariant mode: one backend per shape for every token count. Read once per
    configuration generation, like every setting (``VLLM_BATCH_INVARIANT`` included: changed
    mid-process it applies after ``graft.reload_config()``, never to some lookups only)."""
    generation = config.current().generation
    value = _invariant.get(generation)
    if value is None:
        value = settings.get(INVARIANT_VAR) or \
            os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("1", "true")
        _invariant.clear()
        _invariant[generation] = value
    return value


@dataclass(frozen=True)
class Choice:
    backend: str
    provider: str
    ratio: float | None
    source: str  # the table it came from
    bucket: str


def choices(op: str, device_type: str, dtype) -> dict | None:
    """``{bucket: Choice}`` for ``op`` and ``dtype`` from the tables that apply here (first
    table wins per bucket); in batch-invariant mode the keys are buckets without the token
    count. None when no table has an entry for the op: dispatch then adds nothing."""
    name = dtype_name(dtype) if dtype is not None else None
    out: dict = {}
    totals: dict = {}  # batch-invariant: shape without tokens -> {backend: [total us, buckets, provider, table]}
    is_invariant = invariant()
    for table in tables(device_type):
        if not table.used:
            continue
        for (e_op, e_dtype, e_bucket), entry in table.entries.items():
            if e_op != op or e_dtype != name:
                continue
            if not is_invariant:
                if e_bucket not in out:
                    out[e_bucket] = Choice(entry["backend"], entry.get("provider", ""), entry.get("ratio"),
                                           table.source, e_bucket)
                continue
            per_backend = totals.setdefault(without_tokens(e_bucket), {})
            providers = entry.get("providers") or {}
            for backend, us in (entry.get("median_us") or {}).items():
                slot = per_backend.setdefault(backend, [0.0, 0, providers.get(backend, ""), table.source])
                slot[0] += float(us)
                slot[1] += 1
    for shape, per_backend in totals.items():
        # Only backends measured at every token count of the shape compete: least total time wins.
        most = max(slot[1] for slot in per_backend.values())
        backend, (_, _, provider, source) = min(
            ((b, s) for b, s in per_backend.items() if s[1] == most), key=lambda kv: kv[1][0])
        out[shape] = Choice(backend, provider, None, source, shape)
    return out or None


def lookup(table_choices: dict, op: str, args: tuple, kwargs: dict) -> Choice | None:
    """The table's choice for this call (None: no entry for its bucket)."""
    key = bucket(op, args, kwargs)
    if invariant():
        key = without_tokens(key)
    return table_choices.get(key)


def first_entry(op: str, device_type: str | None = None, dtype=None, wanted=None) -> tuple | None:
    """The first entry for ``op`` (and ``dtype``; None: any) in the tables that apply here
    for which ``wanted(backend, dtype name)`` is true (None: any entry):
    ``(table, dtype, bucket, backend, ratio)``."""
    name = dtype_name(dtype) if dtype is not None else None
    for table in tables(device_type):
        if not table.used:
            continue
        for (e_op, e_dtype, e_bucket), entry in table.entries.items():
            if e_op == op and (name is None or e_dtype == name) and (wanted is None or wanted(entry["backend"], e_dtype)):
                return table.source, e_dtype, e_bucket, entry["backend"], entry.get("ratio")
    return None


def report(device_type: str | None = None) -> dict:
    """What ``graft info`` shows: each table (used, or why ignored) and, per op, which backend
    serves each shape bucket, how much faster it measured, and the table it came from."""
    try:
        found = tables(device_type)
    except GraftConfigError as exc:
        return {"error": str(exc), "tables": [], "ops": {}}
    ops: dict = {}
    seen: set = set()
    for table in found:
        if not table.used:
            continue
        for (op, dtype, bucket_key), entry in sorted(table.entries.items(), key=lambda kv: (
                kv[0][0], kv[0][1], without_tokens(kv[0][2]), _tokens_of(kv[0][2]))):
            if (op, dtype, bucket_key) in seen:  # an earlier table's entry wins
                continue
            seen.add((op, dtype, bucket_key))
            ops.setdefault(op, []).append({
                "dtype": dtype, "bucket": bucket_key, "backend": entry["backend"], "ratio": entry.get("ratio"),
                "median_us": entry.get("median_us", {}), "note": entry.get("note"), "table": table.source})
    return {
        "variable": TABLE_VAR,
        "batch_invariant": invariant(),
        "tables": [{"source": t.source, "used": t.used, "ignored": t.ignored, "entries": len(t.entries),
                    "device": t.device, "versions": t.versions} for t in found],
        "ops": ops,
    }


def describe(row: dict) -> str:
    """One table row as ``graft info`` prints it: "served by vllm (faster here by 1.31x)"; a
    row whose backend cannot serve here (``cannot_serve``) says so instead."""
    if row.get("cannot_serve"):
        return f"names {row['backend']}, which cannot serve here ({row['cannot_serve']}): the default order serves"
    ratio = row.get("ratio")
    if row.get("note"):
        how = row["note"]
    elif isinstance(ratio, (int, float)) and math.isfinite(ratio):
        others = [b for b in row.get("median_us", {}) if b != row["backend"]]
        than = f" than {others[0]}" if len(others) == 1 else ""
        how = (f"faster here by {ratio:.2f}x{than}" if ratio >= 1 else
               f"within {MARGIN:.0%} of {others[0] if others else 'the next'} ({ratio:.2f}x): the framework's own code kept")
    else:
        how = "the only candidate measured" if len(row.get("median_us", {})) <= 1 else "measured"
    return f"served by {row['backend']} ({how})"


def reset() -> None:
    _tables_cache.clear()
    _loaded.clear()
    _invariant.clear()
    _parameters.cache_clear()


def _on_reload(snapshot) -> None:
    _tables_cache.clear()
    _loaded.clear()
    _invariant.clear()


config.on_reload(_on_reload)
