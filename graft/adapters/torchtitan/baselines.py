"""TorchTitan's own code for the ops graft's converter serves, in one place for two uses:

* ``baselines()``: what ``graft conformance`` measures graft's implementations against;
* ``implementations()``: the same code as backend ``torchtitan`` of each op (see
  ``graft.framework_backend``), which ``graft tune --frameworks torchtitan`` measures against
  graft's and ``GRAFT_<OP>=torchtitan`` selects.

The functions are what TorchTitan 0.3.0's modules run: ``RMSNorm`` is ``torch.nn.RMSNorm``
(``F.rms_norm``), and ``FeedForward``'s SwiGLU activation is ``F.silu(w1(x)) * w3(x)``
(two separate projections; the graft op takes them side by side, ``[..., 2*D]``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graft.baselines import Baseline, adapt_same_args, adapt_unless, load_when

FRAMEWORK = "torchtitan"


def rms_norm(x, weight, eps=1e-6, residual=None):
    """TorchTitan's RMSNorm (``torch.nn.RMSNorm`` -> ``F.rms_norm``)."""
    if residual is not None:
        raise ValueError("TorchTitan's RMSNorm has no fused residual add")
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(x):
    """TorchTitan's FeedForward activation: ``F.silu(gate) * up``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _no_residual(x, weight, eps=1e-6, residual=None):
    return None if residual is None else "TorchTitan's RMSNorm has no fused residual add"


def _torchtitan_present() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("torchtitan") is not None else "torchtitan is not installed"


def implementations() -> list:
    from graft.framework_backend import implementation

    return [
        implementation(FRAMEWORK, "fused.rms_norm", rms_norm, "TorchTitan's RMSNorm (torch.nn.RMSNorm)",
                       check=_no_residual, check_scalars=(), available=_torchtitan_present),
        implementation(FRAMEWORK, "fused.silu_and_mul", silu_and_mul,
                       "TorchTitan's FeedForward activation (F.silu(w1 x) * w3 x)", available=_torchtitan_present),
    ]


def baselines() -> list:
    return [
        Baseline("torchtitan RMSNorm", "fused.rms_norm",
                 load_when(rms_norm, _torchtitan_present), adapt_unless(_no_residual),
                 "TorchTitan's RMSNorm (torch.nn.RMSNorm)"),
        Baseline("torchtitan FeedForward SwiGLU", "fused.silu_and_mul",
                 load_when(silu_and_mul, _torchtitan_present), adapt_same_args,
                 "TorchTitan's FeedForward activation (F.silu(w1 x) * w3 x)"),
    ]
