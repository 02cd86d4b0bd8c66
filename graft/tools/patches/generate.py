"""``graft patches generate``: templates -> commits in a scratch copy -> ``git format-patch`` files.

Alongside the patches it writes ``series.json`` (templates, version range, tests to run),
which ``graft patches check`` reads; nothing graft-specific goes into the commits unless
``graft_trailers`` is asked for.
"""
from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

from graft import __version__
from graft.tools.patches.gitutil import changed_paths, dirty_paths, git, identity, is_git_repo, scratch_copy
from graft.tools.patches.message import BENCH_HOW, _wrap, render
from graft.tools.patches.projects import project
from graft.tools.patches.template import PatchError, PatchWarning
from graft.tools.patches.versions import detect_version

MANIFEST = "series.json"
DEFAULT_AUTHOR = "graft <graft@users.noreply.github.com>"


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


def _kernel_gate(framework: str, chosen: list, names, bench_results) -> list:
    """Kernel patches go upstream only with GPU numbers: without ``bench_results`` they are
    left out (a warning says why), or refused when asked for by name."""
    if bench_results is not None:
        return chosen
    kernels = [t for t in chosen if t.benchmark]
    why = ("a kernel patch is generated only with GPU benchmark numbers from graft/tools/bench/kernels.py in its message "
           f"(`{BENCH_HOW}` on a GPU, then --bench-results DIR/kernels-<tag>.json)")
    asked = [t.name for t in kernels if names and t.name in names]
    if asked:
        raise PatchError(f"{', '.join(asked)}: {why}; none given")
    for t in kernels:
        warnings.warn(f"{t.name} not generated: {why}; none given", PatchWarning, stacklevel=3)
    kept = [t for t in chosen if not t.benchmark]
    if not kept:
        raise PatchError(f"nothing to generate for {framework}: every selected template is a kernel patch, and {why}")
    return kept


def _check_out(out: Path) -> None:
    """``out`` must be a new or empty directory, or hold only an earlier series of graft's
    (which the new one replaces): never a mix of two series."""
    if out.exists() and not out.is_dir():
        raise PatchError(f"--out {out} is an existing file, not a directory: name a new or empty directory")
    if not out.is_dir():
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in _previous_series(out))
    if others:
        raise PatchError(f"--out {out} holds files that are not an earlier graft series "
                         f"({', '.join(others[:8])}{' ...' if len(others) > 8 else ''}): name a new or empty "
                         "directory, or remove them (an earlier series of graft's is replaced)")


def generate(framework: str, source, out, upstream_version=None, names=None, conformance=None,
             author=None, templates=None, *, signoff=False, reroll=None, cover_letter=None,
             allow_dirty=False, graft_trailers=False, format_code=False, bench_results=None) -> list:
    """Write one format-patch file per template into ``out`` (plus a cover letter for a
    series); returns the patch paths in order.

    ``out`` is new or empty, or holds an earlier series (its ``series.json`` names its files),
    which is replaced; anything else there is refused. Kernel patches (``template.benchmark``)
    need ``bench_results`` (a ``graft/tools/bench/kernels.py`` JSON from a GPU), else they are left out.

    Deterministic: the commits reuse the source HEAD's date and format-patch writes a
    zero commit id, so the same inputs give byte-identical patches.
    """
    source, out = Path(source), Path(out)
    _check_out(out)
    proj = project(framework)
    version = detect_version(framework, source, upstream_version)
    chosen = _kernel_gate(framework, select_templates(framework, names, templates), names, bench_results)
    if reroll is not None and (not isinstance(reroll, int) or reroll < 1):
        raise PatchError(f"--reroll-count must be a positive integer, got {reroll!r}")
    if signoff and (author or chosen[0].author) == DEFAULT_AUTHOR:
        raise PatchError("--signoff certifies the Developer Certificate of Origin in a person's name: "
                         "pass --author 'Your Name <you@example.com>'")
    if proj.dco and not signoff:
        warnings.warn(f"{framework} requires a DCO Signed-off-by line on every commit; pass --signoff", PatchWarning,
                      stacklevel=2)
    dirty = dirty_paths(source) if is_git_repo(source) else []
    if dirty and not allow_dirty:
        raise PatchError(f"{source} has uncommitted changes ({', '.join(dirty[:5])}{' ...' if len(dirty) > 5 else ''}); "
                         f"commit or stash them, or pass --allow-dirty to generate against HEAD")
    if dirty:
        warnings.warn(f"{source} has uncommitted changes; the patches are against HEAD and ignore them", PatchWarning,
                      stacklevel=2)
    outside = [t for t in chosen if not t.supports(version)]
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
                    if template in outside:
                        raise PatchError(f"{framework} {version} at {source} is outside the range {template.name} "
                                         f"declares ({template.supported}) and the template does not apply: {exc}") from None
                    raise PatchError(f"template {template.name}: {exc}") from None
            changed = changed_paths(work)
            if not changed:
                raise PatchError(f"template {template.name} changes nothing in {source}")
            if format_code:
                from graft.tools.patches.linters import fix

                fix(proj, work, [p for p in changed if p.endswith(".py") and (work / p).is_file()])
            git(work, "add", "-A")
            message = Path(tmp) / "message.txt"
            message.write_text(render(template, version, conformance, title=proj.title(template.subject),
                                      graft_trailers=graft_trailers, bench_results=bench_results))
            args = ["commit", "-q", "--no-verify", "-F", str(message)] + (["--signoff"] if signoff else [])
            git(work, *args, env=identity(author or template.author, date))
        for template in outside:
            warnings.warn(f"{framework} {version} is outside the range {template.name} was written for "
                          f"({template.supported}); it still applies, but review it against this version", PatchWarning,
                          stacklevel=2)
        out.mkdir(parents=True, exist_ok=True)
        _remove_previous(out)
        series = cover_letter if cover_letter is not None else len(chosen) > 1
        args = ["format-patch", "--zero-commit", "--no-signature", "-o", str(out.resolve())]
        if reroll is not None:
            args.append(f"--reroll-count={reroll}")
        if series:
            args.append("--cover-letter")
        if from_git:
            args.append(f"--base={base}")
        signer = identity(author or chosen[0].author, date)  # the cover letter's From:
        written = [Path(p) for p in git(work, *args, f"{base}..HEAD", env=signer).stdout.split()]
    patches = [p for p in written if not p.name.endswith("0000-cover-letter.patch")]
    for letter in (p for p in written if p not in patches):
        _fill_cover_letter(letter, proj, chosen)
    (out / MANIFEST).write_text(json.dumps({
        "generator": f"graft {__version__}",
        "framework": framework,
        "version": version,
        "files": [p.name for p in written],
        "templates": [{"name": t.name, "supported": t.supported, "import_checks": list(t.import_checks),
                       "tests": list(t.tests), "test_args": list(t.test_args)} for t in chosen],
    }, indent=2) + "\n")
    return patches


def _previous_series(out: Path) -> set:
    """Names of the files of an earlier graft series in ``out``: its manifest and the files
    the manifest lists, and patches older graft versions marked with trailers."""
    found = set()
    manifest = out / MANIFEST
    if manifest.is_file():
        try:
            listed = json.loads(manifest.read_text()).get("files", [])
        except (ValueError, AttributeError):
            listed = None
        if isinstance(listed, list):  # a series.json of someone else's is not ours to delete
            found |= {MANIFEST} | {Path(str(n)).name for n in listed if (out / Path(str(n)).name).is_file()}
    for old in out.glob("*.patch"):
        if old.is_file() and "Graft-Template:" in old.read_text(errors="replace"):
            found.add(old.name)
    return found


def _remove_previous(out: Path) -> None:
    """Delete the earlier series :func:`_check_out` accepted, just before the new one is written."""
    for name in _previous_series(out):
        (out / name).unlink(missing_ok=True)


def _fill_cover_letter(path: Path, proj, chosen: list) -> None:
    lead = chosen[0]
    subject = proj.title(lead.subject if len(chosen) == 1 else "; ".join(t.subject for t in chosen))
    blurb = [_wrap(lead.motivation) if lead.motivation.strip() else lead.subject, "", "This series:"]
    blurb += [f"  - {proj.title(t.subject)}" for t in chosen]
    text = path.read_text().replace("*** SUBJECT HERE ***", subject).replace("*** BLURB HERE ***", "\n".join(blurb))
    path.write_text(text)
