"""graft adapter plugin for DeepSpeed (entry point ``deepspeed`` in group ``graft.adapters``).

Declares the DeepSpeed framework integration; loading the plugin does not import DeepSpeed.
"""
from graft.hookspecs import hookimpl


@hookimpl
def graft_adapter_info():
    return {"description": "DeepSpeed integration: accelerator wrapper (FusedAdam via fused.adam_step) "
                           "and deepspeed.comm routing to graft collectives"}


@hookimpl
def graft_framework_integrations():
    from graft.adapters.deepspeed.activation import integration

    return [integration()]


@hookimpl
def graft_patch_templates():
    from graft.adapters.deepspeed import patch

    return patch.templates()


@hookimpl
def graft_upstream_projects():
    from graft.adapters.deepspeed import patch

    return [patch.PROJECT]
