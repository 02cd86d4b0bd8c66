"""The TorchTitan job driver the tests use lives in graft.tools.bench.torchtitan_step (the bench
times the same steps); its docstring lists the CPU shims and the Trainer parts not run."""
from graft.tools.bench.torchtitan_step import (  # noqa: F401
    Job, attention_masks, build_model, cpu_attention, model_spec, shrink, train_ranks)
