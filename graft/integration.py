"""Framework integrations: how an adapter plugs graft into vLLM, DeepSpeed or Megatron-core.

An adapter returns :class:`FrameworkIntegration` objects from the
``graft_framework_integrations`` hook. Each is version-gated with ``packaging``:
activating it on a framework version outside ``supported`` raises a clear error.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from graft import config
from graft.errors import GraftDependencyError, GraftError

log = logging.getLogger("graft.integration")


@dataclass
class FrameworkIntegration:
    name: str  # e.g. "vllm"
    distribution: str  # PyPI distribution whose version is gated, e.g. "vllm"
    supported: str  # PEP 440 specifier, e.g. ">=0.33,<0.34"
    activate: Callable[[], object]  # does the injection; idempotent
    description: str = ""
    env_var: str | None = None  # GRAFT_* variable that turns just this integration off
    notes: list = field(default_factory=list)

    def installed_version(self) -> str | None:
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            return None

    def status(self) -> tuple[bool, str]:
        """(can activate, why) without activating."""
        if "all" in config.split_list(os.environ.get("GRAFT_DISABLE")):
            return False, "GRAFT_DISABLE=all"
        if self.env_var and not config.parse_bool(self.env_var, True):
            return False, f"{self.env_var}=0"
        version = self.installed_version()
        if version is None:
            return False, f"{self.distribution} is not installed"
        try:
            ok = Version(version) in SpecifierSet(self.supported, prereleases=True)
        except InvalidVersion:
            return False, f"{self.distribution} version {version!r} is not a valid version"
        if not ok:
            return False, f"{self.distribution} {version} is outside the supported range {self.supported}"
        return True, f"{self.distribution} {version} is within {self.supported}"

    def check_version(self) -> str:
        """Raise a clear error unless the installed framework is in the supported range."""
        version = self.installed_version()
        if version is None:
            raise GraftDependencyError(f"graft's {self.name} integration needs {self.distribution}, which is not installed")
        ok, why = self.status()
        if not ok and ("outside" in why or "valid version" in why):
            raise GraftError(f"graft's {self.name} integration does not support this version: {why}")
        return version


def integrations() -> list:
    from graft.plugins import get_host

    return get_host().collect("graft_framework_integrations")
