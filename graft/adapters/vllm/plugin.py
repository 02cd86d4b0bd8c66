"""vLLM's entry point into graft (group ``vllm.general_plugins``, name ``graft``).

vLLM runs :func:`register` once per process (API server, engine core, every worker),
before models are built. It must be idempotent and must never break vLLM: any
problem is logged and graft simply stays out.
"""
from __future__ import annotations

import importlib
import logging
import threading

from graft import config, settings
from graft.errors import GraftConfigError

log = logging.getLogger("graft.vllm")

# The vLLM layers graft can take over; GRAFT_VLLM_OPS picks a subset.
PARTS = ("rms_norm", "silu_and_mul", "rotary_embedding", "linear", "moe", "attention")

# Which module of this package registers each part (its ``register(parts) -> dict``).
_MODULE_OF = {
    "rms_norm": "custom_ops",
    "silu_and_mul": "custom_ops",
    "rotary_embedding": "custom_ops",
    "linear": "linear",
    "moe": "moe",
    "attention": "attention",
}

_lock = threading.Lock()
_summary: dict | None = None  # what activate() did, once it ran


def selected_parts(environ=None) -> tuple:
    raw = settings.raw("GRAFT_VLLM_OPS", environ)
    if raw is None:
        return PARTS
    names = config.split_list(raw)
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise GraftConfigError(
            f"GRAFT_VLLM_OPS={raw!r}: unknown or empty; give a comma-separated list of {', '.join(PARTS)}"
        )
    return tuple(p for p in PARTS if p in names)


def register() -> None:
    """Called by vLLM (``vllm.plugins.load_general_plugins``). Never raises."""
    try:
        from graft.adapters.vllm.integration import INTEGRATION

        config.configure_logging()
        ok, why = INTEGRATION.status()
        if not ok:
            _warn_off_once(why)
            return
        activate()
    except Exception as exc:  # a graft problem must not take vLLM down
        log.warning("graft: vLLM integration failed to activate, vLLM runs unchanged: %s: %s", type(exc).__name__, exc)


_warned_off = False


def _warn_off_once(why: str) -> None:
    # vLLM is importable here (it is calling us): a user who installed graft expects it in,
    # so staying out is said at WARNING, once per process.
    global _warned_off
    if _warned_off:
        return
    _warned_off = True
    log.warning("graft: vLLM integration not activated: %s; graft kernels stay out of vLLM, vLLM runs unchanged", why)


def activate() -> dict:
    """Register graft's replacements with vLLM (idempotent). Returns {part: what happened}."""
    global _summary
    with _lock:
        if _summary is not None:
            return _summary
        from graft.adapters.vllm.integration import INTEGRATION
        from graft.integration import log_part_off

        summary: dict = {}
        failed: set = set()
        off = INTEGRATION.unavailable_parts()
        for part in selected_parts():
            if part in off:  # graft cannot serve its ops here: vLLM keeps its own layer
                summary[part] = f"off: {off[part]}"
                log_part_off("vllm", part, off[part])
        # vLLM's own code competes (backend "vllm", graft.framework_backend): where graft is not
        # known faster, the layer stays exactly as vLLM built it.
        from graft import framework_backend

        framework_backend.enable("vllm")
        # graft.selection decides (graft_wanted); opt-in parts change nothing unless selected.
        candidates = [p for p in selected_parts() if p not in off and p not in OPT_IN_PARTS]
        left_to_vllm = INTEGRATION.not_wanted(candidates)
        for part, why in left_to_vllm.items():
            summary[part] = f"vLLM's own: {why}"
            log.info("graft: vLLM's %s stays vLLM's own code: %s", part, why)
        parts = tuple(p for p in selected_parts() if p not in off and p not in summary)
        for part in parts:
            if part in summary:
                continue  # registered together with an earlier part
            module_name = _MODULE_OF[part]
            try:
                module = importlib.import_module(f"graft.adapters.vllm.{module_name}")
                summary.update(module.register(parts))
            except Exception as exc:  # one broken part must not keep the others out
                summary[part] = f"failed: {type(exc).__name__}: {exc}"
                failed.add(part)
                log.warning("graft: could not register %s with vLLM: %s: %s", part, type(exc).__name__, exc)
        _warm_graft_registry()
        _summary = summary
        not_served = set(off) | set(left_to_vllm) | failed
        INTEGRATION.report_layers(summary, not_served)  # INFO: served and left; WARNING: expected parts left out
        return summary


# Parts that change nothing unless a user selects them (vLLM's attention backend choice).
OPT_IN_PARTS = ("attention",)


def _warm_graft_registry() -> None:
    """Load graft's plugins and kernels now, outside any torch.compile trace.

    vLLM's first forward (the profile run) is usually compiled; were graft's plugin host
    first built inside that trace, Dynamo would hit its lock and kernel-module imports
    and break the graph (an error under vLLM's fullgraph compile).
    """
    from graft.plugins import get_registry

    try:
        get_registry()
    except Exception as exc:  # graft's own dispatch reports it again, with context, on first use
        log.warning("graft: could not load graft's plugins at vLLM start-up: %s: %s", type(exc).__name__, exc)


def activation_summary() -> dict | None:
    """What activate() registered in this process, or None if it did not run."""
    return _summary
