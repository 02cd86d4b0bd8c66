"""Read a framework's version from its source tree (a git checkout or an unpacked sdist)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from packaging.version import InvalidVersion, Version

from graft.tools.patches.template import PatchError


def git_tag_version(root: Path) -> str | None:
    """The newest tag of a git checkout, without a leading "v"."""
    try:
        tag = subprocess.run(["git", "-C", str(root), "describe", "--tags", "--abbrev=0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tag.lstrip("v") or None


def detect_version(framework: str, root: Path, override: str | None = None) -> str:
    """The upstream version of ``root``; ``override`` (``--upstream-version``) must agree if both exist."""
    from graft.tools.patches.projects import project

    proj = project(framework)  # unknown framework -> PatchError naming the installed ones
    root = Path(root)
    if not (root / proj.marker).is_dir():
        raise PatchError(f"{root} does not look like a {framework} source tree (no {proj.marker}/ directory)")
    found = proj.detect_version(root)
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
