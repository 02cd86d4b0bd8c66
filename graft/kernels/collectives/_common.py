"""What every collectives implementation needs: process groups by name, reduce ops,
the collectives settings (read once per configuration generation), library calls that
honour graft's collective timeout, and flat padding helpers.

Custom ops cannot carry a ``ProcessGroup`` object through a ``torch.library`` schema,
so every graft collective custom op takes the group's *name* (``group.group_name``)
and resolves it here with torch's own registry of process groups.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from graft import settings as settings_table
from graft.errors import GraftCollectiveError, GraftConfigError

log = logging.getLogger("graft.collectives")

# Declared (type, default, bounds, doc) in graft.settings, read through graft's snapshot.
ONESHOT_MAX_BYTES_VAR = "GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES"
TWOSHOT_MAX_BYTES_VAR = "GRAFT_TWOSHOT_ALLREDUCE_MAX_BYTES"
MAX_WORLD_VAR = "GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD"
OVERLAP_CHUNKS_VAR = "GRAFT_OVERLAP_CHUNKS"
OVERLAP_MIN_BYTES_VAR = "GRAFT_OVERLAP_MIN_BYTES"
QUANT_MIN_BYTES_VAR = "GRAFT_QUANTIZED_GATHER_MIN_BYTES"
VALIDATE_VAR = "GRAFT_COLLECTIVES_VALIDATE"
TIMEOUT_VAR = "GRAFT_COLLECTIVES_TIMEOUT"

_default = lambda name: settings_table.setting(name).default  # noqa: E731
DEFAULT_ONESHOT_MAX_BYTES = _default(ONESHOT_MAX_BYTES_VAR)
DEFAULT_TWOSHOT_MAX_BYTES = _default(TWOSHOT_MAX_BYTES_VAR)
DEFAULT_MAX_WORLD = _default(MAX_WORLD_VAR)
DEFAULT_OVERLAP_CHUNKS = _default(OVERLAP_CHUNKS_VAR)
DEFAULT_OVERLAP_MIN_BYTES = _default(OVERLAP_MIN_BYTES_VAR)
DEFAULT_QUANT_MIN_BYTES = _default(QUANT_MIN_BYTES_VAR)

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
VALIDATE_MODES = ("signature", "always")


def _validate_mode(environ) -> str:
    raw = settings_table.raw(VALIDATE_VAR, environ)
    value = (raw or "").strip().lower()
    if value in ("", "1", "true", "yes", "on", "signature"):
        return "signature"
    if value == "always":
        return "always"
    if value in ("0", "false", "no", "off"):
        # The first-use agreement is what turns a mismatch into an error instead of a
        # gloo abort or uninitialised memory: it cannot be switched off (it costs nothing
        # after the first call of a signature). Only the per-call exchange is optional.
        log.info("%s=%s: the per-call exchange is off (the default); ranks still agree once per signature",
                 VALIDATE_VAR, raw)
        return "signature"
    raise GraftConfigError(f"{VALIDATE_VAR}={raw!r} is not valid; use 'signature' (default, also 1) or 'always'")


def _timeout(environ) -> float | None:
    raw = settings_table.raw(TIMEOUT_VAR, environ)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw.strip().lower().rstrip("s"))
    except ValueError:
        value = float("nan")
    if not (0 < value < 1e7):  # also rejects nan and inf
        raise GraftConfigError(f"{TIMEOUT_VAR}={raw!r} must be a number of seconds > 0 (e.g. 300)")
    return value


@dataclass(frozen=True)
class Settings:
    """The GRAFT_* variables of the collectives, parsed once per configuration generation.

    Every field must be the same on every rank of a group: the agreement compares them
    (``fingerprint``) so that ranks configured differently fail clearly instead of
    running different algorithms against each other (a hang).
    """

    validate: str = "signature"
    timeout_s: float | None = None
    oneshot_max_bytes: int = DEFAULT_ONESHOT_MAX_BYTES
    twoshot_max_bytes: int = DEFAULT_TWOSHOT_MAX_BYTES
    max_world: int = DEFAULT_MAX_WORLD
    overlap_chunks: int = DEFAULT_OVERLAP_CHUNKS
    overlap_min_bytes: int = DEFAULT_OVERLAP_MIN_BYTES
    quantized_min_bytes: int = DEFAULT_QUANT_MIN_BYTES

    def fingerprint(self) -> dict:
        return asdict(self)


def read_settings(environ=None) -> Settings:
    """Parse the collectives variables now (``settings()`` is the cached view)."""
    env = os.environ if environ is None else environ
    get = settings_table.get
    return Settings(
        validate=_validate_mode(env),
        timeout_s=_timeout(env),
        oneshot_max_bytes=get(ONESHOT_MAX_BYTES_VAR, env),
        twoshot_max_bytes=get(TWOSHOT_MAX_BYTES_VAR, env),
        max_world=get(MAX_WORLD_VAR, env),
        overlap_chunks=get(OVERLAP_CHUNKS_VAR, env),
        overlap_min_bytes=get(OVERLAP_MIN_BYTES_VAR, env),
        quantized_min_bytes=get(QUANT_MIN_BYTES_VAR, env),
    )


def generation():
    """graft's configuration generation (``graft.config.current()``: a new snapshot after
    ``graft.reload_config()``, ``graft.override_config()`` or ``plugins.reset()``): the
    collectives settings and plans are read again then. Cheap: a module attribute."""
    from graft import config

    return config._snapshot or config.current()


_settings: tuple = (None, None)  # (generation, Settings)


def settings() -> Settings:
    global _settings
    gen = generation()
    cached_gen, value = _settings
    if cached_gen is not gen:
        value = read_settings(gen)  # the snapshot graft read, not os.environ now
        _settings = (gen, value)
    return value


def oneshot_max_bytes() -> int:
    return settings().oneshot_max_bytes


def twoshot_max_bytes() -> int:
    return settings().twoshot_max_bytes


def max_world() -> int:
    return settings().max_world


def overlap_chunks() -> int:
    return settings().overlap_chunks


def overlap_min_bytes() -> int:
    return settings().overlap_min_bytes


def quantized_min_bytes() -> int:
    return settings().quantized_min_bytes


def resolve_group(group=None):
    """A ProcessGroup from None (world), a ProcessGroup, or a group name."""
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group if group is not None else dist.group.WORLD


def group_name(group=None) -> str:
    return resolve_group(group).group_name


def world_size(group=None) -> int:
    return dist.get_world_size(resolve_group(group))


def group_rank(group=None) -> int:
    return dist.get_rank(resolve_group(group))


def backend_name(group=None) -> str:
    return str(dist.get_backend(resolve_group(group))).lower()


def group_timeout(pg) -> float | None:
    """The process group's own timeout in seconds (None if torch does not say)."""
    try:
        device = torch.device("cuda" if "nccl" in backend_name(pg) else "cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # private API: absent on some builds/backends
        return None


def timeout_seconds(pg) -> float | None:
    """GRAFT_COLLECTIVES_TIMEOUT if set, else the process group's timeout."""
    return settings().timeout_s or group_timeout(pg)


def describe_group(pg) -> str:
    try:
        ranks = dist.get_process_group_ranks(pg)
    except Exception:
        ranks = list(range(dist.get_world_size(pg)))
    return f"group {pg.group_name!r} (global ranks {', '.join(map(str, ranks))}; this is rank {dist.get_rank()})"


def collective_error(op: str, pg, exc: BaseException) -> GraftCollectiveError:
    """The error every live rank raises when a collective does not complete."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timeout = timeout_seconds(pg)
    limit = (f"{timeout:g} s ({TIMEOUT_VAR})" if settings().timeout_s else
             f"the process group's timeout ({timeout:g} s)" if timeout else "the process group's timeout")
    if "timed out" in text.lower() or "timeout" in text.lower():
        head = (f"{op} on {describe_group(pg)} did not complete within {limit}: a rank of the group did not "
                "call it (it skipped the call, called another collective, or is stuck or gone)")
    else:
        head = f"{op} on {describe_group(pg)} failed: a peer left the group or the transport failed"
    from .agreement import pending_peer_calls  # failure path only: no cost on the per-call path

    pending = pending_peer_calls(pg)
    if pending:  # a peer is in an agreement on a new signature while this rank ran an agreed one
        head += f"; {pending} (this rank called {op} with a signature agreed earlier)"
    return GraftCollectiveError(f"{head} [{type(exc).__name__}: {text}]")


def wait(work, pg=None) -> None:
    """``work.wait()`` bounded by GRAFT_COLLECTIVES_TIMEOUT when that is set."""
    timeout = settings().timeout_s
    if timeout is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout))


class Work:
    """The handle of an ``async_op=True`` graft collective: wraps the library's work so
    that ``wait()`` honours graft's timeout and fails with graft's error (op, group and
    ranks named), and runs the finishing step of multi-step algorithms (``finish``)."""

    __slots__ = ("_work", "_op", "_pg", "_finish", "_done")

    def __init__(self, work, op: str, pg, finish=None):
        self._work, self._op, self._pg, self._finish, self._done = work, op, pg, finish, False

    def wait(self, timeout=None) -> bool:
        if self._done:
            return True
        try:
            if self._work is not None:
                if timeout is not None:
                    self._work.wait(timeout)
                else:
                    wait(self._work, self._pg)
        except RuntimeError as exc:
            raise collective_error(self._op, self._pg, exc) from exc
        if self._finish is not None:
            self._finish()
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self._finish is None and (self._work is None or self._work.is_completed()))

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self):
        return self._work.get_future() if self._work is not None and self._finish is None else None

    def synchronize(self) -> None:
        self.wait()


def message_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def padded_flat(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, int]:
    """``x`` flattened and zero-padded to a multiple of ``parts``; returns (flat, chunk length)."""
    flat = x.reshape(-1)
    chunk = -(-flat.numel() // parts) if flat.numel() else 0
    pad = chunk * parts - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.contiguous(), chunk


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision inputs accumulate in fp32 (rounded once at the end)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def reduce_rows(rows: torch.Tensor, reduce_op: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Reduce ``rows[0], rows[1], ...`` in that fixed rank order.

    An explicit left-to-right loop (not ``rows.sum(0)``, whose order is the kernel's
    business) makes the result independent of the algorithm that delivered the rows,
    so one-shot and two-shot agree bit for bit, and every rank gets the same bits.
    """
    if reduce_op == "sum":
        acc = rows[0].to(accumulate_dtype(rows.dtype), copy=True)
        for r in range(1, rows.shape[0]):
            acc.add_(rows[r])
        return acc.to(out_dtype)
    fn = torch.maximum if reduce_op == "max" else torch.minimum
    acc = rows[0]
    for r in range(1, rows.shape[0]):
        acc = fn(acc, rows[r])
    return acc.to(out_dtype)


# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older
# torch only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Blocking library calls inside graft's algorithms go through async handles when a graft
# timeout is set, so that GRAFT_COLLECTIVES_TIMEOUT bounds them (wait(timeout)).
def _blocking(work_or_none, pg, async_op):
    if async_op or work_or_none is None:
        return work_or_none
    wait(work_or_none, pg)
    return None


def all_gather_single(output, input, group=None, async_op=False):
    """Gather every rank's ``input`` (same shape on all) into ``output`` (world_size x larger)."""
    bounded = async_op or settings().timeout_s is not None
    return _blocking(_all_gather_single(output, input, group=group, async_op=bounded), group, async_op)


def reduce_scatter_single(output, input, op="sum", group=None, async_op=False):
    """Reduce ``input`` over the ranks; rank r receives block r into ``output``."""
    bounded = async_op or settings().timeout_s is not None
    return _blocking(_reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=group, async_op=bounded),
                     group, async_op)


def all_reduce_inplace(tensor, op="sum", group=None, async_op=False):
    bounded = async_op or settings().timeout_s is not None
    return _blocking(dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=bounded), group, async_op)


def all_to_all_single(output, input, group=None, async_op=False):
    bounded = async_op or settings().timeout_s is not None
    return _blocking(dist.all_to_all_single(output, input, group=group, async_op=bounded), group, async_op)
