"""Small fused ops the framework integrations need: RMSNorm (optionally fused with the
residual add), LayerNorm, SiLU-and-mul (the gated MLP activation) and rotary position embedding.

Semantics follow what vLLM, DeepSpeed and Megatron expect from these layers:

* ``rms_norm(x, weight, eps, residual=None)``: ``x * rsqrt(mean(x^2) + eps) * weight``
  over the last dim, reduced in fp32. With ``residual`` it is the fused residual-add
  variant: ``residual_out = x + residual`` and ``out = rms_norm(residual_out)``;
  returns ``(out, residual_out)``.
* ``layer_norm(x, weight, bias=None, eps)``: ``(x - mean) * rsqrt(var + eps) * weight + bias``
  over the last dim with fp32 statistics (biased variance), as ``torch.nn.LayerNorm``.
* ``silu_and_mul(x)``: ``silu(x[..., :D]) * x[..., D:]`` for ``x`` of last dim ``2*D``.
* ``rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)``: rotates the
  first ``rot_dim`` features of every head of ``q`` and ``k`` by the angles of each
  token's position. ``cos_sin_cache[pos] = [cos(theta_0..), sin(theta_0..)]`` (each
  half ``rot_dim/2`` wide). Neox style rotates the two halves of the rotary part;
  GPT-J style rotates interleaved (even, odd) pairs. Features past ``rot_dim`` pass
  through (partial rotary). Functional: returns new ``(q_out, k_out)``. A position
  outside ``[0, max_position)`` is a ``GraftInputError`` with the value checks on; with
  them off (``GRAFT_CHECK_VALUES=0``, tracing, CUDA graphs) its token passes through
  unrotated (cos 1, sin 0) in every backend: no kernel reads outside the cache.

All compute in fp32 and round once to the input dtype.
"""
from __future__ import annotations

import math
import numbers

import torch

from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import check_same_device, check_tensor, checks_values_on, readable_bounds
from graft.ops.fused.reference import (adam_step_reference, layer_norm_reference, rms_norm_reference,
                                       rotary_embedding_reference, silu_and_mul_reference)
from graft.registry import OpSpec


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_float(name, t):
    check_tensor(name, t, dtypes=FLOAT_DTYPES)


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def validate_rms_norm(x, weight, eps=1e-6, residual=None):
    # Fast path: the common valid call in a few attribute reads (dispatch cost is per call);
    # anything else goes through the full checks below, which name the problem.
    if (residual is None and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype in _FLOAT_SET and weight.dtype in _FLOAT_SET and weight.ndim == 1 and x.ndim >= 1
            and weight.shape[0] == x.shape[-1] and type(eps) is float and 0.0 <= eps < math.inf
            and x.device == weight.device):
        return
    _check_float("fused.rms_norm: x", x)
    _check_float("fused.rms_norm: weight", weight)
    if x.dim() < 1:
        raise GraftInputError("fused.rms_norm: x must have at least 1 dim [..., hidden], got a scalar")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise GraftInputError(
            f"fused.rms_norm: weight must be 1-D of size hidden={hidden} (x's last dim), got shape {tuple(weight.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:  # NaN fails >= 0
        raise GraftInputError(f"fused.rms_norm: eps must be a non-negative float (not NaN), got {eps!r}")
    if residual is not None:
        check_tensor("fused.rms_norm: residual", residual, dtypes=(x.dtype,))
        if residual.shape != x.shape:
            raise GraftInputError(
                f"fused.rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
    check_same_device(x=x, weight=weight, residual=residual)


def validate_layer_norm(x, weight, bias=None, eps=1e-5):
    _check_float("fused.layer_norm: x", x)
    if x.dim() < 1:
        raise GraftInputError("fused.layer_norm: x must have at least 1 dim [..., hidden], got a scalar")
    hidden = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        check_tensor(f"fused.layer_norm: {name}", t, dtypes=(x.dtype,))
        if t.dim() != 1 or t.shape[0] != hidden:
            raise GraftInputError(
                f"fused.layer_norm: {name} must be 1-D of size hidden={hidden} (x's last dim), got shape {tuple(t.shape)}"
            )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise GraftInputError(f"fused.layer_norm: eps must be a non-negative float, got {eps!r}")
    check_same_device(x=x, weight=weight, bias=bias)


def validate_silu_and_mul(x):
    if isinstance(x, torch.Tensor) and x.dtype in _FLOAT_SET and x.ndim >= 1 and not x.shape[-1] % 2:
        return  # fast path: the common valid call
    _check_float("fused.silu_and_mul: x", x)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise GraftInputError(
            f"fused.silu_and_mul: x must be [..., 2*D] with an even last dim, got shape {tuple(x.shape)}"
        )


def _check_heads(name, t, num_tokens, head_size):
    _check_float(f"fused.rotary_embedding: {name}", t)
    if t.dim() == 2:
        if t.shape[0] != num_tokens or t.shape[1] % head_size:
            raise GraftInputError(
                f"fused.rotary_embedding: {name} must be [num_tokens={num_tokens}, num_heads*head_size "
                f"(multiple of {head_size})], got shape {tuple(t.shape)}"
            )
    elif t.dim() == 3:
        if t.shape[0] != num_tokens or t.shape[2] != head_size:
            raise GraftInputError(
                f"fused.rotary_embedding: {name} must be [num_tokens={num_tokens}, num_heads, head_size={head_size}], "
                f"got shape {tuple(t.shape)}"
            )
    else:
        raise GraftInputError(
            f"fused.rotary_embedding: {name} must be [T, H*D] or [T, H, D], got shape {tuple(t.shape)}"
        )


def validate_rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox=True):
    # Fast path (value checks off, as on GPUs by default): 2-D q/k in a few attribute reads;
    # anything else goes through the full checks below, which name the problem.
    if (isinstance(positions, torch.Tensor) and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(cos_sin_cache, torch.Tensor) and type(head_size) is int and head_size > 0
            and positions.dtype in (torch.int64, torch.int32) and q.dtype in _FLOAT_SET and k.dtype == q.dtype
            and cos_sin_cache.dtype in _FLOAT_SET and q.ndim == 2 and k.ndim == 2 and cos_sin_cache.ndim == 2
            and q.shape[0] == positions.numel() and k.shape[0] == q.shape[0]
            and not q.shape[1] % head_size and not k.shape[1] % head_size
            and 0 < cos_sin_cache.shape[1] <= head_size and not cos_sin_cache.shape[1] % 2
            and type(is_neox) is bool and q.device == positions.device and k.device == positions.device
            and cos_sin_cache.device == positions.device and not checks_values_on(positions)):
        return
    check_tensor("fused.rotary_embedding: positions", positions, dtypes=(torch.int64, torch.int32))
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise GraftInputError(f"fused.rotary_embedding: head_size must be a positive int, got {head_size!r}")
    num_tokens = positions.numel()
    _check_heads("q", q, num_tokens, head_size)
    if k is not None:
        _check_heads("k", k, num_tokens, head_size)
        if k.dtype != q.dtype:
            raise GraftInputError(f"fused.rotary_embedding: k has dtype {k.dtype}, q has {q.dtype}; they must match")
    check_tensor("fused.rotary_embedding: cos_sin_cache", cos_sin_cache, dtypes=FLOAT_DTYPES, ndim=2)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim == 0 or rot_dim > head_size:
        raise GraftInputError(
            f"fused.rotary_embedding: cos_sin_cache must be [max_position, rot_dim] with even 0 < rot_dim <= "
            f"head_size={head_size}, got shape {tuple(cos_sin_cache.shape)}"
        )
    if not isinstance(is_neox, bool):
        raise GraftInputError(f"fused.rotary_embedding: is_neox must be a bool, got {is_neox!r}")
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    check_rotary_embedding_values(positions, cos_sin_cache)


def check_rotary_embedding_values(positions, cos_sin_cache):
    """fused.rotary_embedding's check of values (``OpSpec.check_values``): positions in range."""
    bounds = readable_bounds(positions)
    max_position = cos_sin_cache.shape[0]
    if bounds is None or (bounds[0] >= 0 and bounds[1] < max_position):
        return
    bad = positions[(positions < 0) | (positions >= max_position)]
    raise GraftInputError(
        f"fused.rotary_embedding: positions must lie in [0, max_position = {max_position}) "
        f"(cos_sin_cache rows), got {int(bad[0])} ({bad.numel()} such positions)"
    )


def rms_norm(x, weight, eps: float = 1e-6, residual=None):
    """RMSNorm over the last dim; with ``residual``, returns ``(out, x + residual)``."""
    return call("fused.rms_norm", x, weight, eps, residual)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim: ``(x - mean) * rsqrt(var + eps) * weight + bias`` (fp32 statistics)."""
    return call("fused.layer_norm", x, weight, bias, eps)


def silu_and_mul(x):
    """``silu(x[..., :D]) * x[..., D:]`` for ``x`` of shape ``[..., 2*D]``."""
    return call("fused.silu_and_mul", x)


def rotary_embedding(positions, q, k, head_size: int, cos_sin_cache, is_neox: bool = True):
    """Rotary position embedding of ``q`` and ``k`` (``k`` may be None); returns ``(q_out, k_out)``."""
    return call("fused.rotary_embedding", positions, q, k, head_size, cos_sin_cache, is_neox)


OPS = [
    OpSpec(
        name="fused.rms_norm",
        family="fused",
        signature="rms_norm(x[..., H], weight[H], eps: float = 1e-6, residual[..., H] | None = None)"
        " -> out | (out, residual_out)",
        reference=rms_norm_reference,
        description="RMSNorm over the last dim (fp32 reduction), optionally fused with the residual add",
        validate=validate_rms_norm,
        grad_inputs=(0, 1, 3),
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="fused.layer_norm",
        family="fused",
        signature="layer_norm(x[..., H], weight[H], bias[H] | None = None, eps: float = 1e-5) -> out",
        reference=layer_norm_reference,
        description="LayerNorm over the last dim (fp32 mean and variance, biased), optional bias",
        validate=validate_layer_norm,
        grad_inputs=(0, 1, 2),
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="fused.silu_and_mul",
        family="fused",
        signature="silu_and_mul(x[..., 2*D]) -> [..., D]",
        reference=silu_and_mul_reference,
        description="silu(x[..., :D]) * x[..., D:] (gated-MLP activation)",
        validate=validate_silu_and_mul,
        grad_inputs=(0,),
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="fused.rotary_embedding",
        family="fused",
        signature="rotary_embedding(positions[T] int64, q[T, Hq*D | Hq, D], k[T, Hk*D | Hk, D] | None, "
        "head_size: int, cos_sin_cache[max_pos, rot_dim], is_neox: bool = True) -> (q_out, k_out)",
        reference=rotary_embedding_reference,
        description="rotary position embedding, neox or GPT-J style, partial rotary (rot_dim <= head_size)",
        key_arg=1,
        validate=validate_rotary_embedding,
        check_values=check_rotary_embedding_values,
        grad_inputs=(1, 2),
    ),
]


# Optimizer steps the framework integrations need (family ``fused``).
#
# ``fused.adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
# weight_decay=0.0, adam_w_mode=True, bias_correction=True)`` is one Adam/AdamW update of
# one tensor, with the semantics of DeepSpeed's (and Apex's) ``multi_tensor_adam``:
#
# * ``adam_w_mode=True`` (AdamW): weight decay is decoupled,
#   ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``;
#   ``adam_w_mode=False`` (Adam with L2): ``grad += weight_decay * p`` before the moments.
# * ``m = beta1 * m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g * g``;
#   with ``bias_correction`` the moments are divided by ``1 - beta**step``
#   (``step`` counts from 1), and the denominator is ``sqrt(v) / sqrt(1 - beta2**step) + eps``.
#
# Math is fp32; each result is rounded once to its input's dtype (bf16/fp16 params may
# keep fp32 moments). The op is functional: it returns new ``(param, exp_avg, exp_avg_sq)``
# and never writes its inputs, so an optimized kernel can be a plain ``torch.library``
# custom op.
#
# Optimizers step many tensors in place: :func:`adam_step_` takes lists and updates them
# in place. It selects the implementation once per call (on the first tensor); when that is
# graft's torch backend, every tensor goes through ONE ``torch._fused_adam_`` /
# ``torch._fused_adamw_`` call (what ``torch.optim.Adam(fused=True)`` runs), so graft adds
# no per-tensor launches or copies over torch's optimizer. A backend whose implementation
# carries ``multi_tensor_`` (an in-place list form returning the indices it updated, e.g.
# graft's Triton kernel: one launch per group) serves the group the same way; other backends
# (functional custom ops) run per tensor and their results are copied back.

OP = "fused.adam_step"


def _check_number(name, value, low, high, *, high_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GraftInputError(f"{OP}: {name} must be a number, got {type(value).__name__}")
    if not low <= value <= high or (high_open and value == high):  # NaN fails every comparison
        bound = ")" if high_open else "]"
        raise GraftInputError(f"{OP}: {name} must be in [{low}, {high}{bound}, got {value}")


def validate_adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                       weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    # Fast path: the common valid call in a few attribute reads and comparisons (one call per
    # parameter tensor per step); anything else goes through the full checks, which name the problem.
    if (isinstance(param, torch.Tensor) and isinstance(grad, torch.Tensor) and isinstance(exp_avg, torch.Tensor)
            and isinstance(exp_avg_sq, torch.Tensor) and param.dtype in _FLOAT_SET and grad.dtype == param.dtype
            and exp_avg.dtype in _FLOAT_SET and exp_avg_sq.dtype == exp_avg.dtype
            and grad.shape == param.shape and exp_avg.shape == param.shape and exp_avg_sq.shape == param.shape
            and grad.device == param.device and exp_avg.device == param.device
            and exp_avg_sq.device == param.device
            and type(lr) is float and 0.0 <= lr < math.inf and type(beta1) is float and 0.0 <= beta1 < 1.0
            and type(beta2) is float and 0.0 <= beta2 < 1.0 and type(eps) is float and 0.0 <= eps < math.inf
            and type(weight_decay) is float and 0.0 <= weight_decay < math.inf
            and type(step) is int and step >= 1 and type(adam_w_mode) is bool and type(bias_correction) is bool):
        return
    check_tensor(f"{OP}: param", param, dtypes=FLOAT_DTYPES)
    check_tensor(f"{OP}: grad", grad, dtypes=(param.dtype,))
    check_tensor(f"{OP}: exp_avg", exp_avg, dtypes=FLOAT_DTYPES)
    check_tensor(f"{OP}: exp_avg_sq", exp_avg_sq, dtypes=(exp_avg.dtype,))
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape:
            raise GraftInputError(f"{OP}: {name} has shape {tuple(t.shape)}, expected param's {tuple(param.shape)}")
    check_same_device(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _check_number("beta1", beta1, 0.0, 1.0, high_open=True)
    _check_number("beta2", beta2, 0.0, 1.0, high_open=True)
    _check_number("eps", eps, 0.0, math.inf)
    _check_number("weight_decay", weight_decay, 0.0, math.inf)
    validate_adam_schedule(lr, step)
    for name, flag in (("adam_w_mode", adam_w_mode), ("bias_correction", bias_correction)):
        if not isinstance(flag, (bool, int)):
            raise GraftInputError(f"{OP}: {name} must be a bool, got {type(flag).__name__}")


def validate_adam_schedule(lr, step):
    """The arguments that change every step (a scheduler's lr, the step count): checked on
    every call, also for a remembered signature (``OpSpec.validate_varying``)."""
    if type(lr) is float and 0.0 <= lr < math.inf and type(step) is int and step >= 1:
        return
    _check_number("lr", lr, 0.0, math.inf)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise GraftInputError(f"{OP}: step must be an int >= 1 (the update's 1-based count), got {step!r}")


def adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
              weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    """One Adam/AdamW update; returns new ``(param, exp_avg, exp_avg_sq)`` (see the module doc)."""
    return call(OP, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                weight_decay, adam_w_mode, bias_correction)


def validate_adam_step_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step,
                        weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    lists = (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs))
    for name, value in lists:
        if not isinstance(value, (list, tuple)):
            raise GraftInputError(f"{OP}: {name} must be a list of tensors, got {type(value).__name__}")
    lengths = {name: len(value) for name, value in lists}
    if len(set(lengths.values())) > 1:
        raise GraftInputError(f"{OP}: the tensor lists differ in length: {lengths}")
    if not params:
        return
    # The scalars and the first tensor get the full check; the others the cheap per-tensor part.
    validate_adam_step(params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], lr, beta1, beta2, eps, step, weight_decay,
                       adam_w_mode, bias_correction)
    for i in range(1, len(params)):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        if not all(isinstance(t, torch.Tensor) for t in (p, g, m, v)):
            raise GraftInputError(f"{OP}: element {i} of the tensor lists is not a tensor")
        if not (p.shape == g.shape == m.shape == v.shape) or g.dtype != p.dtype or m.dtype != v.dtype \
                or not (p.device == g.device == m.device == v.device):
            validate_adam_step(p, g, m, v, lr, beta1, beta2, eps, step, weight_decay, adam_w_mode, bias_correction)
        if p.dtype not in FLOAT_DTYPES or m.dtype not in FLOAT_DTYPES:
            validate_adam_step(p, g, m, v, lr, beta1, beta2, eps, step, weight_decay, adam_w_mode, bias_correction)


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step,
               weight_decay=0.0, adam_w_mode=True, bias_correction=True) -> str | None:
    """In-place Adam/AdamW over lists of tensors (the optimizer's form of fused.adam_step).

    Returns the backend that served (None for empty lists). The implementation is selected
    once, on the first tensor; tensors that do not share its device and dtypes, or that are
    not contiguous, take the per-tensor path of the same selection rules.
    """
    from graft.dispatch import select

    validate_adam_step_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, weight_decay,
                        adam_w_mode, bias_correction)
    if not params:
        return None
    p0, m0 = params[0], exp_avgs[0]
    scalars = (lr, beta1, beta2, eps, step, weight_decay, adam_w_mode, bias_correction)
    impl = select(OP, p0, grads[0], m0, exp_avg_sqs[0], *scalars)
    rest = list(range(len(params)))
    if impl.backend == "torch" and _torch_backend._torch_fused_reason(p0, m0, exp_avg_sqs[0], bias_correction) is None:
        same = [i for i in rest if params[i].device == p0.device and params[i].dtype == p0.dtype
                and exp_avgs[i].dtype == m0.dtype and exp_avg_sqs[i].dtype == m0.dtype
                and all(t.is_contiguous() for t in (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))]
        if same:
            pick = (lambda ts: ts) if len(same) == len(params) else (lambda ts: [ts[i] for i in same])
            _torch_backend._torch_fused_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), lr, beta1,
                                         beta2, eps, step, weight_decay, adam_w_mode)
            served = set(same)
            rest = [i for i in rest if i not in served]
    elif (multi_tensor_ := getattr(impl.fn, "multi_tensor_", None)) is not None:
        served = set(multi_tensor_(params, grads, exp_avgs, exp_avg_sqs, *scalars))
        rest = [i for i in rest if i not in served]
    for i in rest:
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        fn = impl.fn if i == 0 else select(OP, p, g, m, v, *scalars).fn
        new_p, new_m, new_v = fn(p, g, m, v, *scalars)
        p.copy_(new_p)
        m.copy_(new_m)
        v.copy_(new_v)
    return impl.backend


OPS += [
    OpSpec(
        name=OP,
        family="fused",
        signature="adam_step(param[...], grad[...], exp_avg[...], exp_avg_sq[...], lr, beta1, beta2, eps, "
        "step: int, weight_decay=0.0, adam_w_mode=True, bias_correction=True) -> (param, exp_avg, exp_avg_sq)",
        reference=adam_step_reference,
        description="one Adam/AdamW update (DeepSpeed/Apex multi_tensor_adam semantics), fp32 math, functional",
        validate=validate_adam_step,
        validate_cache="always",  # metadata only, but for lr and step:
        validate_varying=validate_adam_schedule,  # checked on every call
    ),
]


# The conformance cases, re-exported here (imported last: a cases module may use this module's names).
from graft.ops.fused.cases import cos_sin_cache, CASES

# The torch backend's one-call group path of adam_step_ (imported last: that module imports this one's names).
from graft.kernels.torch import fused as _torch_backend
