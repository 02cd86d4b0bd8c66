"""DeepSpeed's own code for the ops graft serves in DeepSpeed, as backend ``deepspeed`` (see
``graft.framework_backend``): its FusedAdam kernel as DeepSpeed builds it (the accelerator's
``FusedAdamBuilder``: CUDA's fused_adam, or on the CPU a JIT C++ build of its ``fused_adam``
over ``ds_adam_step``), for ``graft tune --frameworks deepspeed`` and ``GRAFT_FUSED_ADAM_STEP=deepspeed``.

DeepSpeed's comm is torch.distributed's own collectives: graft's collectives already count
those as their baseline (``graft bench overhead``'s collectives section).
"""
from __future__ import annotations

import functools

import torch

FRAMEWORK = "deepspeed"
CHUNK = 2048 * 32  # DeepSpeed's multi_tensor_applier chunk size


@functools.lru_cache(maxsize=None)
def _fused_adam():
    # As DeepSpeed's FusedAdam gets it: the accelerator's builder, graft's integration off.
    from graft.adapters.deepspeed.op_builders import BUILDERS
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    if type(builder) in BUILDERS.values():
        raise RuntimeError("graft's DeepSpeed integration is active: FusedAdamBuilder is graft's, not DeepSpeed's")
    return builder.load(verbose=False)


def adam_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, weight_decay=0.0, adam_w_mode=True,
              bias_correction=True):
    """DeepSpeed's multi_tensor_adam on copies (it updates in place; the graft op is functional)."""
    p, m, v = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    noop = torch.zeros(1, dtype=torch.int, device=p.device)
    _fused_adam().multi_tensor_adam(CHUNK, noop, [[grad], [p], [m], [v]], float(lr), float(beta1), float(beta2),
                                    float(eps), int(step), int(bool(adam_w_mode)), int(bool(bias_correction)),
                                    float(weight_decay))
    return p, m, v


def _same_dtypes(param, grad, exp_avg, exp_avg_sq, *args, **kwargs):
    if not (param.dtype == grad.dtype == exp_avg.dtype == exp_avg_sq.dtype):
        return "DeepSpeed's FusedAdam takes one dtype for the parameter, gradient and moments"
    return None


def _builds() -> str | None:
    try:
        _fused_adam()
    except BaseException as exc:  # a failed JIT build may raise SystemExit
        return f"DeepSpeed's FusedAdam does not build here: {type(exc).__name__}: {exc}"
    return None


def implementations() -> list:
    from graft.framework_backend import implementation

    return [implementation(FRAMEWORK, "fused.adam_step", adam_step,
                           "DeepSpeed's FusedAdam (multi_tensor_adam, as DeepSpeed builds it)",
                           dtypes=(torch.float32,), check=_same_dtypes, check_scalars=(),
                           available=_builds)]


def baselines() -> list:
    return []
