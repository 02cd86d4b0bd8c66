"""vLLM's own code for the ops graft serves in vLLM, in one place for two uses:

* ``baselines()``: what ``graft conformance`` measures graft's implementations against
  (see ``graft.baselines``);
* ``implementations()``: the same code as backend ``vllm`` of each graft op (see
  ``graft.framework_backend``), the candidate graft must beat in selection and ``graft tune``.

Each function takes the graft op's arguments and runs what vLLM's layer would run without
graft, returning the op's (functional) result. Nothing of vLLM is imported until one runs.
"""
from __future__ import annotations

import functools

import torch

from graft.baselines import Baseline, adapt_same_args, kwarg, load_when

FRAMEWORK = "vllm"


@functools.lru_cache(maxsize=None)
def _ir_ops():
    # What vLLM's RMSNorm.forward_native / forward_cpu run: vllm.ir's rms_norm ops, dispatched
    # to the provider vLLM's kernel config picks (its _C kernel where built, else native torch).
    import vllm.model_executor.layers.layernorm  # noqa: F401  (imports vllm.ir in vLLM's own order)
    from vllm import ir

    return ir.ops.rms_norm, ir.ops.fused_add_rms_norm


@functools.lru_cache(maxsize=None)
def _custom_ops():
    from vllm import _custom_ops as ops

    return ops


def rms_norm(x, weight, eps=1e-6, residual=None):
    """vLLM's RMSNorm (vllm.ir rms_norm / fused_add_rms_norm, the functional overloads)."""
    norm, fused_add = _ir_ops()
    if residual is None:
        return norm(x, weight, eps, None)
    return fused_add(x, residual, weight, eps, None)


def silu_and_mul(x):
    """vLLM's SiluAndMul: its _C kernel on a GPU (forward_cuda), forward_native on the CPU
    (what forward_cpu runs off PowerPC)."""
    d = x.shape[-1] // 2
    if x.device.type != "cpu":
        out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
        _custom_ops()  # loads torch.ops._C
        torch.ops._C.silu_and_mul(out, x)
        return out
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox=True):
    """vLLM's RotaryEmbedding.forward_cpu / forward_cuda: its _C kernel, which rotates in
    place (here on copies: the graft op is functional)."""
    q = q.clone()
    k = None if k is None else k.clone()
    if cos_sin_cache.dtype != q.dtype or cos_sin_cache.device != q.device:  # _match_cos_sin_cache_dtype
        cos_sin_cache = cos_sin_cache.to(device=q.device, dtype=q.dtype)
    _custom_ops().rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
    return q, k


def linear(x, weight, bias=None, activation="none"):
    """vLLM's default unquantized GEMM (``default_unquantized_gemm``: torch.nn.functional.linear)."""
    if activation != "none":
        raise ValueError(f"vLLM's unquantized GEMM has no fused activation (got {activation!r})")
    return torch.nn.functional.linear(x, weight, bias)


def _linear_check(x, weight, bias=None, activation="none"):
    return None if activation == "none" else f"vLLM's GEMM has no fused {activation} epilogue"


def _rotary_available() -> str | None:
    try:
        _custom_ops()
    except Exception as exc:  # a vLLM build without its compiled extension
        return f"vLLM's compiled ops do not load: {type(exc).__name__}: {exc}"
    if not hasattr(torch.ops._C, "rotary_embedding"):
        return "this vLLM build has no _C rotary_embedding kernel"
    return None


def _rms_norm_available() -> str | None:
    try:
        _ir_ops()
    except Exception as exc:
        return f"vllm.ir does not load: {type(exc).__name__}: {exc}"
    return None


def implementations() -> list:
    from graft.framework_backend import implementation

    return [
        implementation(FRAMEWORK, "fused.rms_norm", rms_norm, "vLLM's RMSNorm (vllm.ir rms_norm, fused_add_rms_norm)",
                       available=_rms_norm_available),
        implementation(FRAMEWORK, "fused.silu_and_mul", silu_and_mul,
                       "vLLM's SiluAndMul (forward_native on the CPU, its _C kernel on GPUs)"),
        implementation(FRAMEWORK, "fused.rotary_embedding", rotary_embedding,
                       "vLLM's RotaryEmbedding (_C rotary_embedding, in place on copies)",
                       available=_rotary_available),
        # Not on the CPU: there vLLM's linear layers run a GEMM prepacked per layer (oneDNN),
        # which a call with the op's arguments cannot reproduce; graft tune then records vLLM's
        # own code as the winner (graft is not known faster) instead of racing a stand-in.
        implementation(FRAMEWORK, "gemm.linear", linear,
                       "vLLM's default unquantized GEMM (torch.nn.functional.linear)", check=_linear_check,
                       check_scalars=("activation",),
                       devices=("cuda",)),
    ]


# --------------------------------------------------------------------------- conformance


def _load_silu_and_mul():
    from vllm.model_executor.layers.activation import SiluAndMul

    return SiluAndMul.forward_native  # a staticmethod: callable without a vLLM config


def _adapt_rms_norm(fn, args, kwargs):
    x, weight = args[0], args[1]
    eps = kwarg(args, kwargs, 2, "eps", 1e-6)
    residual = kwarg(args, kwargs, 3, "residual", None)
    if residual is None:
        return fn, (x, weight, eps), {}, None
    return fn, (x, weight, eps, residual), {}, tuple


def baselines() -> list:
    return [
        Baseline("vllm RMSNorm.forward_native", "fused.rms_norm", load_when(rms_norm, _rms_norm_available),
                 _adapt_rms_norm, "vLLM's native-torch RMSNorm path (vllm.ir rms_norm / fused_add_rms_norm)"),
        Baseline("vllm SiluAndMul.forward_native", "fused.silu_and_mul", _load_silu_and_mul, adapt_same_args),
    ]
