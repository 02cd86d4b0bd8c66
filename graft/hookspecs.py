"""Hook specifications every graft adapter plugin may implement.

An adapter is any module or object with functions decorated by ``graft.hookspecs.hookimpl``,
advertised through the ``graft.adapters`` entry-point group::

    [project.entry-points."graft.adapters"]
    my_vendor = "my_vendor_graft.adapter"

All hooks are optional. Hooks are called in pluggy's order (last registered first;
``tryfirst``/``trylast`` adjust it).
"""
# mypy: disable-error-code="empty-body"
# (hook specifications are signatures only: pluggy never runs their bodies)
from __future__ import annotations

import pluggy

PROJECT = "graft"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def graft_adapter_info() -> dict:
    """Describe the adapter: ``{"description": ..., "vendor": ...}`` (name and version come from packaging)."""


@hookspec
def graft_register_ops(registry) -> None:
    """Define new ops (``registry.add_op(OpSpec(...))``). Runs for every adapter before any kernel hook."""


@hookspec
def graft_register_kernels(registry) -> None:
    """Register implementations (``registry.add_impl(Implementation(...))``) for ops in the four
    families (attention, gemm, moe, collectives) and the small ``fused`` helpers.
    ``Implementation.provider`` defaults to the plugin's name."""


@hookspec(firstresult=True)
def graft_default_backend_priority(device) -> list | None:
    """Default backend priority for a device (a :class:`graft.platform.DeviceInfo`), highest first.

    The first adapter that returns a list wins (vendor plugins use ``tryfirst``); the
    ``GRAFT_BACKENDS`` and per-op variables still override it.
    """


@hookspec
def graft_framework_integrations() -> list:
    """Return :class:`graft.integration.FrameworkIntegration` objects (vLLM, DeepSpeed, Megatron-core...)."""


@hookspec
def graft_conformance_cases(registry) -> list:
    """Return extra conformance cases (see ``graft.conformance``) for ops this adapter serves."""


@hookspec
def graft_conformance_baselines() -> list:
    """Return :class:`graft.conformance.baselines.Baseline` objects: a framework's own code
    for an op, which conformance times and checks graft's implementations against."""


@hookspec
def graft_patch_templates() -> list:
    """Return upstream-contribution patch templates (see ``graft.patches``)."""


@hookspec
def graft_upstream_projects() -> list:
    """Return :class:`graft.patches.projects.Project` objects: how to recognise an upstream
    source tree and its version, and the linters its contributions must pass."""
