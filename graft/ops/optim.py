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
custom op.

Optimizers step many tensors in place: :func:`adam_step_` takes lists and updates them
in place. It selects the implementation once per call (on the first tensor); when that is
graft's torch backend, every tensor goes through ONE ``torch._fused_adam_`` /
``torch._fused_adamw_`` call (what ``torch.optim.Adam(fused=True)`` runs), so graft adds
no per-tensor launches or copies over torch's optimizer. Other backends (vendor kernels,
which are functional custom ops) run per tensor and their results are copied back.
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
    if not low <= value <= high or (high_open and value == high):  # NaN fails every comparison
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


# ---------------------------------------------------------------------------- torch backend

TORCH_FUSED_DEVICES = ("cpu", "cuda")


def _torch_fused_reason(param, exp_avg, exp_avg_sq, bias_correction) -> str | None:
    """Why torch's fused Adam kernel cannot run this update (None: it can)."""
    if not bias_correction:
        return "bias_correction=False (torch's fused Adam always corrects)"
    if param.device.type not in TORCH_FUSED_DEVICES:
        return f"device {param.device.type}"
    if not (param.dtype == exp_avg.dtype == exp_avg_sq.dtype):
        return "moments in another dtype than the parameter"
    return None


def _torch_fused_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, weight_decay, adam_w_mode):
    """One in-place ``torch._fused_adam(w)_`` over every tensor (all contiguous, one device, one dtype).

    Same math as the reference; AdamW applies the decay as ``p *= 1 - lr * wd`` first, which
    is the reference's ``p - lr * (update + wd * p)`` regrouped (fp32 rounding differs by an ulp).
    """
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    # torch keeps the step count in a tensor on the parameters' device (fp32, as torch.optim does).
    steps = [torch.full((), float(step), dtype=torch.float32, device=params[0].device)] * len(params)
    fused(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=float(lr), beta1=float(beta1), beta2=float(beta2),
          weight_decay=float(weight_decay), eps=float(eps), amsgrad=False, maximize=False)


def adam_step_torch(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                    weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    """graft's torch backend: torch's fused Adam kernel on copies (the op is functional); the
    reference where that kernel does not apply (no bias correction, mixed state dtypes)."""
    if _torch_fused_reason(param, exp_avg, exp_avg_sq, bias_correction) is not None or param.numel() == 0:
        return adam_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, weight_decay,
                                   adam_w_mode, bias_correction)
    fmt = torch.contiguous_format
    p, m, v = (t.clone(memory_format=fmt) for t in (param, exp_avg, exp_avg_sq))
    _torch_fused_([p], [grad.contiguous()], [m], [v], lr, beta1, beta2, eps, step, weight_decay, adam_w_mode)
    return p, m, v


def torch_implementations() -> list:
    """The ``torch`` backend of fused.adam_step (ranks above the plain reference)."""
    from graft.registry import Implementation

    return [Implementation(
        op=OP, backend="torch", fn=adam_step_torch, provider="graft",
        description="torch._fused_adam(w)_ (what torch.optim.Adam(fused=True) runs); reference otherwise",
        devices=frozenset({"cpu", "cuda", "xpu", "mps", "meta"}), priority=-50,
    )]


# ---------------------------------------------------------------------------- in place, many tensors


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
    if impl.backend == "torch" and _torch_fused_reason(p0, m0, exp_avg_sqs[0], bias_correction) is None:
        same = [i for i in rest if params[i].device == p0.device and params[i].dtype == p0.dtype
                and exp_avgs[i].dtype == m0.dtype and exp_avg_sqs[i].dtype == m0.dtype
                and all(t.is_contiguous() for t in (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))]
        if same:
            pick = (lambda ts: ts) if len(same) == len(params) else (lambda ts: [ts[i] for i in same])
            _torch_fused_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), lr, beta1, beta2, eps,
                          step, weight_decay, adam_w_mode)
            served = set(same)
            rest = [i for i in rest if i not in served]
    for i in rest:
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        fn = impl.fn if i == 0 else select(OP, p, g, m, v, *scalars).fn
        new_p, new_m, new_v = fn(p, g, m, v, *scalars)
        p.copy_(new_p)
        m.copy_(new_m)
        v.copy_(new_v)
    return impl.backend


OPS = [
    OpSpec(
        name=OP,
        family="fused",
        signature="adam_step(param[...], grad[...], exp_avg[...], exp_avg_sq[...], lr, beta1, beta2, eps, "
        "step: int, weight_decay=0.0, adam_w_mode=True, bias_correction=True) -> (param, exp_avg, exp_avg_sq)",
        reference=adam_step_reference,
        description="one Adam/AdamW update (DeepSpeed/Apex multi_tensor_adam semantics), fp32 math, functional",
        validate=validate_adam_step,
        validate_cache="never",  # step (and often lr) change every call: its fast path is inline
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
