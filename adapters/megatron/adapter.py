"""graft adapter plugin for Megatron-core (entry point ``megatron`` in group ``graft.adapters``).

Declares the Megatron-core framework integration; loading the plugin does not import Megatron.
"""
from graft.hookspecs import hookimpl


@hookimpl
def graft_adapter_info():
    return {"description": "Megatron-core integration: ModuleSpec provider (RMSNorm, linears, core attention, "
                           "MoE experts on graft ops)"}


@hookimpl
def graft_framework_integrations():
    from graft.adapters.megatron.activation import integration

    return [integration()]


@hookimpl
def graft_patch_templates():
    from graft.adapters.megatron import patch

    return patch.templates()


@hookimpl
def graft_upstream_projects():
    from graft.adapters.megatron import patch

    return [patch.PROJECT]
