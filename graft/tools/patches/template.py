"""Patch templates: what a patch adds to or changes in an upstream source tree.

Edits are anchored on text, not line numbers, so a template survives unrelated
upstream churn inside its declared version range; a missing anchor is a clear error.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from graft.errors import GraftError


class PatchError(GraftError):
    """A template cannot be applied to this source tree."""


class PatchWarning(UserWarning):
    """Something a maintainer should know about, which does not stop generation."""


@dataclass(frozen=True)
class CreateFile:
    path: str  # relative to the repository root
    content: str

    def apply(self, root: Path) -> None:
        target = root / self.path
        if target.exists():
            if target.read_text() == self.content:
                raise PatchError(f"{self.path} already exists with this content: the change is already applied")
            raise PatchError(f"{self.path} already exists upstream; refusing to overwrite it")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.content)


@dataclass(frozen=True)
class InsertAfter:
    """Insert ``text`` after the first line matching the regular expression ``anchor``."""

    path: str
    anchor: str
    text: str

    def apply(self, root: Path) -> None:
        target = _existing(root, self.path)
        source = target.read_text()
        if self.text in source:
            raise PatchError(f"{self.path} already contains the inserted text: the change is already applied")
        match = re.search(self.anchor, source, flags=re.MULTILINE)
        if match is None:
            raise PatchError(f"anchor /{self.anchor}/ not found in {self.path}: the upstream file changed shape")
        end = source.find("\n", match.end())
        end = len(source) if end == -1 else end + 1
        insertion = self.text if self.text.endswith("\n") else self.text + "\n"
        target.write_text(source[:end] + insertion + source[end:])


@dataclass(frozen=True)
class ReplaceText:
    """Replace the single exact occurrence of ``old`` with ``new``."""

    path: str
    old: str
    new: str

    def apply(self, root: Path) -> None:
        target = _existing(root, self.path)
        source = target.read_text()
        count = source.count(self.old)
        if count == 0:
            if self.new in source:
                raise PatchError(f"{self.path} already has the replacement: the change is already applied")
            raise PatchError(f"text to replace not found in {self.path}: {self.old.strip()[:80]!r}")
        if count > 1:
            raise PatchError(f"text to replace occurs {count} times in {self.path}; the template must be unambiguous")
        target.write_text(source.replace(self.old, self.new))


@dataclass(frozen=True)
class ReplaceRegex:
    """Replace the single match of the regular expression ``pattern`` (``re.MULTILINE``)
    with ``repl`` (``re.sub`` syntax): for text that differs between the pinned release and
    the main branch around an unchanged core."""

    path: str
    pattern: str
    repl: str
    applied: str = ""  # regex that matches once the change is in: "already applied"

    def apply(self, root: Path) -> None:
        target = _existing(root, self.path)
        source = target.read_text()
        matches = list(re.finditer(self.pattern, source, flags=re.MULTILINE))
        if not matches:
            if self.applied and re.search(self.applied, source, flags=re.MULTILINE):
                raise PatchError(f"{self.path} already has the replacement: the change is already applied")
            raise PatchError(f"pattern /{self.pattern[:80]}/ not found in {self.path}: the upstream file changed shape")
        if len(matches) > 1:
            raise PatchError(f"pattern /{self.pattern[:80]}/ matches {len(matches)} times in {self.path}; "
                             "the template must be unambiguous")
        target.write_text(re.sub(self.pattern, self.repl, source, count=1, flags=re.MULTILINE))


def _existing(root: Path, path: str) -> Path:
    target = root / path
    if not target.is_file():
        raise PatchError(f"{path} does not exist in the source tree (is this a checkout of the right framework?)")
    return target


@dataclass(frozen=True)
class PatchTemplate:
    """One upstream commit: a subject, an explanation, and the changes.

    ``changes`` is a callable so that content (e.g. kernel source extracted from the
    adapter) is rendered at generation time. ``ops`` are the graft ops the patch
    carries; their conformance results go into the commit message. The message is
    ``motivation`` (why), ``body`` (what changes) and a testing section; ``tests`` are
    test files in the upstream tree (the ones the patch adds, then the nearest existing
    ones) that ``graft patches check`` runs in the patched tree. ``upstream`` names the
    PR or issue once there is one; ``retire`` is the plan for dropping graft's own
    adapter code once upstream carries the change.
    """

    name: str
    framework: str  # "vllm", "deepspeed" or "megatron"
    supported: str  # PEP 440 specifier of upstream versions the anchors were written for
    subject: str
    body: str
    changes: Callable[[], list]
    ops: tuple = ()
    import_checks: tuple = ()  # modules that must import from the patched tree
    author: str = "graft <graft@users.noreply.github.com>"
    notes: list = field(default_factory=list)
    motivation: str = ""
    tests: tuple = ()
    test_args: tuple = ()  # extra pytest arguments the project's CI uses for these tests (e.g. -m MARK)
    upstream: str = "not submitted yet"
    retire: str = ""
    # How the change is reached: "default" (the framework's default configuration runs it)
    # or the exact switch that turns it on; the message and ``graft patches explain`` say it.
    reach: str = "default"
    # A kernel patch: the ``graft/tools/bench/kernels.py`` case that measures it, as (family, op), e.g.
    # ("fused", "rms_norm"). Such a patch is generated only with GPU numbers from that
    # benchmark (``--bench-results``); without them it is left out, and generate says why.
    benchmark: tuple = ()
    # What the anchors were last checked against: {"release": "<pinned version>", "<snapshot>":
    # "<upstream commit>"}, a snapshot being a folder of tests/upstream_snapshots (SOURCES.json
    # records its commit); tests/test_patches_upstream.py keeps both true.
    checked_against: dict = field(default_factory=dict)

    def supports(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.supported, prereleases=True)
