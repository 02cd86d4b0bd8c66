"""One rank of a Megatron GPTModel at tensor-parallel size WORLD_SIZE, built from graft's
layer spec and from Megatron's local spec with the same weights, for tests/test_megatron_tp.py.

Each rank runs two forward/backward steps of both models on the same batch and writes
``<out>.rank<N>``: both models' losses, the largest gradient difference per parameter, and
graft's Megatron call counters.
"""
import argparse
import json

import torch
import torch.distributed as dist

from graft.tools.bench import megatron_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from graft.adapters.megatron.integration import counter

    tp = dist.get_world_size()
    tokens, positions, labels, mask = megatron_step.batch()
    result = {"losses": {"local": [], "graft": []}, "grad_diff": {}}
    with megatron_step.model_parallel(tp):
        local, grafted = megatron_step.build_pair(tp)
        counter.reset()
        for _ in range(2):
            for name, model, m in (("local", local, mask), ("graft", grafted, None)):
                loss = model(tokens, positions, attention_mask=m, labels=labels).mean()
                loss.backward()
                result["losses"][name].append(loss.item())
            graft_params = dict(grafted.named_parameters())
            for name, p in local.named_parameters():
                q = graft_params[name]
                diff = (q.grad - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-12)
                result["grad_diff"][name] = max(diff, result["grad_diff"].get(name, 0.0))
                p.grad = q.grad = None
        result["calls"] = dict(counter.calls)
        import graft

        result["served"] = graft.served_calls("megatron")  # the public view of the same counters
    with open(f"{args.out}.rank{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
