"""Triton Adam/AdamW step (``fused.adam_step``): one elementwise pass per tensor.

Each element's param, grad and both moments are read once, updated in fp32 and written
once (rounded to each output's dtype), instead of the half-dozen passes the torch
reference makes. The op takes one tensor per call, so a multi-tensor optimizer
(DeepSpeed's ``multi_tensor_adam``) is one launch per tensor.

The op is functional: results go to fresh buffers and the inputs are never written,
so the custom op needs no ``mutates_args``. Optimizers step a parameter group in place:
:func:`adam_step_multi_` (``adam_step.multi_tensor_``, which ``graft.ops.fused.adam_step_``
uses) updates every contiguous tensor of a group in place in ONE launch per dtype
combination: a table of the tensors' addresses and sizes (built once per group and kept
while the tensors stay the same) and a block -> (tensor, offset) map drive one grid. Scalars that depend only on the step (the
bias corrections) are computed once on the host in double precision, as the reference
does, and passed in as fp32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graft.custom_ops import define_op
from graft.kernels.triton._autotune import tile_config, tile_table
from graft.kernels.triton._aot import per_target, variant
from graft.kernels.triton._common import on_device, triton_implementation
from graft.platform import triton_interpret

OP = "fused.adam_step"

# A streaming kernel: a few wide tiles per program keep the loads in flight.
# Rows per generation in tiles/<generation>.json ("fused_adam_step"), loaded once.
TILES = tile_table("fused_adam_step")


@triton.jit
def _rounded_for_bf16(x):
    """x (fp32) rounded to bf16's 8-bit mantissa, to nearest-even, still as fp32.

    Only for the interpreter, whose fp32->bf16 cast truncates (GPUs round to nearest-even
    in hardware): a truncating cast of this value is then exact. NaNs pass unchanged.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _store(ptr, offs, x, mask, INTERPRET: tl.constexpr):
    if INTERPRET and ptr.dtype.element_ty == tl.bfloat16:
        x = _rounded_for_bf16(x)
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_math(p, g, m, v, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
               bias_correction1, sqrt_bias_correction2, ADAM_W: tl.constexpr, HAS_DECAY: tl.constexpr):
    """One Adam/AdamW update in fp32: the new (p, m, v)."""
    if HAS_DECAY and not ADAM_W:  # Adam with L2: the decay joins the gradient
        g = g + weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    update = (m / bias_correction1) / (tl.sqrt(v) / sqrt_bias_correction2 + eps)
    if HAS_DECAY and ADAM_W:  # AdamW: decoupled decay on the parameter itself
        update = update + weight_decay * p
    return p - lr * update, m, v


@triton.jit
def _adam_step_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, p_out_ptr, m_out_ptr, v_out_ptr,
    n, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
    bias_correction1, sqrt_bias_correction2,
    ADAM_W: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    # int64 offsets: optimizer tensors (flattened ZeRO partitions) can exceed 2**31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _adam_math(p, g, m, v, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                         bias_correction1, sqrt_bias_correction2, ADAM_W, HAS_DECAY)
    _store(p_out_ptr, offs, p, mask, INTERPRET)
    _store(m_out_ptr, offs, m, mask, INTERPRET)
    _store(v_out_ptr, offs, v, mask, INTERPRET)


TABLE_COLS: tl.constexpr = tl.constexpr(5)  # a table row: param, grad, exp_avg, exp_avg_sq addresses; size


@triton.jit
def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                weight_decay, bias_correction1, sqrt_bias_correction2,
                ADAM_W: tl.constexpr, HAS_DECAY: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    """One block of a multi-tensor step in place; unmasked (MASKED=False) inside the tensor,
    so the loads and stores vectorise."""
    if MASKED:
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = None
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs).to(tl.float32)
        v = tl.load(v_ptr + offs).to(tl.float32)
    p, m, v = _adam_math(p, g, m, v, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                         bias_correction1, sqrt_bias_correction2, ADAM_W, HAS_DECAY)
    _store(p_ptr, offs, p, mask, INTERPRET)
    _store(m_ptr, offs, m, mask, INTERPRET)
    _store(v_ptr, offs, v, mask, INTERPRET)


@triton.jit
def _adam_multi_kernel(
    table_ptr, block_tensor_ptr, block_start_ptr,
    lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
    bias_correction1, sqrt_bias_correction2,
    P_TYPE: tl.constexpr, G_TYPE: tl.constexpr, M_TYPE: tl.constexpr, V_TYPE: tl.constexpr,
    ADAM_W: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Block b updates BLOCK elements of tensor block_tensor[b] from block_start[b], in place;
    table row t holds tensor t's param, grad, exp_avg, exp_avg_sq addresses (16-byte aligned:
    the launcher checks) and its size."""
    block = tl.program_id(0)
    row = table_ptr + tl.load(block_tensor_ptr + block).to(tl.int64) * TABLE_COLS
    p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(P_TYPE)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(G_TYPE)), 16)
    m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(M_TYPE)), 16)
    v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(V_TYPE)), 16)
    n = tl.load(row + 4)
    start = tl.multiple_of(tl.load(block_start_ptr + block), BLOCK)
    offs = start + tl.arange(0, BLOCK)
    scalars = (lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, bias_correction1,
               sqrt_bias_correction2)
    if start + BLOCK <= n:
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, *scalars, ADAM_W, HAS_DECAY, False, INTERPRET)
    else:
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, *scalars, ADAM_W, HAS_DECAY, True, INTERPRET)


_TL_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_TABLES: dict = {}  # group key -> (table, block_tensor, block_start): one upload per group, kept
_MAX_TABLES = 64


def _launch_tables(tensors: list, block: int, device) -> tuple:
    """The device tables of one group (cached by the tensors' addresses and sizes: the same
    parameters step after step reuse them; a new allocation is a new key)."""
    key = (device, block, tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
                                for p, g, m, v in tensors))
    found = _TABLES.get(key)
    if found is None:
        rows = [[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel()] for p, g, m, v in tensors]
        counts = [triton.cdiv(p.numel(), block) for p, _, _, _ in tensors]
        owner = [t for t, c in enumerate(counts) for _ in range(c)]
        start = [i * block for c in counts for i in range(c)]
        found = (torch.tensor(rows, dtype=torch.int64).to(device), torch.tensor(owner, dtype=torch.int32).to(device),
                 torch.tensor(start, dtype=torch.int64).to(device))
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = found
    return found


def adam_step_multi_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step,
                     weight_decay=0.0, adam_w_mode=True, bias_correction=True) -> list:
    """In-place Adam/AdamW over lists of tensors (validated by the caller): one launch per
    (device, dtypes) group of contiguous, 16-byte aligned, non-empty tensors. Returns the indices it updated
    (the caller steps the others, e.g. non-contiguous views, one by one)."""
    groups: dict = {}
    for i, ts in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if ts[0].numel() and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts):
            groups.setdefault((ts[0].device, *(t.dtype for t in ts)), []).append(i)
    if not groups:
        return []
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    served = []
    for (device, *dtypes), idx in groups.items():
        cfg = tile_config(TILES, device)
        block = cfg["block"]
        table, owner, start = _launch_tables([(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]) for i in idx],
                                             block, device)
        with on_device(device):
            _adam_multi_kernel[(owner.numel(),)](
                table, owner, start,
                float(lr), float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2, float(eps), float(weight_decay),
                bc1, math.sqrt(bc2),
                P_TYPE=_TL_TYPES[dtypes[0]], G_TYPE=_TL_TYPES[dtypes[1]], M_TYPE=_TL_TYPES[dtypes[2]],
                V_TYPE=_TL_TYPES[dtypes[3]], ADAM_W=bool(adam_w_mode), HAS_DECAY=weight_decay != 0.0, BLOCK=block,
                INTERPRET=triton_interpret(), num_warps=cfg["num_warps"],
            )
        served += idx
    return served


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view (a copy only for non-contiguous inputs)."""
    return t.contiguous().view(-1)


def _adam_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    lr: float, beta1: float, beta2: float, eps: float, step: int,
    weight_decay: float, adam_w_mode: bool, bias_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p_out = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    m_out = torch.empty(param.shape, dtype=exp_avg.dtype, device=param.device)
    v_out = torch.empty(param.shape, dtype=exp_avg_sq.dtype, device=param.device)
    n = param.numel()
    if n == 0:
        return p_out, m_out, v_out
    # Step-only scalars in double on the host, like the reference's Python arithmetic.
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    cfg = tile_config(TILES, param.device)
    block = min(cfg["block"], triton.next_power_of_2(n))
    with on_device(param):
        _adam_step_kernel[(triton.cdiv(n, block),)](
            _flat(param), _flat(grad), _flat(exp_avg), _flat(exp_avg_sq),
            p_out.view(-1), m_out.view(-1), v_out.view(-1),
            n, float(lr), float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2, float(eps),
            float(weight_decay), bc1, math.sqrt(bc2),
            ADAM_W=bool(adam_w_mode), HAS_DECAY=weight_decay != 0.0, BLOCK=block,
            INTERPRET=triton_interpret(), num_warps=cfg["num_warps"],
        )
    return p_out, m_out, v_out


def _adam_step_fake(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    lr: float, beta1: float, beta2: float, eps: float, step: int,
    weight_decay: float, adam_w_mode: bool, bias_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (param.new_empty(param.shape),
            exp_avg.new_empty(param.shape),
            exp_avg_sq.new_empty(param.shape))


adam_step_op = define_op("fused_adam_step_triton", _adam_step, fake=_adam_step_fake)


def adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
              weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    """fused.adam_step through the Triton custom op; returns new (param, exp_avg, exp_avg_sq)."""
    return adam_step_op(param, grad, exp_avg, exp_avg_sq, float(lr), float(beta1), float(beta2), float(eps),
                        int(step), float(weight_decay), bool(adam_w_mode), bool(bias_correction))


setattr(adam_step, "multi_tensor_", adam_step_multi_)  # the in-place list form graft.ops.fused.adam_step_ looks for


def register(registry) -> None:
    registry.add_impl(triton_implementation(
        OP, adam_step, custom_op=adam_step_op,
        dtypes={torch.float16, torch.bfloat16, torch.float32},
        description="Triton Adam/AdamW step (one fused elementwise pass per tensor, fp32 math)",
    ))


def _aot_variants():
    """Per target: AdamW / Adam+L2 / no decay, bf16 / fp16 / fp32 params with fp32 moments."""
    scalars = dict.fromkeys(("lr", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "weight_decay",
                             "bias_correction1", "sqrt_bias_correction2"), "fp32")
    for target, cfg in per_target(TILES):
        for dtype, adam_w, decay, n in (("bf16", True, True, "i32"), ("fp32", False, True, "i64"),
                                        ("fp16", True, False, "i32")):
            flags = dict(ADAM_W=adam_w, HAS_DECAY=decay, BLOCK=cfg["block"], INTERPRET=False)
            yield variant(_adam_step_kernel, flags, pointer=f"*{dtype}", options={"num_warps": cfg["num_warps"]},
                          targets=(target,), m_ptr="*fp32", v_ptr="*fp32", m_out_ptr="*fp32", v_out_ptr="*fp32",
                          n=n, **scalars)


    # the multi-tensor group kernel: bf16 params with fp32 moments (mixed precision), fp32
    for target, cfg in per_target(TILES):
        for p_type, adam_w in ((tl.bfloat16, True), (tl.float32, False)):
            flags = dict(P_TYPE=p_type, G_TYPE=p_type, M_TYPE=tl.float32, V_TYPE=tl.float32, ADAM_W=adam_w,
                         HAS_DECAY=True, BLOCK=cfg["block"], INTERPRET=False)
            yield variant(_adam_multi_kernel, flags, pointer="*i64", options={"num_warps": cfg["num_warps"]},
                          targets=(target,), block_tensor_ptr="*i32", **scalars)


def aot_variants() -> list:
    """What the AOT check compiles (graft.kernels.triton._aot); built when it asks, never at import."""
    return list(_aot_variants())
