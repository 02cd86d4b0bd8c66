"""Optimizer steps the framework integrations need (family ``fused``).

``fused.adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
weight_decay=0.0, adam_w_mode=True, bias_correction=True)`` is one Adam/AdamW update of
one tensor, with the semantics of DeepSpeed's (and Apex's) ``multi_tensor_adam``:

* ``adam_w_mode=True`` (AdamW): weight decay is decoupled,
  ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``;
  ``adam_w_mode=False`` (Adam with L2): ``grad += weight_decay * p`` before the moments.
* ``m = beta1 * m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g * g``;
  with ``bias_correction`` the moments are divided by ``1 - beta**step``
  (``step`` counts from 1), and the denominator is ``sqrt(v) / sqrt(1 - beta2**step) + eps``.

Math is fp32; each result is rounded once to its input's dtype (bf16/fp16 params may
keep fp32 moments). The op is functional: it returns new ``(param, exp_avg, exp_avg_sq)``
and never writes its inputs, so an optimized kernel can be a plain ``torch.library``
custom op; callers copy the results back (the DeepSpeed adapter does).
"""
from __future__ import annotations

import math
import numbers

import torch

from graft.cases import OpCase
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import check_same_device, check_tensor
from graft.registry import OpSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OP = "fused.adam_step"


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                        weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    p = param.float()
    g = grad.float()
    if not adam_w_mode and weight_decay:
        g = g + weight_decay * p
    m = beta1 * exp_avg.float() + (1.0 - beta1) * g
    v = beta2 * exp_avg_sq.float() + (1.0 - beta2) * g * g
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    update = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + eps)
    if adam_w_mode and weight_decay:
        update = update + weight_decay * p
    p = p - lr * update
    return p.to(param.dtype), m.to(exp_avg.dtype), v.to(exp_avg_sq.dtype)


def _check_number(name, value, low, high, *, high_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GraftInputError(f"{OP}: {name} must be a number, got {type(value).__name__}")
    if value < low or value > high or (high_open and value == high):
        bound = ")" if high_open else "]"
        raise GraftInputError(f"{OP}: {name} must be in [{low}, {high}{bound}, got {value}")


_FLOAT_SET = frozenset(FLOAT_DTYPES)


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
    _check_number("lr", lr, 0.0, math.inf)
    _check_number("beta1", beta1, 0.0, 1.0, high_open=True)
    _check_number("beta2", beta2, 0.0, 1.0, high_open=True)
    _check_number("eps", eps, 0.0, math.inf)
    _check_number("weight_decay", weight_decay, 0.0, math.inf)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise GraftInputError(f"{OP}: step must be an int >= 1 (the update's 1-based count), got {step!r}")
    for name, flag in (("adam_w_mode", adam_w_mode), ("bias_correction", bias_correction)):
        if not isinstance(flag, (bool, int)):
            raise GraftInputError(f"{OP}: {name} must be a bool, got {type(flag).__name__}")


def adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
              weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    """One Adam/AdamW update; returns new ``(param, exp_avg, exp_avg_sq)`` (see the module doc)."""
    return call(OP, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                weight_decay, adam_w_mode, bias_correction)


OPS = [
    OpSpec(
        name=OP,
        family="fused",
        signature="adam_step(param[...], grad[...], exp_avg[...], exp_avg_sq[...], lr, beta1, beta2, eps, "
        "step: int, weight_decay=0.0, adam_w_mode=True, bias_correction=True) -> (param, exp_avg, exp_avg_sq)",
        reference=adam_step_reference,
        description="one Adam/AdamW update (DeepSpeed/Apex multi_tensor_adam semantics), fp32 math, functional",
        validate=validate_adam_step,
    ),
]


def _adam_case(name, shape, step, weight_decay, adam_w_mode, bias_correction=True, fp32_states=False,
               tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        param = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        grad = (0.1 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
        state_dtype = torch.float32 if fp32_states else dtype
        exp_avg = (0.01 * torch.randn(shape, generator=gen)).to(device=device, dtype=state_dtype)
        exp_avg_sq = (1e-4 * torch.rand(shape, generator=gen)).to(device=device, dtype=state_dtype)
        return (param, grad, exp_avg, exp_avg_sq, 1e-3, 0.9, 0.999, 1e-8, step,
                weight_decay, adam_w_mode, bias_correction), {}

    def moved(args, kwargs):
        return sum(t.numel() * t.element_size() for t in args[:4]) * 7 // 4  # read 4, write 3

    return OpCase(OP, name, make, tags=tags, flops=moved)


CASES = [
    _adam_case("n1_step1_adamw", (1,), 1, 0.01, True),
    _adam_case("n7_step3_adam_l2", (7,), 3, 0.1, False),
    _adam_case("n33x65_step10_adamw", (33, 65), 10, 0.01, True),
    _adam_case("n129_step2_nodecay_nobias", (129,), 2, 0.0, True, bias_correction=False),
    _adam_case("n17x3_fp32_states", (17, 3), 5, 0.05, True, fp32_states=True),
    _adam_case("n16M_adamw", (4096, 4096), 100, 0.01, True, tags=frozenset({"gpu"})),
]
