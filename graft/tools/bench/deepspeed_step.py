"""DeepSpeed training steps with graft's integration and without, in the same processes.

Two engines per ZeRO setting are built in one process group: one after
``graft.adapters.deepspeed.activate()`` (DeepSpeed's default FusedAdam, or DeepSpeedCPUAdam
for ZeRO-Offload, served by graft; collectives routed through graft) and one without, with
DeepSpeed's defaults: its FusedAdam / DeepSpeedCPUAdam as DeepSpeed builds them (a JIT C++
build on the CPU, done once before timing). Only where that build fails does the baseline
fall back to DeepSpeed's torch AdamW (``torch_adam``), and the row says so (``baseline``).
Steps alternate between them, with graft's integration switched on for the graft engine's
steps and off for the other's, so machine noise hits both alike.

By default graft takes no part of DeepSpeed it is not known faster for (no tuning table entry,
no ``GRAFT_*`` variable): the "with graft" engine would simply be DeepSpeed's. So the bench
chooses graft explicitly, with the user's ``GRAFT_BACKENDS`` or graft's default order, and
measures graft's code against DeepSpeed's (the row's ``graft_chosen`` says how).
"""
from __future__ import annotations

import os

import torch

from graft.tools.bench.timing import framework_steps

RUNS = ("2", "3", "2off")
WIDTH, LAYERS, BATCH = 256, 4, 8


def _model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def deepspeed_builds(run: str) -> str | None:
    """Build (or load the cached build of) the optimizer op DeepSpeed's default config uses for
    ``run``, graft off; None when it loads, else why not."""
    from deepspeed.accelerator import get_accelerator

    name = "CPUAdamBuilder" if run.endswith("off") else "FusedAdamBuilder"
    try:
        get_accelerator().create_op_builder(name).load(verbose=False)
    except BaseException as exc:  # a failed JIT build may raise SystemExit or RuntimeError
        return f"{name} build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _config(run: str, use_graft: bool, torch_adam: bool = False) -> dict:
    params: dict = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    if not use_graft and torch_adam:
        params["torch_adam"] = True
    zero: dict = {"stage": int(run[0]), "reduce_bucket_size": 1 << 20, "allgather_bucket_size": 1 << 20,
            "stage3_param_persistence_threshold": 0}
    if run.endswith("off"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def measure(runs, rounds: int, progress=print) -> list:
    import graft
    from graft import settings
    from graft.config import DEFAULT_BACKEND_PRIORITY

    backends = settings.raw("GRAFT_BACKENDS") or ",".join(DEFAULT_BACKEND_PRIORITY)
    with graft.override_config(GRAFT_BACKENDS=backends):
        rows = _measure(runs, rounds, progress)
    for row in rows:
        row["graft_chosen"] = f"GRAFT_BACKENDS={backends}"
    return rows


def _measure(runs, rounds: int, progress) -> list:
    import deepspeed
    import torch.distributed as dist

    import graft.adapters.deepspeed as graft_ds

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a C++ build only inference uses
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    rows = []
    for run in runs:
        graft_ds.deactivate()
        build_failed = deepspeed_builds(run)
        engines = {}
        for name, use_graft in (("graft", True), ("deepspeed", False)):
            if use_graft:
                graft_ds.activate()
            else:
                graft_ds.deactivate()
            model = _model()
            engines[name], *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                     config=_config(run, use_graft, torch_adam=bool(build_failed)))
        losses: dict[str, list] = {name: [] for name in engines}

        def step(name):
            engine = engines[name]
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())

        # Same model, data and AdamW math: the losses agree up to fp32 rounding (max_loss_diff).
        compared = framework_steps(
            {name: (lambda n=name: step(n)) for name in engines}, losses, graft_ds.calls, rounds, "deepspeed",
            before=lambda name: graft_ds.activate() if name == "graft" else graft_ds.deactivate(), sync=dist.barrier)
        graft_ds.deactivate()
        optimizer = engines["graft"].optimizer
        row = {"run": f"zero{run}", **compared,
               "graft_optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
               "baseline": (f"torch AdamW (torch_adam: DeepSpeed's {build_failed})" if build_failed else
                            "DeepSpeed's default optimizer as DeepSpeed builds it: " + type(getattr(
                                engines["deepspeed"].optimizer, "optimizer", engines["deepspeed"].optimizer)).__name__)}
        progress(f"  deepspeed ZeRO-{run:4s} step: without graft {row['deepspeed_ms']:7.2f} ms, with graft "
                 f"{row['graft_ms']:7.2f} ms -> {row['ratio']:.2f}x ({row['graft_optimizer']}; without graft: "
                 f"{row['baseline']})")
        rows.append(row)
        for engine in engines.values():
            engine.destroy()
    return rows
