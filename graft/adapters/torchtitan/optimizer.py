"""TorchTitan's optimizer step on ``fused.adam_step``.

TorchTitan builds its optimizers from the job's ``optimizer`` config, an
``OptimizersContainer.Config`` whose param groups name ``"Adam"`` or ``"AdamW"``. The model
converter cannot reach it (it rewrites the model config), so the optimizer is switched by naming
graft's container in the job config instead, same fields:

    from graft.adapters.torchtitan.optimizer import GraftOptimizersContainer, graft_adamw
    optimizer = graft_adamw(lr=3e-4)                       # as torchtitan's default_adamw
    optimizer = GraftOptimizersContainer.Config(param_groups=[...])   # any OptimizersContainer.Config

Where graft is wanted for ``fused.adam_step`` (a ``GRAFT_*`` variable or a tuning table entry,
measured selection as for the model parts), ``"Adam"`` / ``"AdamW"`` build :class:`GraftAdam` /
:class:`GraftAdamW`: ``torch.optim.Adam`` / ``AdamW`` (same param groups, hyperparameters and
state keys, so TorchTitan's checkpointing and LR schedulers see the same optimizer) whose ``step``
updates a group's parameters with one in-place multi-tensor ``fused.adam_step_`` call. DTensor
parameters (FSDP2 shards, TP shards) update their local shard: Adam is elementwise, so a shard's update is exactly its part of the
full update. Otherwise, and for options graft's op does not take (``amsgrad``, ``maximize``,
``capturable``, ``differentiable``), torch's own optimizer runs, with the reason logged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer, default_adamw

from graft.adapters.torchtitan.integration import counter
from graft.ops.fused import adam_step_

log = logging.getLogger("graft.integration.torchtitan")

_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class _GraftAdamStep:
    """``step`` on ``fused.adam_step`` (mixed into torch's Adam / AdamW)."""

    _adam_w_mode: bool

    def _why_not(self, group) -> str | None:
        on = [k for k in _UNSUPPORTED if group.get(k)]
        if on:
            return f"{', '.join(on)} (graft's fused.adam_step does not take it)"
        if isinstance(group["lr"], torch.Tensor) and group["lr"].numel() != 1:
            return "a tensor lr with more than one element"
        return None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # type: ignore[attr-defined]
            why = self._why_not(group)
            if why is not None:
                counter.fallback(type(self).__name__, why)
                self._torch_group_step(group)
                continue
            beta1, beta2 = group["betas"]
            # Parameters that skipped steps (no gradient) have their own step count: one
            # in-place multi-tensor call (fused.adam_step_, as DeepSpeed's FusedAdam uses it)
            # per distinct count, normally one for the whole group.
            by_step: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]  # type: ignore[attr-defined]
                if len(state) == 0:  # torch's Adam state keys and dtypes (checkpoints stay compatible)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                by_step.setdefault(int(state["step"].item()), []).append(p)
            for step, params in by_step.items():
                states = [self.state[p] for p in params]  # type: ignore[attr-defined]
                backend = adam_step_(
                    [_local(p) for p in params], [_local(p.grad) for p in params],
                    [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states],
                    float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), step,
                    float(group["weight_decay"]), self._adam_w_mode, True)
                if backend is not None:
                    counter.served("fused.adam_step", backend, len(params))
        return loss

    def _torch_group_step(self, group):
        # torch's own step for this one group: the others stay as they are
        groups = self.param_groups  # type: ignore[attr-defined]
        self.param_groups = [group]  # type: ignore[attr-defined]
        try:
            super().step()  # type: ignore[misc]
        finally:
            self.param_groups = groups  # type: ignore[attr-defined]


class GraftAdamW(_GraftAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs ``fused.adam_step`` (decoupled weight decay)."""

    _adam_w_mode = True


class GraftAdam(_GraftAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` whose step runs ``fused.adam_step`` (L2 weight decay)."""

    _adam_w_mode = False


_GRAFT = {"Adam": GraftAdam, "AdamW": GraftAdamW}


def wanted() -> str | None:
    """Why graft should serve the optimizer step (measured selection); None: torch's own."""
    from graft.selection import graft_wanted

    return graft_wanted("fused.adam_step")


class GraftOptimizersContainer(OptimizersContainer):
    """TorchTitan's ``OptimizersContainer`` with Adam / AdamW on graft where graft is wanted."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        from graft.adapters.torchtitan import integration

        factory = OptimizersContainer._resolve_optimizer_factory(name)
        if name not in _GRAFT:
            log.info("graft: TorchTitan optimizer %s stays TorchTitan's (graft serves Adam and AdamW)", name)
            return factory
        if not integration.enabled():
            return factory
        off = integration.integration().layers()["left"].get("optimizer")
        if off:
            log.info("graft: TorchTitan's %s stays torch's: %s", name, off)
            return factory
        why = wanted()
        if why is None:
            log.info("graft: TorchTitan's %s stays torch's: graft is not known faster here (no GRAFT_* variable "
                     "orders, and no tuning table entry names graft for, fused.adam_step)", name)
            return factory
        log.info("graft: TorchTitan's %s steps on fused.adam_step (%s)", name, why)
        return _GRAFT[name]


def graft_adamw(lr: float = 8e-4, **kwargs) -> GraftOptimizersContainer.Config:
    """TorchTitan's ``default_adamw`` as graft's container config."""
    base = default_adamw(lr=lr, **kwargs)
    return GraftOptimizersContainer.Config(param_groups=base.param_groups, implementation=base.implementation,
                                           optimizer_factory_kwargs_by_name=base.optimizer_factory_kwargs_by_name)
