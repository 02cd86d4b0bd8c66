"""graft's built-in upstream patch templates, one module per framework."""
from __future__ import annotations


def builtin_templates() -> list:
    from graft.patches.templates import deepspeed, megatron, vllm

    return [*vllm.templates(), *deepspeed.templates(), *megatron.templates()]
