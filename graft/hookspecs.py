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
def graft_framework_implementations() -> list:
    """Return :class:`graft.registry.Implementation` objects running a framework's OWN code for
    the graft ops its integration replaces (build them with
    :func:`graft.framework_backend.implementation`): the backend is named after the framework
    (``vllm``, ``deepspeed``, ``megatron``, ``torchtitan``...). They compete with graft's
    backends like any other: selection ranks them first where no ``GRAFT_*`` variable sets the
    order and no tuning table (``graft tune``) says another backend is faster, so graft steps
    aside where it does not know it wins. They serve only in a process where the framework's
    integration enabled them (:func:`graft.framework_backend.enable`, from its ``activate``)
    or ``graft tune`` measures them."""


@hookspec
def graft_tuning_tables() -> list:
    """Return tuning tables a plugin ships (paths to JSON files, or the parsed dicts) in the
    format of :mod:`graft.tuning`, as vLLM ships fused_moe configs: a vendor's measured
    choices for its devices. A table whose device or versions differ from this machine's is
    ignored (``graft info`` says why); ``GRAFT_TUNING_TABLE`` files take precedence."""


@hookspec
def graft_conformance_cases(registry) -> list:
    """Return extra conformance cases (see ``graft.tools.conformance``) for ops this adapter serves."""


@hookspec
def graft_conformance_baselines() -> list:
    """Return :class:`graft.baselines.Baseline` objects: a framework's own code
    for an op, which conformance times and checks graft's implementations against."""


@hookspec
def graft_patch_templates() -> list:
    """Return upstream-contribution patch templates (see ``graft.tools.patches``)."""


@hookspec
def graft_upstream_projects() -> list:
    """Return :class:`graft.tools.patches.projects.Project` objects: how to recognise an upstream
    source tree and its version, and the linters its contributions must pass."""
