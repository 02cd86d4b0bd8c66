"""``graft patches generate``: templates -> commits in a scratch copy -> ``git format-patch`` files."""
from __future__ import annotations

import tempfile
from pathlib import Path

from graft import __version__
from graft.patches.gitutil import git, identity, is_git_repo, scratch_copy
from graft.patches.message import render
from graft.patches.template import PatchError
from graft.patches.versions import detect_version


def available_templates() -> list:
    from graft.plugins import get_host

    return get_host().collect("graft_patch_templates")


def select_templates(framework: str, names=None, templates=None) -> list:
    templates = available_templates() if templates is None else templates
    chosen = [t for t in templates if t.framework == framework]
    if names:
        known = {t.name for t in chosen}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise PatchError(f"no {framework} template named {', '.join(unknown)}; available: {', '.join(sorted(known)) or '(none)'}")
        chosen = [t for t in chosen if t.name in names]
    if not chosen:
        frameworks = sorted({t.framework for t in templates})
        raise PatchError(f"no patch templates for {framework!r}; installed adapters provide templates for: {', '.join(frameworks) or '(none)'}")
    return chosen


def generate(framework: str, source, out, upstream_version=None, names=None, conformance=None,
             author=None, templates=None) -> list:
    """Write one format-patch file per template into ``out``; returns their paths.

    Deterministic: the commits reuse the source HEAD's date and format-patch writes a
    zero commit id, so the same inputs give byte-identical patches.
    """
    source, out = Path(source), Path(out)
    version = detect_version(framework, source, upstream_version)
    chosen = select_templates(framework, names, templates)
    outside = [t for t in chosen if not t.supports(version)]
    if outside:
        listing = "; ".join(f"{t.name} supports {framework} {t.supported}" for t in outside)
        raise PatchError(f"{framework} {version} at {source} is outside the supported range: {listing}. "
                         f"Use a checkout of a supported release.")
    with tempfile.TemporaryDirectory(prefix="graft-patches-") as tmp:
        work = Path(tmp) / "src"
        from_git = is_git_repo(source)
        base = scratch_copy(source, work)
        date = git(work, "log", "-1", "--format=%aI").stdout.strip()
        for template in chosen:
            for change in template.changes():
                try:
                    change.apply(work)
                except PatchError as exc:
                    raise PatchError(f"template {template.name}: {exc}") from None
            git(work, "add", "-A")
            if not git(work, "diff", "--cached", "--name-only").stdout.strip():
                raise PatchError(f"template {template.name} changes nothing in {source}")
            message = Path(tmp) / "message.txt"
            message.write_text(render(template, version, conformance))
            git(work, "commit", "-q", "--no-verify", "-F", str(message), env=identity(author or template.author, date))
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.patch"):  # replace an earlier run's output, leave anything else alone
            if "Graft-Template:" in old.read_text(errors="replace"):
                old.unlink()
        args = ["format-patch", "--zero-commit", "--signature", f"graft {__version__}", "-o", str(out.resolve())]
        if from_git:
            args.append(f"--base={base}")
        written = git(work, *args, f"{base}..HEAD").stdout.split()
    return [Path(p) for p in written]
