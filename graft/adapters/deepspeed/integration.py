"""Turning graft on inside DeepSpeed, and off again.

DeepSpeed has no plugin entry point: it picks its accelerator itself, binds op builder
classes to names when ``deepspeed`` is imported, and builds its comm backend in
``init_distributed()``. So activation (``graft.adapters.deepspeed.activate()``, or the
``python -m graft.adapters.deepspeed`` runner) does three things, all undone by
:func:`deactivate`:

1. ``deepspeed.accelerator.set_accelerator(GraftAccelerator(current))``: DeepSpeed's
   documented hook for a custom accelerator; graft's wraps the detected one.
2. Rebinds the builder names DeepSpeed bound at import (``deepspeed.ops.op_builder.
   FusedAdamBuilder``, ``deepspeed.ops.adam.fused_adam.FusedAdamBuilder``) to graft's.
3. Makes ``deepspeed.comm``'s backend class (and the live backend object, if
   ``init_distributed`` already ran) :class:`~graft.adapters.deepspeed.comm.GraftTorchBackend`.

Call it before ``deepspeed.initialize()``: an optimizer built earlier keeps its kernels.
"""
from __future__ import annotations

import logging
import sys
import threading

from graft.integration import CallCounter, FrameworkIntegration

log = logging.getLogger("graft.adapters.deepspeed")

ENV_VAR = "GRAFT_DEEPSPEED"  # declared in graft.settings
SUPPORTED = ">=0.19,<0.20"
BUILDER_PACKAGE = "deepspeed.ops.op_builder"

_lock = threading.RLock()
_undo: list = []
_active = False


def _restore(records) -> None:
    for module, name, original in records:
        setattr(module, name, original)


def integration() -> FrameworkIntegration:
    return FrameworkIntegration(
        name="deepspeed",
        distribution="deepspeed",
        supported=SUPPORTED,
        activate=activate,
        description="FusedAdam -> fused.adam_step; deepspeed.comm all_reduce/all_gather/reduce_scatter -> "
        "graft collectives (accelerator wrapper + comm backend)",
        env_var=ENV_VAR,
        measured=True,  # FusedAdam / CPUAdam and DeepSpeed's comm stay unless graft is known faster
        needs={"adam": ("fused.adam_step",),
               "comm": ("collectives.all_reduce", "collectives.all_gather", "collectives.reduce_scatter")},
        notes=[
            "not automatic: call graft.adapters.deepspeed.activate() before deepspeed.initialize(), "
            "or launch with `deepspeed --module graft.adapters.deepspeed train.py`",
        ],
    )


def is_active() -> bool:
    return _active


def _rebind_builders(accelerator, builders: dict) -> list:
    """Point every already-imported ``deepspeed.*`` name bound to a replaced builder at graft's.

    Skips the vendor builder packages (``deepspeed.ops.op_builder.<vendor>...``), which
    define the originals; the accelerator-neutral table ``deepspeed.ops.op_builder`` and
    users such as ``deepspeed.ops.adam.fused_adam`` are rebound. Returns undo records.
    """
    records = []
    for class_name, graft_builder in builders.items():
        original = accelerator.get_op_builder(class_name)
        if original is None or original is graft_builder:
            continue
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "deepspeed" or module_name.startswith("deepspeed.")):
                continue
            if module_name.startswith(BUILDER_PACKAGE + "."):
                continue
            if getattr(module, class_name, None) is original:
                setattr(module, class_name, graft_builder)
                records.append((module, class_name, original))
    return records


def activate() -> bool:
    """Route DeepSpeed's FusedAdam and collectives to graft. Idempotent.

    Measured selection: a part (the optimizer, comm) is taken over only where graft is known
    faster here (a ``GRAFT_*`` variable ordering its ops, e.g. ``GRAFT_BACKENDS=torch``, or a
    tuning table entry); otherwise DeepSpeed's own code stays untouched, said at INFO.
    Returns False (and changes nothing) when ``GRAFT_DEEPSPEED=0`` or ``GRAFT_DISABLE=all``,
    or when graft takes no part;
    raises a clear :class:`graft.errors.GraftError` when DeepSpeed is missing or its version
    is outside :data:`SUPPORTED`.
    """
    global _active
    integ = integration()
    ok, why = integ.status()
    if not ok and why in ("GRAFT_DISABLE=all", f"{ENV_VAR}=0"):
        log.info("graft's DeepSpeed integration is off: %s", why)
        return False
    integ.check_version()  # missing or unsupported DeepSpeed: a clear error, not a half-working patch
    from graft.integration import log_part_off

    unavailable = integ.unavailable_parts()
    for part, reason in unavailable.items():  # graft cannot serve that part's ops: DeepSpeed keeps its own
        log_part_off("deepspeed", part, reason)
    off = integ.left_parts(unavailable)
    for part, reason in off.items():  # graft is not known faster: DeepSpeed's own code stays, untouched
        if part not in unavailable:
            logging.getLogger("graft.integration.deepspeed").info(
                "graft: DeepSpeed's %s stays DeepSpeed's own code: %s", part, reason)
    if len(off) == len(integ.needs):
        if len(unavailable) < len(off):
            integ.report_layers()
        return False
    with _lock:
        if _active:
            return True
        from deepspeed.accelerator import get_accelerator, set_accelerator

        from graft.adapters.deepspeed import comm, op_builders
        from graft.adapters.deepspeed.accelerator import GraftAccelerator

        current = get_accelerator()
        if "adam" not in off and not isinstance(current, GraftAccelerator):
            wrapped = GraftAccelerator(current)
            set_accelerator(wrapped)
            _undo.append(lambda: set_accelerator(current))
            served = {n: b for n, b in op_builders.BUILDERS.items() if wrapped.graft_serves(n)}
            records = _rebind_builders(current, served)
            _undo.append(lambda: _restore(records))
        if "comm" not in off:
            _undo.append(comm.install())
        _active = True
        log.info("graft's DeepSpeed integration is active (accelerator %s, builders %s, comm %s)",
                 current.__class__.__name__, "DeepSpeed's" if "adam" in off else ", ".join(sorted(op_builders.BUILDERS)),
                 "DeepSpeed's" if "comm" in off else "routed")
        integ.report_layers()  # once: the parts served and those left to DeepSpeed, with reasons
        return True


def deactivate() -> None:
    """Undo :func:`activate` (tests use it; objects DeepSpeed built meanwhile keep graft's code)."""
    global _active
    with _lock:
        while _undo:
            _undo.pop()()
        _active = False


def status_lines() -> list:
    """What ``python -m graft.adapters.deepspeed`` prints: activates, then shows what is routed."""
    integ = integration()
    if not activate():
        return [f"graft DeepSpeed integration: off ({integ.status()[1]})"]
    import deepspeed.comm.comm as ds_comm
    import deepspeed.ops.op_builder as ds_builders
    import torch
    from deepspeed.accelerator import get_accelerator

    from graft.adapters.deepspeed import op_builders
    from graft.dispatch import select

    accelerator = get_accelerator()
    device = accelerator.device_name()
    x = torch.zeros(8, device="cuda" if device == "cuda" else "cpu")
    off = integ.left_parts()
    lines = [f"graft DeepSpeed integration: active ({integ.status()[1]})",
             f"  accelerator: {accelerator!r}",
             f"  comm: DeepSpeed's own ({off['comm']})" if "comm" in off else
             f"  comm backend class: {ds_comm.TorchBackend.__name__} (all_reduce, all_gather_into_tensor, "
             "reduce_scatter_tensor, all_gather -> graft collectives)"]
    for name, graft_builder in sorted(op_builders.BUILDERS.items()):
        if "adam" in off:
            lines.append(f"  {name}: DeepSpeed's ({off['adam']})")
            continue
        if getattr(ds_builders, name, None) is not graft_builder:
            lines.append(f"  {name}: DeepSpeed's (graft does not serve {device})")
            continue
        backend = select(graft_builder.GRAFT_OP, x, x, x, x, 1e-3, 0.9, 0.999, 1e-8, 1).backend
        lines.append(f"  {name}: graft ({graft_builder.GRAFT_OP}, {backend} implementation on {device})")
    return lines


# What graft served inside DeepSpeed, per entry point: e.g. "collectives.all_reduce" routed
# all-reduces, "fused.adam_step" tensors updated by graft's Adam (also under
# "<op>:<backend>"), "fallback.*" calls left to torch.distributed (each reason logged once
# on graft.integration.deepspeed).
counter = CallCounter("deepspeed")
