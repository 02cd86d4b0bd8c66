"""Read a framework's version from its source tree (a git checkout or an unpacked sdist)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from packaging.version import InvalidVersion, Version

from graft.patches.template import PatchError

FRAMEWORKS = ("vllm", "deepspeed", "megatron")


def _vllm(root: Path) -> str | None:
    # Built trees and sdists carry vllm/_version.py (vcs-versioning); plain checkouts use tags.
    generated = root / "vllm" / "_version.py"
    if generated.is_file():
        m = re.search(r"""^__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", generated.read_text(), re.M)
        if m:
            return m.group(1)
    return _git_tag_version(root)


def _deepspeed(root: Path) -> str | None:
    for candidate in (root / "version.txt", root / "deepspeed" / "git_version_info_installed.py"):
        if candidate.is_file():
            m = re.search(r"(\d+\.\d+\.\d+[\w.+-]*)", candidate.read_text())
            if m:
                return m.group(1)
    return _git_tag_version(root)


def _megatron(root: Path) -> str | None:
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", text, re.M)
        if not m:
            return None
        parts[key] = m.group(1)
    pre = re.search(r"""^PRE_RELEASE\s*=\s*['"]([^'"]*)['"]""", text, re.M)
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{pre.group(1) if pre else ''}"


def _git_tag_version(root: Path) -> str | None:
    try:
        tag = subprocess.run(["git", "-C", str(root), "describe", "--tags", "--abbrev=0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tag.lstrip("v") or None


_DETECTORS = {"vllm": _vllm, "deepspeed": _deepspeed, "megatron": _megatron}
_MARKERS = {"vllm": "vllm", "deepspeed": "deepspeed", "megatron": "megatron/core"}


def detect_version(framework: str, root: Path, override: str | None = None) -> str:
    """The upstream version of ``root``; ``override`` (``--upstream-version``) must agree if both exist."""
    if framework not in _DETECTORS:
        raise PatchError(f"unknown framework {framework!r}; choose one of: {', '.join(FRAMEWORKS)}")
    root = Path(root)
    if not (root / _MARKERS[framework]).is_dir():
        raise PatchError(f"{root} does not look like a {framework} source tree (no {_MARKERS[framework]}/ directory)")
    found = _DETECTORS[framework](root)
    if override is not None:
        _check(override, "--upstream-version")
        if found is not None and Version(found) != Version(override):
            raise PatchError(f"--upstream-version {override} disagrees with the source tree, which is {framework} {found}")
        return override
    if found is None:
        raise PatchError(f"cannot tell the {framework} version of {root}; pass --upstream-version")
    _check(found, f"{framework} version in {root}")
    return found


def _check(version: str, what: str) -> None:
    try:
        Version(version)
    except InvalidVersion:
        raise PatchError(f"{what}: {version!r} is not a valid version") from None
