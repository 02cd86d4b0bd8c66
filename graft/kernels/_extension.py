"""What graft's compiled kernel backends (hip, cpp) share about their lazy builds: where the
builds are cached, how a build is keyed, and how a failed build is summarised for
``graft info`` and the selection's fallback reason."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from graft import settings

# Declared in graft.settings. GRAFT_BUILD_VERBOSE serves both compiled backends (it replaced
# GRAFT_HIP_VERBOSE, still read as a deprecated alias, and GRAFT_CPP_VERBOSE).
CACHE_DIR_VAR = "GRAFT_CACHE_DIR"
VERBOSE_VAR = "GRAFT_BUILD_VERBOSE"


def cache_dir() -> Path:
    root = settings.raw(CACHE_DIR_VAR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "graft"


def verbose() -> bool:
    """Whether a build shows the compiler's output (GRAFT_BUILD_VERBOSE)."""
    return bool(settings.get(VERBOSE_VAR))


def build_mode(var: str) -> str:
    """``lazy`` or ``off``: when a compiled backend builds (GRAFT_HIP_BUILD, GRAFT_CPP_BUILD)."""
    return str(settings.get(var))


def build_key(files, settings: str) -> str:
    """16 hex digits of a hash of the files (names and bytes) and ``settings`` (versions,
    flags): a change of any of them never reuses a stale binary."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(settings.encode())
    return digest.hexdigest()[:16]


def summarize(exc: BaseException) -> str:
    """A failed build in one line: the exception's first three lines, at most 500 characters."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return " / ".join(line.strip() for line in text[:3] if line.strip())[:500]
