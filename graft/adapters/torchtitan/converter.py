"""``GraftConverter``: TorchTitan's model-converter hook (``ModelConfigConverter``), as its
Float8/MX converters use it, naming graft's modules in the model config tree.

    from graft.adapters.torchtitan import GraftConverter
    spec = torchtitan.models.llama3.model_registry("debugmodel", converters=[GraftConverter.Config()])

What it swaps (exact TorchTitan types only; a model's own subclass keeps its forward):

* ``RMSNorm.Config`` with a weight -> ``GraftRMSNorm.Config`` (``fused.rms_norm``);
* ``FeedForward.Config`` -> ``GraftFeedForward.Config`` (``fused.silu_and_mul``);
* ``VarlenAttention.Config`` -> ``GraftVarlenAttention.Config`` (``attention.prefill``: a
  model built with ``attn_backend="varlen"``, TorchTitan's document-masked attention);
* opt-in, ``RoutedExperts.Config`` -> ``GraftRoutedExperts.Config`` (``moe.fused_experts``).

A part is swapped only where graft is wanted (measured selection, as every integration: a
``GRAFT_*`` variable that orders its op's backends, e.g. ``GRAFT_BACKENDS=torch``, or a tuning
table entry naming a graft backend for it, see :func:`graft.selection.graft_wanted`); otherwise
it stays TorchTitan's module with the reason in the report.

Everything else stays TorchTitan's; the converter logs, once per conversion, what it swapped
and what it left with the reason (``graft.integration.torchtitan``), and records it in
:data:`last_report`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from torchtitan.models.common.attention import VarlenAttention
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.model import ModelConfigConverter

from graft.adapters.torchtitan import integration
from graft.adapters.torchtitan.modules import GraftFeedForward, GraftRMSNorm, GraftRoutedExperts, GraftVarlenAttention

log = logging.getLogger("graft.integration.torchtitan")

# The last conversion's summary: {"swapped": {part: n}, "left": {part or fqn: reason}}.
last_report: dict = {}

# (TorchTitan config type, graft config type, part name in integration.NEEDS)
_SWAPS = (
    (RMSNorm.Config, GraftRMSNorm.Config, "norm"),
    (FeedForward.Config, GraftFeedForward.Config, "swiglu"),
    (RoutedExperts.Config, GraftRoutedExperts.Config, "moe"),
    (VarlenAttention.Config, GraftVarlenAttention.Config, "attention"),
)


def _replace(root, new, parent, attr):
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root


def wanted(part: str) -> str | None:
    """Why graft should serve ``part`` (measured selection, :func:`graft.selection.graft_wanted`):
    a GRAFT_* variable or a tuning table entry favouring graft for one of its ops; None: the
    part stays TorchTitan's own module (no graft call at all)."""
    from graft.selection import graft_wanted

    for op in integration.NEEDS[part]:
        why = graft_wanted(op)
        if why:
            return why
    return None


def _features(linear, name: str):
    return getattr(linear, name, None)


def _differs(part: str, cfg) -> str | None:
    """Why graft's module would not compute exactly what TorchTitan's does for this config
    (None: it does). Only such configs are swapped."""
    if part == "norm":
        if not cfg.elementwise_affine:
            return "RMSNorm without a weight"
        shape = cfg.normalized_shape
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(dims) != 1:
            return (f"RMSNorm over {len(dims)} dims (normalized_shape={shape!r}): fused.rms_norm normalizes the "
                    "last dim only")
    if part == "swiglu":
        w1, w3 = cfg.w1, cfg.w3
        widths = (_features(w1, "out_features"), _features(w3, "out_features"))
        inputs = (_features(w1, "in_features"), _features(w3, "in_features"))
        if None in widths or widths[0] != widths[1] or inputs[0] != inputs[1]:
            return (f"w1 and w3 differ (w1 {inputs[0]}->{widths[0]}, w3 {inputs[1]}->{widths[1]}): "
                    "fused.silu_and_mul takes gate and up of one width")
    return None


class GraftConverter(ModelConfigConverter):
    """Swap TorchTitan module configs for graft's (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        parts: tuple[str, ...] = ("norm", "swiglu", "attention")
        """The parts to swap (``norm``, ``swiglu``, ``attention``, ``moe``); the others stay
        TorchTitan's. ``attention`` swaps only varlen inner attention (flex and SDPA stay). ``moe``
        (routed experts on ``moe.fused_experts``) is opt-in: TorchTitan's experts compute in
        bfloat16, graft's in the model's dtype, so it changes numerics (see GraftRoutedExperts)."""

    def __init__(self, config: Config):
        self.config = config
        unknown = sorted(set(config.parts) - set(integration.MODEL_PARTS))
        if unknown:
            raise ValueError(f"GraftConverter: unknown parts {unknown}; valid: {sorted(integration.MODEL_PARTS)}")

    def convert(self, model_config):
        global last_report
        report: dict = {"swapped": {}, "left": dict(integration.NOT_SERVED)}
        last_report = report
        if not integration.enabled():
            report["left"] = {"all": f"graft's TorchTitan integration is off ({integration.ENV_VAR}=0 or GRAFT_DISABLE=all)"}
            return model_config
        unservable = integration.integration().layers()["left"]
        for titan_cls, graft_cls, part in _SWAPS:
            if part not in self.config.parts:
                report["left"][part] = "not in GraftConverter.Config.parts"
                continue
            if part in unservable:
                report["left"][part] = unservable[part]
                continue
            why = wanted(part)
            if why is None:
                report["left"][part] = (
                    "graft is not known faster here (no GRAFT_* variable orders, and no tuning table entry "
                    "names graft for, " + ", ".join(integration.NEEDS[part]) + ")")
                continue
            report.setdefault("why", {})[part] = why
            for fqn, cfg, parent, attr in list(model_config.traverse(titan_cls)):
                if type(cfg) is not titan_cls:  # a model's own subclass: its forward may differ
                    report["left"][fqn] = f"{type(cfg).__qualname__} is not TorchTitan's plain {titan_cls.__qualname__}"
                    continue
                why_not = _differs(part, cfg)
                if why_not:  # graft's module would not compute what TorchTitan's does here
                    report["left"][fqn] = why_not
                    continue
                new = graft_cls(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
                model_config = _replace(model_config, new, parent, attr)
                report["swapped"][part] = report["swapped"].get(part, 0) + 1
            if part not in report["swapped"] and not any(k.startswith(f"{part}.") for k in report["left"]):
                report["left"].setdefault(part, f"this model has no {titan_cls.__qualname__}"
                                          + (" (built with attn_backend='varlen' it has)" if part == "attention" else ""))
        log.info("graft's TorchTitan converter swapped %s; left to TorchTitan: %s",
                 report["swapped"] or "nothing", "; ".join(f"{k}: {v}" for k, v in report["left"].items()))
        return model_config
