"""Megatron-core's own code for the ops graft's layer spec serves: what its local spec
(``get_gpt_layer_local_spec``) runs, in one place for two uses:

* ``baselines()``: what ``graft conformance`` measures graft's implementations against;
* ``implementations()``: the same code as backend ``megatron`` of each op (see
  ``graft.framework_backend``), which ``graft tune --frameworks megatron`` measures against
  graft's and ``GRAFT_<OP>=megatron`` selects.

The local spec's norms are ``WrappedTorchNorm`` (torch.nn.RMSNorm / torch.nn.LayerNorm) and its
linears, at tensor-parallel size 1, torch's matmul: the functions below are those calls.
"""
from __future__ import annotations

import torch

from graft.baselines import Baseline, adapt_same_args, adapt_unless, load_when

FRAMEWORK = "megatron"


def rms_norm(x, weight, eps=1e-6, residual=None):
    """Megatron's local RMSNorm (WrappedTorchNorm -> torch.nn.RMSNorm)."""
    if residual is not None:
        raise ValueError("Megatron's RMSNorm has no fused residual add")
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x, weight, bias=None, eps=1e-5):
    """Megatron's local LayerNorm (WrappedTorchNorm -> torch.nn.LayerNorm)."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x, weight, bias=None, activation="none"):
    """Megatron's local linear at TP1 (x @ weight.T, bias added by the layer)."""
    if activation != "none":
        raise ValueError(f"Megatron's linear has no fused activation (got {activation!r})")
    return torch.nn.functional.linear(x, weight, bias)


def _no_residual(x, weight, eps=1e-6, residual=None):
    return None if residual is None else "Megatron's RMSNorm has no fused residual add"


def _no_activation(x, weight, bias=None, activation="none"):
    return None if activation == "none" else f"Megatron's linear has no fused {activation} epilogue"


def _megatron_present() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("megatron.core") is not None else "megatron-core is not installed"


def implementations() -> list:
    from graft.framework_backend import implementation

    return [
        implementation(FRAMEWORK, "fused.rms_norm", rms_norm, "Megatron's local RMSNorm (torch.nn.RMSNorm)",
                       check=_no_residual, check_scalars=(), available=_megatron_present),
        implementation(FRAMEWORK, "fused.layer_norm", layer_norm, "Megatron's local LayerNorm (torch.nn.LayerNorm)",
                       available=_megatron_present),
        implementation(FRAMEWORK, "gemm.linear", linear, "Megatron's local linear at TP1 (torch matmul)",
                       check=_no_activation, check_scalars=("activation",),
                       available=_megatron_present),
    ]


def baselines() -> list:
    return [
        Baseline("megatron local RMSNorm", "fused.rms_norm",
                 load_when(rms_norm, _megatron_present), adapt_unless(_no_residual),
                 "Megatron-core's local spec norm (WrappedTorchNorm: torch.nn.RMSNorm)"),
        Baseline("megatron local LayerNorm", "fused.layer_norm",
                 load_when(layer_norm, _megatron_present), adapt_same_args,
                 "Megatron-core's local spec norm (WrappedTorchNorm: torch.nn.LayerNorm)"),
    ]
