"""Built-in adapter: contributes graft's upstream patch templates (vLLM, DeepSpeed, Megatron-core)."""
from graft.hookspecs import hookimpl


@hookimpl
def graft_adapter_info():
    return {"description": "upstream-contribution patch templates (graft patches)"}


@hookimpl
def graft_patch_templates():
    from graft.patches.templates import builtin_templates

    return builtin_templates()
