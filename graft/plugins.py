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
import signal
import sys
import threading
from dataclasses import dataclass
from importlib import metadata

import pluggy
import torch

from graft import config, hookspecs
from graft.errors import GraftConfigError, GraftError
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
    builtin: bool = False  # one of graft's own adapters (its module is under graft.)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Backend names only graft's own adapters may register: a third-party plugin cannot displace
# graft's Triton/HIP/CPU C++ kernels or its torch reference (which under GRAFT_DISABLE=all must
# really be the reference). "torch" is allowed only as an op's own reference function.
RESERVED_BACKENDS = frozenset({"torch", "triton", "hip", "cpp"})


# Names of graft's own entry points (pyproject.toml): a third-party distribution's entry point of
# one of these names is refused (reported as failed), never allowed to displace graft's adapter.
RESERVED_PLUGIN_NAMES = frozenset({
    "torch", "triton", "hip", "cpp", "collectives", "vllm", "deepspeed", "megatron", "torchtitan"})
GRAFT_DISTRIBUTION = "graft"

# What each hook must return: None (the result is ignored), "dict", "priority", or a list whose
# items are instances of one of the named types ("module:Class", or str/PathLike/dict).
# Tool classes (graft.tools.*) are looked up in sys.modules, never imported: if the module is not
# loaded no object of its class can exist.
HOOK_RESULTS: dict = {
    "graft_adapter_info": "dict",
    "graft_register_ops": None,
    "graft_register_kernels": None,
    "graft_default_backend_priority": "priority",
    "graft_framework_integrations": ("graft.integration:FrameworkIntegration",),
    "graft_framework_implementations": ("graft.registry:Implementation",),
    "graft_tuning_tables": ("builtins:str", "os:PathLike", "builtins:dict"),
    "graft_conformance_cases": ("graft.cases:OpCase",),
    "graft_conformance_baselines": ("graft.baselines:Baseline",),
    "graft_patch_templates": ("graft.tools.patches.template:PatchTemplate",),
    "graft_upstream_projects": ("graft.tools.patches.projects:Project",),
}


def _resolve(dotted: str):
    module_name, _, cls = dotted.partition(":")
    module = sys.modules.get(module_name)
    if module is None and not module_name.startswith("graft.tools"):
        import importlib
        module = importlib.import_module(module_name)
    return getattr(module, cls, None) if module is not None else None


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


class _StagingRegistry:
    """Registry view handed to one plugin's hook: stamps Implementation.provider with the
    plugin's name and buffers what the hook registers. The buffer reaches the registry only
    if the hook returns normally, so a hook that raises half-way registers nothing."""

    def __init__(self, registry: Registry, plugin_name: str, builtin: bool):
        self._registry = registry
        self._plugin_name = plugin_name
        self._builtin = builtin
        self._ops: list = []
        self._impls: list = []

    def add_op(self, spec):
        if spec.name in self._registry.ops or any(o.name == spec.name for o in self._ops):
            self._registry.add_op(spec)  # raises its "already defined" error (or accepts the same spec)
            return spec
        self._ops.append(spec)
        return spec

    def add_ops(self, specs) -> None:
        for spec in specs:
            self.add_op(spec)

    def add_impl(self, impl: Implementation) -> Implementation:
        if not impl.provider:
            impl = dataclasses.replace(impl, provider=self._plugin_name)
        if not self._builtin and impl.backend in RESERVED_BACKENDS:
            spec = self._registry.ops.get(impl.op) or next((o for o in self._ops if o.name == impl.op), None)
            if not (impl.backend == "torch" and spec is not None and impl.fn is spec.reference):
                raise GraftError(
                    f"plugin {self._plugin_name!r} may not register backend {impl.backend!r} for {impl.op}: "
                    f"{', '.join(sorted(RESERVED_BACKENDS))} are graft's own backends (a plugin names its "
                    "backend after its vendor or library, e.g. 'acme')"
                )
        if impl.op not in self._registry.ops and not any(o.name == impl.op for o in self._ops):
            self._registry.add_impl(impl)  # raises its "unknown op" error
        self._impls.append(impl)
        return impl

    def commit(self) -> None:
        """Apply what the hook registered; on a conflict, undo it all and raise."""
        added_ops, added_impls = [], []
        try:
            for spec in self._ops:
                self._registry.add_op(spec)
                added_ops.append(spec)
            for impl in self._impls:
                if impl.backend == "torch" and any(
                        i.backend == "torch" and i.fn is impl.fn for i in self._registry.impls.get(impl.op, ())):
                    continue  # the op's reference is already registered
                self._registry.add_impl(impl)
                added_impls.append(impl)
        except Exception:
            for impl in added_impls:
                self._registry.impls[impl.op].remove(impl)
            for spec in added_ops:
                self._registry.ops.pop(spec.name, None)
                self._registry.impls.pop(spec.name, None)
            raise

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
        entry_points = sorted(metadata.entry_points(group=group), key=lambda e: (not _is_graft_own(e), e.name))
        _check_disabled_plugins(blocked, entry_points)
        for ep in entry_points:
            dist = getattr(ep, "dist", None)
            dist_name = dist.name if dist else None
            record = PluginRecord(
                ep.name, ep.value, dist_name, dist.version if dist else None, "loaded", builtin=_is_graft_own(ep),
            )
            refusal = None
            if not record.builtin and ep.name.lower() in RESERVED_PLUGIN_NAMES:
                refusal = (f"entry point {ep.name!r} of distribution {dist_name!r} refused: {ep.name!r} is a "
                           f"reserved name (graft's own adapters: {', '.join(sorted(RESERVED_PLUGIN_NAMES))}); "
                           "a plugin names its entry point after its vendor or library, e.g. 'acme'")
            elif ep.name in self.records:
                first = self.records[ep.name]
                if first.module == ep.value and first.distribution == dist_name:
                    continue  # the same entry point seen twice (one distribution on two paths)
                refusal = (f"entry point {ep.name!r} of distribution {dist_name!r} refused: the name is already "
                           f"taken by distribution {first.distribution!r} ({first.module})")
            if refusal is not None:
                key = f"{dist_name or ep.value}:{ep.name}"
                record.name, record.status, record.error = key, "failed", refusal
                self.records[key] = record
                self.hook_errors.append(refusal)
                log.warning("graft adapter plugin %s", refusal)
                continue
            self.records[ep.name] = record
            if ep.name.lower() in blocked:
                record.status = "disabled"
                record.error = "listed in GRAFT_DISABLE_PLUGINS"
                self.pm.set_blocked(ep.name)
                continue
            try:
                plugin = _load_entry_point(ep)
                self.pm.register(plugin, name=ep.name)
            except (Exception, SystemExit) as exc:  # a broken plugin must not break the others
                record.status = "failed"
                if isinstance(exc, SystemExit):
                    record.error = f"SystemExit: the plugin's import called sys.exit({exc.code!r})"
                elif isinstance(exc, _PluginKeyboardInterrupt):
                    record.error = "KeyboardInterrupt raised by the plugin's import (not a Ctrl-C)"
                else:
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
            info = fn()
            if info is None:
                return {}
            if not isinstance(info, dict):
                raise TypeError(f"expected a dict, got {_describe(info)}")
            return {str(k): v for k, v in info.items()}
        except (Exception, SystemExit) as exc:
            message = f"{name}.graft_adapter_info failed: {type(exc).__name__}: {exc}"
            self.hook_errors.append(message)
            log.warning("graft adapter %s", message)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def call_each(self, hook_name: str, **kwargs) -> list:
        """Call a hook plugin by plugin, isolating failures.

        Returns ``[(plugin_name, result), ...]``. A plugin whose hook raises is reported
        (its record says "failed" and why) and skipped, never fatal to the rest; what it
        registered before raising is discarded. graft's own adapters run first, so their
        backends are in place before any third-party plugin's.
        """
        caller = getattr(self.pm.hook, hook_name)
        hookimpls = list(reversed(caller.get_hookimpls()))
        hookimpls.sort(key=lambda h: not self._is_builtin(h.plugin_name))  # stable: keeps pluggy's order
        results = []
        for hookimpl in hookimpls:
            name = hookimpl.plugin_name
            call_kwargs = {k: v for k, v in kwargs.items() if k in hookimpl.argnames}
            staging = None
            if "registry" in call_kwargs:
                staging = _StagingRegistry(kwargs["registry"], name, self._is_builtin(name))
                call_kwargs["registry"] = staging
            try:
                result = hookimpl.function(**call_kwargs)
                result = self._validated(name, hook_name, result)
                if staging is not None:
                    staging.commit()
                results.append((name, result))
            except (Exception, SystemExit) as exc:
                message = f"{name}.{hook_name} failed: {type(exc).__name__}: {exc}"
                self.hook_errors.append(message)
                record = self.records.get(name)
                if record is not None:
                    record.error = message
                    if staging is not None:  # its registrations were discarded: it serves nothing
                        record.status = "failed"
                log.warning("graft adapter %s", message)
        return results

    def _hook_error(self, message: str) -> None:
        if message not in self.hook_errors:
            self.hook_errors.append(message)
            log.warning("graft adapter %s", message)

    def _validated(self, name: str, hook_name: str, result):
        """A hook's result in its declared shape (HOOK_RESULTS): a list hook's answer becomes
        a list of the expected items (wrong items dropped, each reported); an answer that is
        not a list at all raises (call_each reports it)."""
        expected = HOOK_RESULTS.get(hook_name, None)
        if expected is None or isinstance(expected, str):
            return result
        if result is None:
            return []
        if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
            raise TypeError(f"expected a list, got {_describe(result)}")
        items = list(result)  # an iterable that raises here is reported by call_each
        types = tuple(t for t in (_resolve(d) for d in expected) if t is not None)
        kept = []
        for item in items:
            if types and isinstance(item, types):
                kept.append(item)
            else:
                wanted = " or ".join(d.partition(":")[2] for d in expected)
                self._hook_error(f"{name}.{hook_name}: item dropped: expected {wanted}, got {_describe(item)}")
        return kept

    def _is_builtin(self, name: str) -> bool:
        record = self.records.get(name)
        return record is not None and record.builtin

    @property
    def registry(self) -> Registry:
        if self._registry is not None:  # lock-free fast path for every op call
            return self._registry
        with self._lock:
            if self._registry is None:
                registry = Registry(default_priority=self._default_priority_for)
                self.call_each("graft_register_ops", registry=registry)
                self.call_each("graft_register_kernels", registry=registry)
                self._add_framework_implementations(registry)
                self._registry = registry
            return self._registry

    def _add_framework_implementations(self, registry: Registry) -> None:
        """The frameworks' own code for the ops their integrations replace (see
        graft.framework_backend): one plugin's bad entry is reported, the others register."""
        for name, impls in self.call_each("graft_framework_implementations"):
            for impl in impls or ():
                try:
                    if not impl.framework or impl.backend != impl.framework:
                        raise GraftError(f"{impl.op}: a framework implementation's backend must be its framework's "
                                         f"name (got backend {impl.backend!r}, framework {impl.framework!r}); build "
                                         "it with graft.framework_backend.implementation")
                    if impl.backend in RESERVED_BACKENDS:
                        raise GraftError(f"{impl.op}: backend {impl.backend!r} is one of graft's own "
                                         f"({', '.join(sorted(RESERVED_BACKENDS))}), not a framework's")
                    registry.add_impl(impl if impl.provider else dataclasses.replace(impl, provider=name))
                except GraftError as exc:
                    message = f"{name}.graft_framework_implementations: {exc}"
                    self.hook_errors.append(message)
                    log.warning("graft adapter %s", message)

    def default_priority(self, device) -> tuple | None:
        """The first plugin's valid answer (pluggy's order: tryfirst first); a plugin whose hook
        raises or answers something other than a list of backend names is reported (hook_errors)
        and skipped; names no plugin registered are dropped (reported)."""
        hook_name = "graft_default_backend_priority"
        known = None
        if self._registry is not None:
            known = set(self._registry.backends()) | {config.REFERENCE_BACKEND}
        for hookimpl in reversed(self.pm.hook.graft_default_backend_priority.get_hookimpls()):
            name = hookimpl.plugin_name
            try:
                result = hookimpl.function(**({"device": device} if "device" in hookimpl.argnames else {}))
                if result is None:
                    continue
                if not isinstance(result, (list, tuple)) or not all(isinstance(b, str) for b in result):
                    raise TypeError(f"expected a list of backend names, got {_describe(result)}")
            except (Exception, SystemExit) as exc:
                self._hook_error(f"{name}.{hook_name} ignored: {type(exc).__name__}: {exc}")
                continue
            names = tuple(b.strip().lower() for b in result if b.strip())
            if known is not None:
                unknown = [b for b in names if b not in known]
                if unknown:
                    self._hook_error(f"{name}.{hook_name}: unknown backend(s) {', '.join(map(repr, unknown))} "
                                     f"dropped (known: {', '.join(sorted(known))})")
                names = tuple(b for b in names if b in known)
            if names:
                return names
        return None

    def _default_priority_for(self, device_type: str, arch: str | None) -> tuple | None:
        from graft.platform import DeviceInfo

        return self.default_priority(DeviceInfo(device_type, "", arch or device_type, ""))

    def collect(self, hook_name: str, **kwargs) -> list:
        """Flatten list-returning hooks (integrations, conformance cases, patch templates)."""
        items: list = []
        for _, result in self.call_each(hook_name, **kwargs):
            items.extend(result or [])
        return items


def _is_graft_own(ep) -> bool:
    """An entry point of graft's own distribution pointing into the graft package."""
    dist = getattr(ep, "dist", None)
    dist_name = (dist.name if dist else "") or ""
    return ep.value.startswith("graft.") and dist_name.lower().replace("_", "-") == GRAFT_DISTRIBUTION


class _PluginKeyboardInterrupt(Exception):
    """A KeyboardInterrupt the plugin's import raised itself (no SIGINT arrived)."""


def _load_entry_point(ep):
    """ep.load(), telling a real Ctrl-C (re-raised: it still interrupts) apart from a
    KeyboardInterrupt the plugin's import raises itself (_PluginKeyboardInterrupt: the
    plugin is reported as failed). Outside the main thread no signal handler can be set and
    the two cannot be told apart: reported as a failed plugin, as the issue asks."""
    interrupted = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGINT)

            def _on_sigint(signum, frame):
                interrupted.append(signum)
                if callable(previous):
                    previous(signum, frame)
                elif previous != signal.SIG_IGN:
                    raise KeyboardInterrupt

            signal.signal(signal.SIGINT, _on_sigint)
        except (ValueError, OSError, TypeError):
            previous = None
    try:
        return ep.load()
    except KeyboardInterrupt as exc:
        if interrupted:
            raise
        raise _PluginKeyboardInterrupt() from exc
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


# Plugins that define graft itself: without them no op exists, so they cannot be disabled.
ESSENTIAL_PLUGINS = frozenset({"torch"})


def _check_disabled_plugins(blocked: set, entry_points) -> None:
    names = {ep.name.lower() for ep in entry_points}
    unknown = sorted(blocked - names)
    if unknown:
        raise GraftConfigError(
            f"GRAFT_DISABLE_PLUGINS: unknown plugin(s) {', '.join(repr(u) for u in unknown)}; "
            f"installed adapter plugins are: {', '.join(sorted(names))}"
        )
    essential = sorted(blocked & ESSENTIAL_PLUGINS)
    if essential:
        raise GraftConfigError(
            f"GRAFT_DISABLE_PLUGINS: {', '.join(repr(e) for e in essential)} defines graft's ops and their torch "
            "references and cannot be disabled; to run no optimized kernel use GRAFT_DISABLE=all"
        )


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


def register_kernel_modules(package_name: str, registry) -> list:
    """Call ``register(registry)`` of every public module of a backend's package (its
    ``plugin`` module, which holds the hooks, excepted); returns ``[(module, error or None)]``.

    A module that fails to import (a missing dependency, say) is logged and skipped so the
    backend's other kernels still register.
    """
    import importlib
    import pkgutil

    package = importlib.import_module(package_name)
    outcomes: list[tuple[str, str | None]] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "plugin":
            continue
        name = f"{package_name}.{info.name}"
        try:
            module = importlib.import_module(name)
            register = getattr(module, "register", None)
            if register is not None:
                register(registry)
            outcomes.append((name, None))
        except Exception as exc:
            log.warning("kernel module %s not registered: %s: %s", name, type(exc).__name__, exc)
            outcomes.append((name, f"{type(exc).__name__}: {exc}"))
    return outcomes
