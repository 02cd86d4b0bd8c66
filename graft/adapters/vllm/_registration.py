"""Registering a graft class in vLLM's out-of-tree registry, idempotently and politely."""
from __future__ import annotations


def register_oot(in_tree_cls: type, graft_cls: type) -> str:
    """Make vLLM instantiate ``graft_cls`` wherever it builds ``in_tree_cls``.

    vLLM keys its out-of-tree registry by the in-tree class name and swaps the class in
    ``CustomOp.__new__`` / ``PluggableLayer.__new__``. Another plugin that already
    replaced the same layer keeps it (first come, first served), and we say so.
    """
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot

    key = in_tree_cls.__name__
    existing = op_registry_oot.get(key)
    if existing is graft_cls:
        return "registered"
    if existing is not None:
        return f"skipped: vLLM's {key} is already replaced by {existing.__module__}.{existing.__qualname__}"
    base = CustomOp if issubclass(in_tree_cls, CustomOp) else PluggableLayer
    base.register_oot(graft_cls, name=key)
    # register_oot renames the class to the registry key ("RMSNorm"); restore the in-tree
    # name ("rms_norm") so vLLM's custom_ops switches (-rms_norm / +rms_norm) still apply.
    in_tree_name = getattr(in_tree_cls, "name", None)
    if in_tree_name:
        setattr(graft_cls, "name", in_tree_name)  # a class attribute vLLM declares on CustomOp
    return "registered"
