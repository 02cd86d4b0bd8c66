"""graft's torch backend of the fused ops: torch's own fused RMSNorm/LayerNorm and fused Adam kernels,
ranked above the references (:mod:`graft.ops.fused.reference`)."""
from __future__ import annotations

import torch

from graft.ops._validate import acc
from graft.ops.fused import OP
from graft.ops.fused.reference import adam_step_reference, layer_norm_reference


def rms_norm_torch(x, weight, eps=1e-6, residual=None):
    """graft's torch backend of fused.rms_norm: torch's fused RMSNorm kernel
    (``F.rms_norm``, what ``torch.nn.RMSNorm`` runs) on the reference's fp32 values, rounded
    once to ``x``'s dtype; differentiable through torch's own backward. In fp32 it is exactly
    the call a framework makes itself (no conversions: each costs a Python call per op call)."""
    if x.dtype is torch.float32 and weight.dtype is torch.float32:
        if residual is None:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        if residual.dtype is torch.float32:
            added = x + residual
            return torch.nn.functional.rms_norm(added, (added.shape[-1],), weight, eps), added
    xf = acc(x)
    if residual is not None:
        xf = xf + acc(residual)
    out = torch.nn.functional.rms_norm(xf, (xf.shape[-1],), acc(weight), eps).to(x.dtype)
    if residual is None:
        return out
    return out, xf.to(x.dtype)


def layer_norm_torch(x, weight, bias=None, eps=1e-5):
    """graft's torch backend of fused.layer_norm: in fp32, exactly the call a framework makes
    itself (``F.layer_norm``, what ``torch.nn.LayerNorm`` runs: the reference's three
    ``.float()`` and one ``.to()`` are each a Python call per op call, about 2 us in all on
    the CPU); other dtypes take the reference (fp32 math, one rounding)."""
    if x.dtype is torch.float32 and weight.dtype is torch.float32 and (bias is None or bias.dtype is torch.float32):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def torch_implementations():
    """graft's torch backend of fused.rms_norm, fused.layer_norm and fused.adam_step (rank
    above the plain references)."""
    from graft.registry import torch_fast_path

    return _adam_torch_implementations() + [
        torch_fast_path("fused.rms_norm", rms_norm_torch,
                        "torch.nn.functional.rms_norm (what torch.nn.RMSNorm runs) on fp32 values"),
        torch_fast_path("fused.layer_norm", layer_norm_torch,
                        "torch.nn.functional.layer_norm (what torch.nn.LayerNorm runs) in fp32; the reference "
                        "otherwise"),
    ]


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


def _adam_torch_implementations() -> list:
    """The ``torch`` backend of fused.adam_step (ranks above the plain reference)."""
    from graft.registry import torch_fast_path

    return [torch_fast_path(OP, adam_step_torch,
                            "torch._fused_adam(w)_ (what torch.optim.Adam(fused=True) runs); reference otherwise")]
