"""The plugin host: loads adapter plugins from entry points and builds the op registry.

Entry points of group ``graft.adapters`` are loaded one by one so that a broken
plugin is reported (``graft info`` shows why) instead of breaking every other one.
Graft's own adapters (torch reference, Triton, HIP/CUDA, framework integrations)
are registered through the same entry points as third-party ones.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata

import pluggy
import torch

from graft import config, hookspecs
from graft.registry import Implementation, Registry

log = logging.getLogger("graft.plugins")

ENTRY_POINT_GROUP = "graft.adapters"


@dataclass
class PluginRecord:
    name: str
    module: str
    distribution: str | None
    version: str | None
    status: str  # "loaded", "disabled" or "failed"
    error: str | None = None
    info: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _ProviderStampingRegistry:
    """Registry view handed to one plugin: fills Implementation.provider with the plugin's name."""

    def __init__(self, registry: Registry, plugin_name: str):
        self._registry = registry
        self._plugin_name = plugin_name

    def add_impl(self, impl: Implementation) -> Implementation:
        if not impl.provider:
            impl = dataclasses.replace(impl, provider=self._plugin_name)
        return self._registry.add_impl(impl)

    def __getattr__(self, name):
        return getattr(self._registry, name)


class PluginHost:
    """Owns the pluggy PluginManager, the load records and the registry built from them."""

    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.hook_errors: list[str] = []
        self._registry: Registry | None = None
        self._lock = threading.RLock()
        if load_entry_points:
            self.load_entry_points()

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        blocked = set(config.split_list(config.current().get("GRAFT_DISABLE_PLUGINS")))
        for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
            if ep.name in self.records:
                continue  # the same name installed twice: first one wins
            dist = getattr(ep, "dist", None)
            record = PluginRecord(
                ep.name, ep.value, dist.name if dist else None, dist.version if dist else None, "loaded"
            )
            self.records[ep.name] = record
            if ep.name.lower() in blocked:
                record.status = "disabled"
                record.error = "listed in GRAFT_DISABLE_PLUGINS"
                self.pm.set_blocked(ep.name)
                continue
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:  # a broken plugin must not break the others
                record.status = "failed"
                record.error = f"{type(exc).__name__}: {exc}"
                log.warning("graft adapter plugin %r (%s) failed to load: %s", ep.name, ep.value, record.error)
                continue
            record.info = self._adapter_info(ep.name)

    def register(self, plugin, name: str, version: str | None = None) -> None:
        """Register an in-process plugin object (tests, embedding applications)."""
        self.pm.register(plugin, name=name)
        self.records[name] = PluginRecord(name, getattr(plugin, "__name__", repr(plugin)), None, version, "loaded")
        self.records[name].info = self._adapter_info(name)
        self._registry = None

    def _adapter_info(self, name: str) -> dict:
        plugin = self.pm.get_plugin(name)
        fn = getattr(plugin, "graft_adapter_info", None)
        if fn is None:
            return {}
        try:
            return dict(fn() or {})
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def call_each(self, hook_name: str, **kwargs) -> list:
        """Call a hook plugin by plugin (pluggy's order), isolating failures.

        Returns ``[(plugin_name, result), ...]``. A plugin whose hook raises is
        reported and skipped, never fatal to the rest.
        """
        caller = getattr(self.pm.hook, hook_name)
        results = []
        for hookimpl in reversed(caller.get_hookimpls()):
            name = hookimpl.plugin_name
            call_kwargs = {k: v for k, v in kwargs.items() if k in hookimpl.argnames}
            if "registry" in call_kwargs:
                call_kwargs["registry"] = _ProviderStampingRegistry(kwargs["registry"], name)
            try:
                results.append((name, hookimpl.function(**call_kwargs)))
            except Exception as exc:
                message = f"{name}.{hook_name} failed: {type(exc).__name__}: {exc}"
                self.hook_errors.append(message)
                if name in self.records:
                    self.records[name].error = message
                log.warning("graft adapter %s", message)
        return results

    @property
    def registry(self) -> Registry:
        if self._registry is not None:  # lock-free fast path for every op call
            return self._registry
        with self._lock:
            if self._registry is None:
                registry = Registry(default_priority=self._default_priority_for)
                self.call_each("graft_register_ops", registry=registry)
                self.call_each("graft_register_kernels", registry=registry)
                self._registry = registry
            return self._registry

    def default_priority(self, device) -> tuple | None:
        result = self.pm.hook.graft_default_backend_priority(device=device)
        return tuple(b.lower() for b in result) if result else None

    def _default_priority_for(self, device_type: str, arch: str | None) -> tuple | None:
        from graft.platform import DeviceInfo

        return self.default_priority(DeviceInfo(device_type, "", arch or device_type, ""))

    def collect(self, hook_name: str, **kwargs) -> list:
        """Flatten list-returning hooks (integrations, conformance cases, patch templates)."""
        items = []
        for _, result in self.call_each(hook_name, **kwargs):
            items.extend(result or [])
        return items


_host: PluginHost | None = None
_host_lock = threading.Lock()


def get_host() -> PluginHost:
    host = _host
    if host is not None:  # lock-free fast path: every op call comes through here
        return host
    if torch.compiler.is_compiling():
        # The very first graft call happens while torch.compile traces: load eagerly, outside
        # the graph (one graph break). Load graft first (graft.get_registry()) to compile
        # with fullgraph=True from a cold start. (Wrapped here, not at import: decorating at
        # import would import torch._dynamo, and with it triton, into every graft process.)
        return torch.compiler.disable(_load_host, reason="graft loads its adapter plugins eagerly")()
    return _load_host()


def _load_host() -> PluginHost:
    global _host
    with _host_lock:
        if _host is None:
            config.configure_logging()
            host = PluginHost()
            host.registry  # build it now: op calls then never meet the build lock
            _host = host
        return _host


def get_registry() -> Registry:
    return get_host().registry


def reset() -> None:
    """Drop the loaded plugins and registry; the next use reloads from entry points."""
    global _host
    from graft import selection

    with _host_lock:
        _host = None
    config.reload()
    selection.reset_caches()
