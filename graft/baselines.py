"""Upstream baselines: the code an implementation replaces, to measure it against.

Every op is measured against its torch reference (the semantics). Where the framework's
own kernel (contributed by its integration) or a well-known library is importable, it is a second baseline: that is the
ratio that tells a user whether switching to graft pays. Each entry:

* ``load()`` returns the upstream callable or raises (ImportError, ...): the baseline is then
  reported as unavailable with the reason, never silently dropped;
* ``adapt(upstream, args, kwargs)`` maps graft's arguments to the upstream call and returns
  ``(fn, args, kwargs, postprocess_or_None)`` or a string saying why this case cannot be expressed upstream
  (e.g. SDPA cannot take ragged sequence lengths);
* the adapted call is checked against the torch reference as well, so a mis-adapted
  baseline shows up in the report instead of producing a meaningless ratio.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

REFERENCE = "torch reference"
UNAVAILABLE = "unavailable"  # prefix of prepare()'s reason when the upstream code cannot be loaded


@dataclass(frozen=True)
class Baseline:
    name: str  # shown in reports, e.g. "torch.nn.functional.rms_norm"
    op: str
    load: Callable[[], Callable]
    adapt: Callable  # (upstream, args, kwargs) -> (fn, args, kwargs, postprocess | None) | str
    description: str = ""

    @functools.cached_property
    def _loaded(self):
        try:
            return self.load(), None
        except Exception as exc:  # ImportError, or a framework that fails to initialize here
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")

    def upstream(self):
        """(callable, None) or (None, why unavailable)."""
        return self._loaded

    def prepare(self, args: tuple, kwargs: dict):
        """``(fn, args, kwargs, postprocess)`` for this case, or a reason string."""
        fn, reason = self.upstream()
        if fn is None:
            return f"{UNAVAILABLE}: {reason}"
        return self.adapt(fn, args, kwargs)


# --------------------------------------------------------------------------- adapters


def kwarg(args, kwargs, index, name, default=None):
    """Argument ``index`` of a call, passed positionally or as ``name``."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _equal_lengths(cu_seqlens: torch.Tensor):
    lens = torch.diff(cu_seqlens.cpu()).tolist()
    return lens[0] if lens and all(n == lens[0] for n in lens) else None


def _prefill_to_padded(args, kwargs):
    """Varlen prefill arguments as equal-length [B, H, S, D] tensors, or why not."""
    q, k, v, cu_q, cu_k = args[:5]
    causal = kwarg(args, kwargs, 7, "causal", False)
    scale = kwarg(args, kwargs, 8, "softmax_scale", None)
    sq, sk = _equal_lengths(cu_q), _equal_lengths(cu_k)
    if not sq or not sk:
        return "ragged or empty sequences (needs equal-length batches)"
    if causal and sq != sk:
        return "causal with q shorter than k (bottom-right mask; SDPA's is top-left)"
    batch = cu_q.numel() - 1

    def padded(t, s):
        return t.reshape(batch, s, t.shape[1], t.shape[2]).transpose(1, 2)

    return padded(q, sq), padded(k, sk), padded(v, sk), causal, scale, (batch, sq)


def _adapt_sdpa(sdpa, args, kwargs):
    prepared = _prefill_to_padded(args, kwargs)
    if isinstance(prepared, str):
        return prepared
    q, k, v, causal, scale, (batch, sq) = prepared
    gqa = q.shape[1] != k.shape[1]
    call_kwargs = {"is_causal": bool(causal), "scale": scale}
    if gqa:
        call_kwargs["enable_gqa"] = True

    def post(out):  # [B, H, S, D] -> packed [B*S, H, D]
        return out.transpose(1, 2).reshape(batch * sq, out.shape[1], out.shape[3])

    return sdpa, (q, k, v), call_kwargs, post


def _adapt_flash_attn_varlen(fn, args, kwargs):
    q, k, v, cu_q, cu_k, max_q, max_k = args[:7]
    if q.device.type != "cuda":
        return "flash_attn runs on CUDA only"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "flash_attn takes fp16/bf16 only"
    call_kwargs = {"causal": bool(kwarg(args, kwargs, 7, "causal", False)),
                   "softmax_scale": kwarg(args, kwargs, 8, "softmax_scale", None)}
    return fn, (q, k, v, cu_q, cu_k, max_q, max_k), call_kwargs, None


def _adapt_torch_rms_norm(fn, args, kwargs):
    x, weight = args[0], args[1]
    eps = kwarg(args, kwargs, 2, "eps", 1e-6)
    residual = kwarg(args, kwargs, 3, "residual", None)
    if residual is not None:
        return "fused residual add (torch has no fused add+RMSNorm)"
    return fn, (x, (x.shape[-1],), weight, eps), {}, None


def adapt_same_args(fn, args, kwargs):
    return fn, tuple(args), dict(kwargs), None


def adapt_unless(check):
    """An adapter passing the op's arguments as they are, unless ``check(*args, **kwargs)``
    names why the baseline cannot run this case (its reason is then the adapter's answer)."""
    def adapt(fn, args, kwargs):
        why = check(*args, **kwargs)
        return why if why else (fn, tuple(args), dict(kwargs), None)

    return adapt


def load_when(fn, available=None):
    """A loader returning ``fn``, or raising ImportError with ``available()``'s reason (a
    framework that is not installed or cannot run here)."""
    def load():
        reason = available() if available is not None else None
        if reason:
            raise ImportError(reason)
        return fn

    return load


# --------------------------------------------------------------------------- loaders


def _load_sdpa():
    return torch.nn.functional.scaled_dot_product_attention


def _load_torch_rms_norm():
    fn = getattr(torch.nn.functional, "rms_norm", None)
    if fn is None:
        raise ImportError("torch.nn.functional.rms_norm needs torch >= 2.4")
    return fn


def _load_flash_attn():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


BASELINES = [
    Baseline("torch.nn.functional.scaled_dot_product_attention", "attention.prefill", _load_sdpa, _adapt_sdpa,
             "torch SDPA (flash/efficient kernels on GPU) on equal-length batches"),
    Baseline("flash_attn.flash_attn_varlen_func", "attention.prefill", _load_flash_attn, _adapt_flash_attn_varlen,
             "FlashAttention-2 varlen, when installed"),
    Baseline("torch.nn.functional.rms_norm", "fused.rms_norm", _load_torch_rms_norm, _adapt_torch_rms_norm),
]


def all_baselines() -> list:
    """Library baselines (above) and each framework integration's own (its
    ``graft_conformance_baselines`` hook, e.g. ``graft.adapters.vllm.baselines``)."""
    from graft.plugins import get_host

    return [*BASELINES, *get_host().collect("graft_conformance_baselines")]


def baselines_for(op: str, upstream: bool = True) -> list:
    """The upstream baselines registered for ``op`` (empty when ``upstream`` is False)."""
    return [b for b in all_baselines() if b.op == op] if upstream else []
