"""What an upstream project expects of a contribution: title tag, DCO, and its own
linters and formatters with the versions its pre-commit configuration pins.

Linter versions are taken from each project's ``.pre-commit-config.yaml`` at the
release the templates target, so ``check`` runs what the project's CI runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from graft.tools.patches.template import PatchError


@dataclass(frozen=True)
class Tool:
    """One linter (``check``) or formatter (``fix``) invocation on the changed files."""

    name: str
    check: tuple  # argv before the file list; run in the patched tree
    fix: tuple = ()  # argv that rewrites files into the project's style (generate); () = no fixer
    files: str = r"\.py$"  # regex: which changed files this tool looks at (the pre-commit `files:`)
    config: str = ""  # the configuration file (relative to the root) named in check/fix, e.g. ".style.yapf"


@dataclass(frozen=True)
class Project:
    framework: str
    marker: str  # directory (relative to the source root) that marks a tree of this project
    detect_version: Callable[[Path], str | None]  # the version of a source tree, or None
    title_tag: str  # prefix of commit subjects, e.g. "[Kernel]"; "" for none
    dco: bool  # the project requires Signed-off-by (Developer Certificate of Origin)
    packages: tuple  # pinned pip requirements of the linters
    tools: tuple = field(default_factory=tuple)
    # Configuration files unpacked sdists leave out, as the pinned release has them:
    # name -> (content, where it comes from); used (with a warning) when the tree lacks one.
    default_configs: dict = field(default_factory=dict)

    def title(self, subject: str) -> str:
        # A subject that names its own category ("[Bugfix] ...") keeps it.
        if not self.title_tag or subject.startswith("["):
            return subject
        return f"{self.title_tag} {subject}"

    def tools_for(self, paths) -> list:
        """(tool, [paths it applies to]) for every tool with at least one matching path."""
        out = []
        for tool in self.tools:
            hits = [p for p in paths if re.search(tool.files, p)]
            if hits:
                out.append((tool, hits))
        return out


def projects() -> dict:
    """framework name -> Project, from every adapter's ``graft_upstream_projects`` hook."""
    from graft.plugins import get_host

    return {p.framework: p for p in get_host().collect("graft_upstream_projects")}


def project(framework: str) -> Project:
    found = projects()
    if framework not in found:
        raise PatchError(f"unknown framework {framework!r}; choose one of: {', '.join(sorted(found)) or '(none installed)'}")
    return found[framework]
