"""One rank of a small DeepSpeed ZeRO training run, for tests/test_deepspeed_integration.py.

Run once per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set::

    python tests/_ds_train.py --graft 1 --stages 1,2,3,2off --steps 4 --out result.json

For each ZeRO stage (and stage 2 with optimizer offload) it trains the same 2-layer MLP (same seed, same rank-dependent data)
and records this rank's loss per step. ``--graft 1`` activates graft's DeepSpeed
integration before ``deepspeed.initialize`` and uses DeepSpeed's default Adam (FusedAdam,
served by graft); ``--graft 0`` is plain DeepSpeed with its torch AdamW
(``torch_adam: true``), since DeepSpeed's own CPU FusedAdam would first JIT-compile a C++
extension (minutes). Each rank writes ``<out>.rank<N>``: losses, optimizer class per stage,
graft's call counters per stage and the accelerator class.
"""
import argparse
import json
import os

import torch

HIDDEN = 32
FEATURES = 16
BATCH = 8


def make_model():
    torch.manual_seed(1234)  # identical initial weights in every run and on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 4)
    )


def make_batches(rank, steps):
    gen = torch.Generator().manual_seed(100 + rank)  # ranks see different data: reductions matter
    return [(torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, 4, generator=gen)) for _ in range(steps)]


def ds_config(run, use_graft):
    """``run`` is a ZeRO stage ("1", "2", "3"), or "2off": stage 2 with the optimizer offloaded
    to the CPU (DeepSpeedCPUAdam when graft is active)."""
    stage = int(run[0])
    params = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    if not use_graft:
        params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": dict(
            {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500,
             "stage3_param_persistence_threshold": 0},
            **({"offload_optimizer": {"device": "cpu"}} if run.endswith("off") else {})),
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }


def train(stage, steps, use_graft, rank):
    import deepspeed

    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, use_graft))
    losses = []
    for x, y in make_batches(rank, steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    optimizer = type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer)
    engine.destroy()
    return losses, optimizer.__name__


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--graft", type=int, default=1)
    parser.add_argument("--stages", default="1,2,3,2off")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = parser.parse_args()

    import deepspeed

    # DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce extension (minutes
    # on a small CI machine) that only its inference all-reduce uses; both runs skip it
    # through DeepSpeed's own compatibility table, which is documented to persist edits.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if args.graft:
        import graft.adapters.deepspeed as graft_ds

        assert graft_ds.activate(), "graft's DeepSpeed integration did not activate"
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    result = {"losses": {}, "optimizers": {}, "calls": {}}
    for stage in args.stages.split(","):
        before = dict(graft_ds.calls) if args.graft else {}
        result["losses"][stage], result["optimizers"][stage] = train(stage, args.steps, bool(args.graft), rank)
        if args.graft:  # what graft served during this stage's run
            result["calls"][stage] = {k: v - before.get(k, 0) for k, v in graft_ds.calls.items() if v - before.get(k, 0)}
    # The all-reduce of DeepSpeed's tensor-parallel inference (AutoTP), in place.
    before = dict(graft_ds.calls) if args.graft else {}
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    deepspeed.comm.inference_all_reduce(t)
    result["inference_all_reduce"] = t.tolist()
    if args.graft:
        result["calls"]["inference"] = {k: v - before.get(k, 0) for k, v in graft_ds.calls.items()
                                        if v - before.get(k, 0)}
    from deepspeed.accelerator import get_accelerator

    result["accelerator"] = type(get_accelerator()).__name__
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
