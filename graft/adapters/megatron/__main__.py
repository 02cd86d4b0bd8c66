"""``python -m graft.adapters.megatron``: show which graft module serves each submodule of
the GPT layer spec, and which implementation of each graft op would run on this machine."""
import sys

from graft.adapters.megatron.integration import ENV_VAR, enabled, integration


def _classes(spec, prefix=""):
    """(path, class name) for every module class in a ModuleSpec tree."""
    from dataclasses import fields, is_dataclass

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        yield prefix or "layer", spec.module.__name__
        spec = spec.submodules
    if is_dataclass(spec):
        for f in fields(spec):
            yield from _classes(getattr(spec, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(spec, type):
        yield prefix, spec.__name__


def main() -> int:
    integ = integration()
    if not enabled():
        print(f"graft Megatron-core integration: off ({integ.status()[1]}); "
              f"get_gpt_layer_graft_spec() returns Megatron's local spec")
        return 0
    import torch

    from graft.adapters.megatron import get_gpt_layer_graft_spec
    from graft.platform import default_device
    from graft.selection import explain
    from graft.plugins import get_registry

    print(f"graft Megatron-core integration: active ({integ.status()[1]}); set {ENV_VAR}=0 to turn it off")
    for title, kwargs in (("dense", {}), ("MoE (4 experts)", {"num_experts": 4})):
        print(f"get_gpt_layer_graft_spec({', '.join(f'{k}={v}' for k, v in kwargs.items())}) [{title}]:")
        for path, name in _classes(get_gpt_layer_graft_spec(**kwargs)):
            if name.startswith("Graft"):
                print(f"  {path:<42} {name}")
    device = default_device()
    print(f"graft ops on {device}:")
    for op in ("fused.rms_norm", "fused.layer_norm", "gemm.linear", "attention.prefill", "moe.fused_experts"):
        decision = explain(get_registry(), op, device=device, dtype=torch.float16)
        print(f"  {op:<20} -> {decision.selected.backend if decision.selected else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
