"""vLLM's own code for the ops graft serves in vLLM: the baselines ``graft conformance``
measures graft's implementations against (see ``graft.conformance.baselines``)."""
from __future__ import annotations

from graft.conformance.baselines import Baseline, adapt_same_args, kwarg


def _load_rms_norm():
    # What vLLM's RMSNorm.forward_native runs (the CustomOp itself needs a vLLM config to build).
    import vllm.model_executor.layers.layernorm  # noqa: F401  (imports vllm.ir in vLLM's own order)
    from vllm import ir

    return ir.ops.rms_norm, ir.ops.fused_add_rms_norm


def _load_silu_and_mul():
    from vllm.model_executor.layers.activation import SiluAndMul

    return SiluAndMul.forward_native  # a staticmethod: callable without a vLLM config


def _adapt_rms_norm(fns, args, kwargs):
    rms_norm, fused_add = fns
    x, weight = args[0], args[1]
    eps = kwarg(args, kwargs, 2, "eps", 1e-6)
    residual = kwarg(args, kwargs, 3, "residual", None)
    if residual is None:
        return rms_norm, (x, weight, eps, None), {}, None
    # vLLM may update x/residual in place: give it its own copies so the case inputs stay intact.
    return (lambda x, r, w, e: fused_add(x.clone(), r.clone(), w, e, None)), (x, residual, weight, eps), {}, tuple


def baselines() -> list:
    return [
        Baseline("vllm RMSNorm.forward_native", "fused.rms_norm", _load_rms_norm, _adapt_rms_norm,
                 "vLLM's native-torch RMSNorm path (vllm.ir rms_norm / fused_add_rms_norm)"),
        Baseline("vllm SiluAndMul.forward_native", "fused.silu_and_mul", _load_silu_and_mul, adapt_same_args),
    ]
