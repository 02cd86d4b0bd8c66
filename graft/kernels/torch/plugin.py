"""The torch backend's hooks: defines graft's op catalogue and serves every op with its torch reference.

The reference is the semantics every other backend must match, and the fallback
when nothing faster can serve a request.
"""
import importlib
import pkgutil

from graft.hookspecs import hookimpl
from graft.registry import reference_impl


@hookimpl
def graft_adapter_info():
    return {"description": "op catalogue and torch reference implementations (always available)"}


@hookimpl
def graft_register_ops(registry):
    from graft.ops import all_op_specs

    registry.add_ops(all_op_specs())


def fast_path_modules():
    """This folder's modules of torch fast paths (one per op family, e.g. ``graft.kernels.torch.attention``)."""
    import graft.kernels.torch as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.startswith("_") and info.name != "plugin":
            yield importlib.import_module(f"{package.__name__}.{info.name}")


@hookimpl(trylast=True)
def graft_register_kernels(registry):
    # trylast: ops defined by any adapter get a reference impl too.
    for spec in list(registry.ops.values()):
        if not any(i.backend == "torch" for i in registry.impls[spec.name]):
            registry.add_impl(reference_impl(spec, provider=""))
    # Where torch has a faster kernel for the same math, graft's torch backend uses it
    # (ranked above the reference, which stays the definition and last resort).
    # Each module of this folder lists those in ``torch_implementations()``.
    for module in fast_path_modules():
        for impl in module.torch_implementations():
            if impl.op in registry.ops:
                registry.add_impl(impl)
