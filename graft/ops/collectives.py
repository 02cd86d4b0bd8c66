"""Collectives: all-reduce, all-gather, reduce-scatter, a quantized all-gather, and
tensor-parallel GEMM + collective overlap, over ``torch.distributed`` process groups
(NCCL/RCCL on GPUs, gloo on the CPU).

Every op is functional (returns a new tensor, never writes its input) and takes a
``group`` argument (``None`` = the default world group, a ``ProcessGroup``, or a group
name). The references are the plain library collectives, so with no optimized
implementation (or ``GRAFT_DISABLE=collectives``) graft is exactly torch.distributed.

Validation (``GRAFT_COLLECTIVES_VALIDATE``, default on): before the collective, the ranks
exchange a small int64 metadata row (op, dtype, device type, the shapes that must agree)
with one all-gather of ``64 * world_size`` int64 values. A rank passing a wrong shape or
dtype then gets a :class:`GraftInputError` naming every rank's input on *every* rank,
instead of a hang or silent garbage. Cost: one extra small collective per call (about one
small-message latency: it roughly doubles the time of a tiny all-reduce). Turn it off
(``GRAFT_COLLECTIVES_VALIDATE=0``) in production once the call sites are known good;
local checks (tensor type, dtype, divisibility) still run.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from graft.cases import OpCase
from graft.config import declare_env_var, parse_bool
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.kernels.collectives._common import REDUCE_OPS, all_gather_single, reduce_scatter_single, resolve_group
from graft.registry import OpSpec

VALIDATE_VAR = declare_env_var(
    "GRAFT_COLLECTIVES_VALIDATE",
    "1 (default): ranks exchange shape/dtype metadata before each collective so a mismatch is a clear error, not a hang",
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_CODES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                torch.int32, torch.int64, torch.bool]
_DEVICE_CODES = ["cpu", "cuda", "xpu", "mps", "meta"]
META_LEN = 64
MAX_NDIM = 8
ANY = -1  # a dimension ranks may legitimately disagree on (e.g. a shard's K)


# --------------------------------------------------------------------------------------
# references: the plain library collectives / non-overlapped compute
# --------------------------------------------------------------------------------------
def _all_reduce_ref(x, group=None, op="sum"):
    out = x.contiguous().clone()
    dist.all_reduce(out, op=REDUCE_OPS[op], group=resolve_group(group))
    return out


def _all_gather_ref(x, group=None, sizes=None):
    pg = resolve_group(group)
    ws = dist.get_world_size(pg)
    x = x.contiguous()
    if sizes is None:
        out = x.new_empty((ws * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_single(out, x, group=pg)
        return out
    # Uneven shards: the library gathers equal sizes only, so pad each to the largest.
    biggest = max(sizes)
    padded = x.new_zeros((biggest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((ws * biggest,) + tuple(x.shape[1:]))
    all_gather_single(out, padded, group=pg)
    return torch.cat([out[r * biggest : r * biggest + n] for r, n in enumerate(sizes)])


def _reduce_scatter_ref(x, group=None, op="sum", sizes=None):
    pg = resolve_group(group)
    ws, rank = dist.get_world_size(pg), dist.get_rank(pg)
    x = x.contiguous()
    rest = tuple(x.shape[1:])
    if sizes is None:
        out = x.new_empty((x.shape[0] // ws,) + rest)
        reduce_scatter_single(out, x, op, group=pg)
        return out
    biggest = max(sizes)
    padded = x.new_zeros((ws * biggest,) + rest)
    start = 0
    for r, n in enumerate(sizes):
        padded[r * biggest : r * biggest + n] = x[start : start + n]
        start += n
    out = x.new_empty((biggest,) + rest)
    reduce_scatter_single(out, padded, op, group=pg)
    return out[: sizes[rank]].clone()


def _all_gather_quantized_ref(x, group=None, block_size=128):
    # The exact gather that the quantized implementations approximate (see
    # graft.kernels.collectives.quantized_gather for the error bound).
    return _all_gather_ref(x, group)


def _gemm_reduce_scatter_ref(a, b, group=None):
    return _reduce_scatter_ref(a @ b, group)


def _all_gather_gemm_ref(a, b, group=None):
    return _all_gather_ref(a, group) @ b


# --------------------------------------------------------------------------------------
# validation: local checks, then (optionally) a metadata exchange across the ranks
# --------------------------------------------------------------------------------------
def validation_enabled() -> bool:
    return parse_bool(VALIDATE_VAR, True)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Local:
    """What one rank knows about its own call: an error text, or the fields to compare."""

    def __init__(self, op: str):
        self.op = op
        self.error: str | None = None
        self.tensors: list = []  # (name, shape with ANY wildcards, tensor)
        self.extras: list = []  # (name, int) that must agree
        self.device = torch.device("cpu")

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = f"{self.op}: {message}"

    def tensor(self, name, t, shape=None, ndim=None):
        if not isinstance(t, torch.Tensor):
            self.fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            return False
        self.device = t.device
        if t.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(_dtype_name(d) for d in FLOAT_DTYPES)
            self.fail(f"{name} has dtype {_dtype_name(t.dtype)}; expected one of: {allowed}")
        if t.dim() > MAX_NDIM or (ndim is not None and t.dim() != ndim):
            want = f"{ndim}-D" if ndim is not None else f"at most {MAX_NDIM}-D"
            self.fail(f"{name} must be {want}, got shape {tuple(t.shape)}")
            return False
        self.tensors.append((name, tuple(shape if shape is not None else t.shape), t))
        return self.error is None


def _group_or_fail(local: _Local, group):
    if not dist.is_available() or not dist.is_initialized():
        raise GraftInputError(
            f"{local.op}: torch.distributed is not initialized; call torch.distributed.init_process_group first"
        )
    if group is not None and not isinstance(group, (str, dist.ProcessGroup)):
        local.fail(f"group must be None, a ProcessGroup or a group name, got {type(group).__name__}")
        return None, 1, 0
    try:
        pg = resolve_group(group)
        return pg, dist.get_world_size(pg), dist.get_rank(pg)
    except Exception as exc:  # unknown group name, or this rank is not a member
        raise GraftInputError(f"{local.op}: cannot use process group {group!r}: {exc}") from None


def _check_reduce_op(local: _Local, op) -> int:
    if op not in REDUCE_OPS:
        local.fail(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
        return -1
    return list(REDUCE_OPS).index(op)


def _check_sizes(local: _Local, sizes, ws: int) -> int:
    """Validate per-rank dim-0 sizes; returns a fingerprint every rank must share."""
    if sizes is None:
        return 0
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        local.fail(f"sizes must be a list of non-negative ints (one per rank), got {sizes!r}")
        return -1
    if len(sizes) != ws:
        local.fail(f"sizes has {len(sizes)} entries but the group has {ws} ranks")
        return -1
    return zlib.crc32(repr(list(sizes)).encode()) + 1


def _encode(local: _Local) -> list:
    row = [1 if local.error else 0, _OP_INDEX.get(local.op, -1)]
    if local.error is None:
        dtype = local.tensors[0][2].dtype if local.tensors else None
        row += [_DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1,
                _DEVICE_CODES.index(local.device.type) if local.device.type in _DEVICE_CODES else -1]
        row += [len(local.extras)] + [v for _, v in local.extras]
        row += [len(local.tensors)]
        for _, shape, t in local.tensors:
            row += [_DTYPE_CODES.index(t.dtype) if t.dtype in _DTYPE_CODES else -1, len(shape)] + list(shape)
    return row + [0] * (META_LEN - len(row))


def _describe(row: list, names: list, extra_names: list) -> str:
    if row[0]:
        return "rejected its own input (error below)"
    parts = [f"device {_DEVICE_CODES[row[3]] if 0 <= row[3] < len(_DEVICE_CODES) else '?'}"]
    i = 4
    n_extra = row[i]
    extras = row[i + 1 : i + 1 + n_extra]
    i += 1 + n_extra
    n_tensors = row[i]
    i += 1
    for k in range(n_tensors):
        tdtype, nd = row[i], row[i + 1]
        shape = row[i + 2 : i + 2 + nd]
        i += 2 + nd
        name = names[k] if k < len(names) else f"tensor{k}"
        dims = ", ".join("*" if d == ANY else str(d) for d in shape)
        tname = _dtype_name(_DTYPE_CODES[tdtype]) if 0 <= tdtype < len(_DTYPE_CODES) else "?"
        parts.append(f"{name} {tname} ({dims}{',' if nd == 1 else ''})")
    for name, value in zip(extra_names, extras):
        parts.append(f"{name}={_decode_extra(name, value)}")
    return ", ".join(parts)


def _decode_extra(name: str, value: int):
    if name == "op":
        return list(REDUCE_OPS)[value] if 0 <= value < len(REDUCE_OPS) else "?"
    if name == "sizes":
        return "none" if value == 0 else f"#{value:x}"
    return value


def _agree(local: _Local, pg, ws: int, rank: int) -> None:
    """Raise the local error, or the ranks' disagreement, on every rank alike."""
    if pg is None or ws == 1 or not validation_enabled():
        if local.error:
            raise GraftInputError(local.error)
        return
    device = local.device if local.device.type != "meta" else torch.device("cpu")
    if "nccl" in str(dist.get_backend(pg)).lower() and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(_encode(local), dtype=torch.int64, device=device)
    table = torch.empty(ws * META_LEN, dtype=torch.int64, device=device)
    all_gather_single(table, mine, group=pg)
    rows = table.view(ws, META_LEN).cpu().tolist()
    errors = [r for r in range(ws) if rows[r][0]]
    mismatch = any(rows[r] != rows[0] for r in range(ws))
    if not errors and not mismatch:
        return
    names = [n for n, _, _ in local.tensors] or _TENSOR_NAMES.get(local.op, [])
    extra_names = [n for n, _ in local.extras]
    lines = []
    if any(rows[r][1] != rows[0][1] for r in range(ws)):
        ops = ", ".join(f"rank {r}: {_OP_NAMES[rows[r][1]] if 0 <= rows[r][1] < len(_OP_NAMES) else '?'}"
                        for r in range(ws))
        lines.append(f"ranks called different collectives ({ops})")
    else:
        for r in range(ws):
            lines.append(f"  rank {r}: {_describe(rows[r], names, extra_names)}")
    if errors:
        # Only on this error path: fetch the rejecting ranks' messages (all ranks take part).
        texts = [None] * ws
        dist.all_gather_object(texts, local.error, group=pg)
        lines += [f"  rank {r} error: {texts[r]}" for r in errors]
    head = (f"{local.op}: rank(s) {', '.join(map(str, errors))} rejected their input"
            if errors else f"{local.op}: the ranks passed inputs that disagree (this is rank {rank})")
    raise GraftInputError(
        head + ":\n" + "\n".join(lines)
        + "\nEvery rank must pass the same dtype and the same shape (dims shown as * may differ)."
    )


def _validate_all_reduce(x, group=None, op="sum"):
    local = _Local("collectives.all_reduce")
    pg, ws, rank = _group_or_fail(local, group)
    local.extras.append(("op", _check_reduce_op(local, op)))
    local.tensor("x", x)
    _agree(local, pg, ws, rank)


def _validate_all_gather(x, group=None, sizes=None, _op="collectives.all_gather"):
    local = _Local(_op)
    pg, ws, rank = _group_or_fail(local, group)
    local.extras.append(("sizes", _check_sizes(local, sizes, ws)))
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        local.fail("x must have at least one dimension (gathered along dim 0)")
    elif isinstance(x, torch.Tensor) and sizes is not None and local.error is None and x.shape[0] != sizes[rank]:
        local.fail(f"x has {x.shape[0]} rows on rank {rank} but sizes[{rank}] = {sizes[rank]}")
    shape = None
    if isinstance(x, torch.Tensor) and x.dim() > 0 and sizes is not None:
        shape = (ANY,) + tuple(x.shape[1:])
    local.tensor("x", x, shape=shape)
    _agree(local, pg, ws, rank)


def _validate_reduce_scatter(x, group=None, op="sum", sizes=None):
    local = _Local("collectives.reduce_scatter")
    pg, ws, rank = _group_or_fail(local, group)
    local.extras.append(("op", _check_reduce_op(local, op)))
    local.extras.append(("sizes", _check_sizes(local, sizes, ws)))
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            local.fail("x must have at least one dimension (scattered along dim 0)")
        elif sizes is None and x.shape[0] % ws:
            local.fail(f"x has {x.shape[0]} rows, not divisible by the world size {ws}; pass sizes=[...] "
                       "for an uneven split")
        elif sizes is not None and local.error is None and sum(sizes) != x.shape[0]:
            local.fail(f"sizes sum to {sum(sizes)} but x has {x.shape[0]} rows")
    local.tensor("x", x)
    _agree(local, pg, ws, rank)


def _validate_all_gather_quantized(x, group=None, block_size=128):
    local = _Local("collectives.all_gather_quantized")
    pg, ws, rank = _group_or_fail(local, group)
    if not isinstance(block_size, int) or block_size < 1:
        local.fail(f"block_size must be a positive int, got {block_size!r}")
        block_size = -1
    local.extras.append(("block_size", block_size))
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        local.fail("x must have at least one dimension (gathered along dim 0)")
    local.tensor("x", x)
    _agree(local, pg, ws, rank)


def _validate_gemm_pair(op_name, a, b, group, gather: bool):
    local = _Local(op_name)
    pg, ws, rank = _group_or_fail(local, group)
    ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2
    if ok and a.shape[1] != b.shape[0]:
        local.fail(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a.shape[1] must equal b.shape[0]")
    if ok and a.dtype != b.dtype:
        local.fail(f"a is {_dtype_name(a.dtype)} but b is {_dtype_name(b.dtype)}; they must share a dtype")
    if ok and a.device != b.device:
        local.fail(f"a is on {a.device} but b on {b.device}")
    if ok and not gather and a.shape[0] % ws:
        local.fail(f"a has {a.shape[0]} rows, not divisible by the world size {ws}")
    if gather:  # [M_local, K] gathered; b [K, N_local]: N_local may differ per rank
        a_shape = b_shape = None
        if ok:
            b_shape = (b.shape[0], ANY)
        local.tensor("a", a, ndim=2, shape=a_shape) and local.tensor("b", b, ndim=2, shape=b_shape)
    else:  # a [M, K_local] @ b [K_local, N], reduce-scattered over M: K_local may differ
        a_shape = (a.shape[0], ANY) if ok else None
        b_shape = (ANY, b.shape[1]) if ok else None
        local.tensor("a", a, ndim=2, shape=a_shape) and local.tensor("b", b, ndim=2, shape=b_shape)
    _agree(local, pg, ws, rank)


def _validate_gemm_reduce_scatter(a, b, group=None):
    _validate_gemm_pair("collectives.gemm_reduce_scatter", a, b, group, gather=False)


def _validate_all_gather_gemm(a, b, group=None):
    _validate_gemm_pair("collectives.all_gather_gemm", a, b, group, gather=True)


OPS = [
    OpSpec(
        name="collectives.all_reduce",
        family="collectives",
        signature="all_reduce(x: Tensor[...], group=None, op: str = 'sum') -> Tensor[...]",
        reference=_all_reduce_ref,
        validate=_validate_all_reduce,
        description="out-of-place all-reduce (sum/max/min) over a process group",
    ),
    OpSpec(
        name="collectives.all_gather",
        family="collectives",
        signature="all_gather(x: Tensor[m, ...], group=None, sizes: list[int] | None = None) -> Tensor[sum(m), ...]",
        reference=_all_gather_ref,
        validate=_validate_all_gather,
        description="gather every rank's x along dim 0 (sizes: uneven per-rank row counts)",
    ),
    OpSpec(
        name="collectives.reduce_scatter",
        family="collectives",
        signature="reduce_scatter(x: Tensor[m, ...], group=None, op='sum', sizes=None) -> Tensor[m/world, ...]",
        reference=_reduce_scatter_ref,
        validate=_validate_reduce_scatter,
        description="reduce across ranks, rank r keeps row block r (sizes: uneven blocks)",
    ),
    OpSpec(
        name="collectives.all_gather_quantized",
        family="collectives",
        signature="all_gather_quantized(x: Tensor[m, ...], group=None, block_size: int = 128) -> Tensor[world*m, ...]",
        reference=_all_gather_quantized_ref,
        validate=_validate_all_gather_quantized,
        description="all-gather that may send int8 + per-block fp32 scales (lossy, bounded; ZeRO-style param gather)",
    ),
    OpSpec(
        name="collectives.gemm_reduce_scatter",
        family="collectives",
        signature="gemm_reduce_scatter(a: Tensor[m, k_local], b: Tensor[k_local, n], group=None) -> Tensor[m/world, n]",
        reference=_gemm_reduce_scatter_ref,
        validate=_validate_gemm_reduce_scatter,
        description="row-parallel linear: local GEMM then reduce-scatter of the partial sums",
    ),
    OpSpec(
        name="collectives.all_gather_gemm",
        family="collectives",
        signature="all_gather_gemm(a: Tensor[m_local, k], b: Tensor[k, n_local], group=None) -> Tensor[world*m_local, n_local]",
        reference=_all_gather_gemm_ref,
        validate=_validate_all_gather_gemm,
        description="column-parallel linear on sequence-parallel input: all-gather rows of a, then GEMM",
    ),
]
_OP_NAMES = [spec.name for spec in OPS]
_OP_INDEX = {name: i for i, name in enumerate(_OP_NAMES)}
_TENSOR_NAMES = {"collectives.gemm_reduce_scatter": ["a", "b"], "collectives.all_gather_gemm": ["a", "b"]}


# --------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------
def all_reduce(x, group=None, op: str = "sum"):
    """Sum (or max/min) ``x`` over the ranks of ``group``; returns a new tensor."""
    return call("collectives.all_reduce", x, group, op)


def all_gather(x, group=None, sizes=None):
    """Concatenate every rank's ``x`` along dim 0; ``sizes`` allows uneven row counts."""
    return call("collectives.all_gather", x, group, sizes)


def reduce_scatter(x, group=None, op: str = "sum", sizes=None):
    """Reduce ``x`` over the ranks; rank r returns row block r (``sizes`` for uneven blocks)."""
    return call("collectives.reduce_scatter", x, group, op, sizes)


def all_gather_quantized(x, group=None, block_size: int = 128):
    """All-gather that may travel as int8 with one fp32 scale per ``block_size`` values (lossy)."""
    return call("collectives.all_gather_quantized", x, group, block_size)


def gemm_reduce_scatter(a, b, group=None):
    """``reduce_scatter(a @ b)`` over dim 0 (row-parallel linear), possibly overlapped."""
    return call("collectives.gemm_reduce_scatter", a, b, group)


def all_gather_gemm(a, b, group=None):
    """``all_gather(a) @ b`` (column-parallel linear on sequence-parallel input), possibly overlapped."""
    return call("collectives.all_gather_gemm", a, b, group)


# --------------------------------------------------------------------------------------
# cases: run inside a process group (graft's conformance runs them per rank; inputs
# depend on the rank so the reduction is not trivially world_size * x)
# --------------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rand(shape, device, dtype, gen, rank_salt=True):
    if rank_salt:
        for _ in range(_rank()):
            torch.rand(1, generator=gen)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _ar_case(name, shape, op="sum", tags=("quick",)):
    return OpCase("collectives.all_reduce", name,
                  lambda device, dtype, gen: ((_rand(shape, device, dtype, gen), None, op), {}),
                  tags=frozenset(tags))


CASES = [
    _ar_case("n1", (1,)),
    _ar_case("n1023", (1023,)),
    _ar_case("m7_n33_max", (7, 33), op="max"),
    _ar_case("n4m", (4 * 1024 * 1024,), tags=("gpu",)),
    OpCase("collectives.all_gather", "m5_n17",
           lambda device, dtype, gen: ((_rand((5, 17), device, dtype, gen), None, None), {})),
    OpCase("collectives.reduce_scatter", "m_world_x6_n9",
           lambda device, dtype, gen: ((_rand((6 * _world(), 9), device, dtype, gen), None, "sum", None), {})),
    OpCase("collectives.all_gather_quantized", "m3_n200",
           lambda device, dtype, gen: ((_rand((3, 200), device, dtype, gen), None, 64), {})),
    OpCase("collectives.gemm_reduce_scatter", "m_world_x8_k24_n20",
           lambda device, dtype, gen: ((_rand((8 * _world(), 24), device, dtype, gen),
                                        _rand((24, 20), device, dtype, gen, False), None), {})),
    OpCase("collectives.all_gather_gemm", "m9_k24_n20",
           lambda device, dtype, gen: ((_rand((9, 24), device, dtype, gen),
                                        _rand((24, 20), device, dtype, gen, False), None), {})),
]
