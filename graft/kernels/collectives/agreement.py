"""Cross-rank agreement: the ranks of a group check, before a collective runs, that they are
about to run the *same* collective (op, dtype, device, shapes, arguments), with the same
algorithm and the same collectives settings.

Why: a collective whose ranks disagree does not fail cleanly. On gloo, two ranks reducing
tensors of different lengths abort one process (SIGABRT) and leave uninitialised memory in
the other's output; ranks that picked different algorithms (one-shot here, the library
ring there) wait for each other forever. The agreement turns each of those into a
:class:`GraftInputError` naming every rank's call, raised on every rank.

When: once per *signature* (group, op, dtypes, shapes, arguments, selected algorithm and
settings) by default: the first call of a signature pays one exchange, later calls a dict
lookup. ``GRAFT_COLLECTIVES_VALIDATE=always`` exchanges before every call (it also catches
ranks that disagree on signatures each has already agreed on, e.g. rank 0 calls shape A
while rank 1 calls shape B after both were used before; the default cannot, since no
rank talks to the others on the hot path).

How: through the process group's key-value store (the one torch uses for rendezvous),
not through a collective. A store exchange can never be mistaken for a data collective
by a peer that is running one (which, on gloo, is what aborts a process), it names the
ranks that did not arrive, and it is bounded by graft's collective timeout
(``GRAFT_COLLECTIVES_TIMEOUT``, default the process group's timeout). Each rank writes one
JSON row per agreement and reads its peers' rows; rows of the previous agreement are
deleted once every rank has moved past it.
"""
from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from graft.errors import GraftCollectiveError, GraftInputError, GraftUnsupportedError
from graft.platform import dtype_name

from ._common import TIMEOUT_VAR, describe_group, settings, timeout_seconds

ANY = -1  # a dimension ranks may legitimately disagree on (e.g. a shard's K)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NDIM = 8
_DEFAULT_TIMEOUT_S = 1800.0  # torch's own default, when a group does not say

# Env var of each settings field, to name them in a disagreement.
_SETTING_VARS = {
    "validate": "GRAFT_COLLECTIVES_VALIDATE",
    "timeout_s": TIMEOUT_VAR,
    "oneshot_max_bytes": "GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES",
    "twoshot_max_bytes": "GRAFT_TWOSHOT_ALLREDUCE_MAX_BYTES",
    "max_world": "GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD",
    "overlap_chunks": "GRAFT_OVERLAP_CHUNKS",
    "overlap_min_bytes": "GRAFT_OVERLAP_MIN_BYTES",
    "quantized_min_bytes": "GRAFT_QUANTIZED_GATHER_MIN_BYTES",
}


class Call:
    """What one rank knows about its own call: an error text, or the fields to compare."""

    def __init__(self, op: str):
        self.op = op
        self.error: str | None = None
        self.tensors: list = []  # (name, dtype name, shape with ANY wildcards)
        self.extras: list = []  # (name, JSON-able value) that must agree
        self.device = "cpu"

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = f"{self.op}: {message}"

    def tensor(self, name, t, shape=None, ndim=None) -> bool:
        if not isinstance(t, torch.Tensor):
            self.fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            return False
        self.device = t.device.type
        if t.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(dtype_name(d) for d in FLOAT_DTYPES)
            self.fail(f"{name} has dtype {dtype_name(t.dtype)}; expected one of: {allowed}")
        if t.dim() > MAX_NDIM or (ndim is not None and t.dim() != ndim):
            want = f"{ndim}-D" if ndim is not None else f"at most {MAX_NDIM}-D"
            self.fail(f"{name} must be {want}, got shape {tuple(t.shape)}")
            return False
        self.tensors.append((name, dtype_name(t.dtype), list(shape if shape is not None else t.shape)))
        return self.error is None

    def row(self, backend: str | None) -> dict:
        return {"op": self.op, "error": self.error, "device": self.device, "tensors": self.tensors,
                "extras": self.extras, "backend": backend, "settings": settings().fingerprint()}


# ----------------------------------------------------------------------------- the exchange
_seq: dict = {}  # process group -> number of agreements this rank has run on it
_agreed: set = set()  # (process group, row as JSON) this rank has agreed on with its peers


def _store(pg):
    try:
        return dist.distributed_c10d._world.pg_map[pg][1]
    except Exception:  # private API moved: fall back to a collective exchange
        return None


def _exchange(pg, ws: int, rank: int, text: str, op: str) -> list:
    """Every rank's row (rank order); raises GraftCollectiveError naming absent ranks."""
    store = _store(pg)
    if store is None:
        rows = [None] * ws
        dist.all_gather_object(rows, text, group=pg)
        return rows
    seq = _seq.get(pg, 0)
    _seq[pg] = seq + 1
    keys = [f"graft/agree/{seq}/{r}" for r in range(ws)]
    store.set(keys[rank], text)
    timeout = timeout_seconds(pg) or _DEFAULT_TIMEOUT_S
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # DistStoreError (a timeout), or the store went away
        try:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        except Exception:
            missing = []
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "a rank"
        limit = f"{timeout:g} s" + (f" ({TIMEOUT_VAR})" if settings().timeout_s else " (the process group's timeout)")
        try:
            mine = f"{op}: {_describe(json.loads(text))}"
        except Exception:
            mine = op
        raise GraftCollectiveError(
            f"{op} on {describe_group(pg)}: {who} did not reach this call ({mine}) within {limit}: they skipped "
            "it, called another collective, or called a signature they had agreed on before (a per-call "
            "mismatch only GRAFT_COLLECTIVES_VALIDATE=always checks) "
            f"[{type(exc).__name__}: {str(exc).strip()[:200]}]"
        ) from None
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    if seq:  # every peer has written row `seq`, so all of them have read row `seq - 1`
        try:
            store.delete_key(f"graft/agree/{seq - 1}/{rank}")
        except Exception:
            pass
    return [v.decode() if isinstance(v, (bytes, bytearray)) else str(v) for v in values]


def pending_peer_calls(pg) -> str:
    """Failure path only (a collective timed out): the calls peers are waiting to agree on
    that this rank never joined, read from the store without waiting; "" if none."""
    store = _store(pg)
    if store is None:
        return ""
    try:
        ws, rank = dist.get_world_size(pg), dist.get_rank(pg)
        seq = _seq.get(pg, 0)
        lines = []
        for r in range(ws):
            key = f"graft/agree/{seq}/{r}"
            if r != rank and store.check([key]):
                value = store.get(key)
                row = json.loads(value.decode() if isinstance(value, (bytes, bytearray)) else value)
                lines.append(f"rank {r} is waiting to agree on {row['op']}: {_describe(row)}")
    except Exception:  # best effort: the store may be gone with the peer
        return ""
    return "; ".join(lines)


def agree(call: Call, pg, ws: int, rank: int, args: tuple, kwargs: dict | None = None) -> None:
    """Raise the local error, or the ranks' disagreement, on every rank alike; return when
    all ranks run the same call with the same algorithm and settings."""
    backend = None
    if call.error is None:
        from graft.dispatch import select

        try:
            backend = select(call.op, *args, **(kwargs or {})).backend
        except GraftUnsupportedError as exc:  # e.g. GRAFT_STRICT=1 and the requested algorithm can't serve
            call.error = f"{call.op}: {exc}"
    if pg is None or ws == 1:
        if call.error:
            raise GraftInputError(call.error)
        return
    text = json.dumps(call.row(backend), sort_keys=True)
    always = settings().validate == "always"
    if not always and call.error is None and (pg, text) in _agreed:
        return
    rows = [json.loads(t) for t in _exchange(pg, ws, rank, text, call.op)]
    problem = _disagreement(rows, rank)
    if problem is None:
        if not always:
            _agreed.add((pg, text))
        return
    raise GraftInputError(problem)


# ----------------------------------------------------------------------------- the message
def _describe(row: dict) -> str:
    if row["error"]:
        return "rejected its own input (error below)"
    parts = [f"device {row['device']}"]
    for name, dtype, shape in row["tensors"]:
        dims = ", ".join("*" if d == ANY else str(d) for d in shape)
        parts.append(f"{name} {dtype} ({dims}{',' if len(shape) == 1 else ''})")
    parts += [f"{name}={'none' if value is None else value}" for name, value in row["extras"]]
    return ", ".join(parts)


def _disagreement(rows: list, rank: int) -> str | None:
    ws = len(rows)
    op = rows[rank]["op"]
    errors = [r for r in range(ws) if rows[r]["error"]]
    if len({row["op"] for row in rows}) > 1:
        ops = ", ".join(f"rank {r}: {rows[r]['op']}" for r in range(ws))
        return f"{op}: ranks called different collectives ({ops})"
    if errors:
        lines = [f"  rank {r}: {_describe(rows[r])}" for r in range(ws)]
        lines += [f"  rank {r} error: {rows[r]['error']}" for r in errors]
        return f"{op}: rank(s) {', '.join(map(str, errors))} rejected their input:\n" + "\n".join(lines)
    fields = ("device", "tensors", "extras")
    if any(row[f] != rows[0][f] for row in rows for f in fields):
        lines = [f"  rank {r}: {_describe(rows[r])}" for r in range(ws)]
        return (f"{op}: the ranks passed inputs that disagree (this is rank {rank}):\n" + "\n".join(lines)
                + "\nEvery rank must pass the same dtype and the same shape (dims shown as * may differ).")
    if any(row["settings"] != rows[0]["settings"] for row in rows):
        lines = []
        for field, var in _SETTING_VARS.items():
            values = [row["settings"].get(field) for row in rows]
            if len({json.dumps(v) for v in values}) > 1:
                lines.append(f"  {var}: " + ", ".join(f"rank {r}: {values[r]}" for r in range(ws)))
        return (f"{op}: the ranks run with different collectives settings (this is rank {rank}):\n"
                + "\n".join(lines) + "\nSet the same GRAFT_* collectives variables on every rank.")
    if any(row["backend"] != rows[0]["backend"] for row in rows):
        chosen = ", ".join(f"rank {r}: {rows[r]['backend']}" for r in range(ws))
        return (f"{op}: the ranks selected different algorithms ({chosen}; this is rank {rank}); set the same "
                "GRAFT_BACKENDS / GRAFT_COLLECTIVES* / GRAFT_DISABLE on every rank")
    return None


def reset() -> None:
    """Forget agreed signatures (tests; a new process group starts its own sequence)."""
    _agreed.clear()
