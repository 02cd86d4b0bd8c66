"""graft's TorchTitan integration: a model converter (TorchTitan's own extension point,
``ModelConfigConverter``) that swaps module configs in a model's config tree for graft's
subclasses, whose forward runs graft ops.

    from graft.adapters.torchtitan import GraftConverter
    model_spec = model_registry("debugmodel", converters=[GraftConverter.Config()])

The optimizer step is switched in the job's optimizer config instead (the converter rewrites
only the model config): :mod:`.optimizer` (``graft_adamw``, ``GraftOptimizersContainer``).

Importing this package imports nothing of TorchTitan; :mod:`.converter` does.
"""
from __future__ import annotations


def __getattr__(name):
    if name in ("GraftConverter", "GraftRMSNorm", "GraftFeedForward", "GraftVarlenAttention", "GraftRoutedExperts"):
        from graft.adapters.torchtitan import converter, modules

        return getattr(converter if name == "GraftConverter" else modules, name)
    raise AttributeError(name)
