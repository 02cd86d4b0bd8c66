"""``graft patches check``: in a copy of the source tree as it is on disk, do the patches
apply, do the touched files compile and import, do they pass the project's own linters,
and do the patch's tests and the nearest existing upstream tests pass?"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from graft.tools.patches.gitutil import dirty_paths, git, is_git_repo, scratch_copy
from graft.tools.patches.message import read_trailers
from graft.tools.patches.template import PatchError
from graft.tools.patches.versions import detect_version

APPLIES, ALREADY, FAILS = "applies", "already applied", "fails"
MANIFEST = "series.json"


@dataclass
class PatchResult:
    patch: str
    template: str | None
    status: str
    detail: str = ""


@dataclass
class TestRun:
    files: list
    ok: bool
    summary: str
    output: str = ""
    failed: set = field(default_factory=set)  # node ids that failed or errored
    baseline: str | None = None  # for existing upstream tests: the unpatched tree's summary
    regressions: list = field(default_factory=list)  # fail patched, not unpatched
    counts: dict = field(default_factory=dict)  # passed/failed/skipped/error/... -> number, from the summary
    baseline_counts: dict = field(default_factory=dict)

    @property
    def not_checked(self) -> bool:
        """No test passed: every one was skipped (or none was collected), or, for existing
        upstream tests, none passes here even unpatched (so "no new failures" proves nothing)."""
        return not any(self.counts.get(k) for k in ("passed", "xfailed", "xpassed"))

    def tally(self) -> str:
        """``3 passed, 0 failed, 2 skipped`` (errors count as failed)."""
        failed = self.counts.get("failed", 0) + self.counts.get("error", 0)
        return f"{self.counts.get('passed', 0)} passed, {failed} failed, {self.counts.get('skipped', 0)} skipped"


@dataclass
class CheckReport:
    version: dict = field(default_factory=dict)  # framework -> detected version
    patches: list = field(default_factory=list)
    compiled: list = field(default_factory=list)  # (path, error or None)
    imports: list = field(default_factory=list)  # (module, error or None)
    lint: list = field(default_factory=list)  # linters.LintResult
    tests: list = field(default_factory=list)  # TestRun
    dirty: list = field(default_factory=list)  # uncommitted paths in the source tree
    warnings: list = field(default_factory=list)
    refusal: str | None = None  # outside the declared range and the patch does not apply

    def failures(self) -> list:
        out = [f"{p.patch}: {p.status}" for p in self.patches if p.status != APPLIES]
        out += [f"{path} does not compile" for path, e in self.compiled if e is not None]
        out += [f"{module} does not import" for module, e in self.imports if e is not None]
        out += [f"{r.tool} reports problems" for r in self.lint if not r.ok]
        out += [f"tests fail ({t.summary})" for t in self.tests if not t.ok]
        out += [f"the patch's new tests were not checked ({t.summary}): none of them passed"
                for t in self.tests if t.ok and t.baseline is None and t.not_checked]
        if self.refusal:
            out.insert(0, self.refusal)
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()


def _series(patches_dir: Path):
    """(patch paths in order, manifest or None)."""
    manifest_path = patches_dir / MANIFEST
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError as exc:
            raise PatchError(f"{manifest_path}: not valid JSON ({exc})") from None
        paths = [patches_dir / n for n in manifest.get("files", []) if not n.endswith("0000-cover-letter.patch")]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise PatchError(f"{manifest_path} lists patches that are not there: {', '.join(missing)}")
        return paths, manifest
    paths = sorted(p for p in patches_dir.glob("*.patch") if not p.name.endswith("0000-cover-letter.patch"))
    return paths, None


def check(source, patches_dir, upstream_version=None, import_check=True, python=sys.executable, *,
          lint=False, run_tests=False, test_timeout=1200) -> CheckReport:
    source, patches_dir = Path(source), Path(patches_dir)
    patches, manifest = _series(patches_dir) if patches_dir.is_dir() else ([], None)
    if not patches:
        raise PatchError(f"no *.patch files in {patches_dir}")
    report = CheckReport()
    if is_git_repo(source):
        report.dirty = dirty_paths(source)
    ranges = []  # (framework, supported, template name)
    if manifest is not None:
        ranges = [(manifest["framework"], t["supported"], t["name"]) for t in manifest.get("templates", [])]
    trailers = {p: read_trailers(p.read_text(errors="replace")) for p in patches}
    for patch, found in trailers.items():
        if "Graft-Upstream" in found and manifest is None:
            framework, _, supported = found["Graft-Upstream"][0].partition(" ")
            ranges.append((framework, supported, (found.get("Graft-Template") or ["?"])[0]))
    outside = []
    for framework, supported, name in ranges:
        if framework not in report.version:
            report.version[framework] = detect_version(framework, source, upstream_version)
        version = report.version[framework]
        if Version(version) not in SpecifierSet(supported, prereleases=True):
            outside.append(f"{name} was written for {framework} {supported}, but {source} is {framework} {version}")
    with tempfile.TemporaryDirectory(prefix="graft-check-") as tmp:
        work = Path(tmp) / "src"
        scratch_copy(source, work, worktree=True)
        for patch in patches:
            template = (trailers[patch].get("Graft-Template") or [None])[0]
            forward = git(work, "apply", "--check", str(patch.resolve()), check=False)
            if forward.returncode == 0:
                git(work, "apply", "--index", str(patch.resolve()))
                report.patches.append(PatchResult(patch.name, template, APPLIES))
            elif git(work, "apply", "--check", "--reverse", str(patch.resolve()), check=False).returncode == 0:
                report.patches.append(PatchResult(patch.name, template, ALREADY,
                                                  "the source tree already contains this change"))
            else:
                report.patches.append(PatchResult(patch.name, template, FAILS, forward.stderr.strip()))
        applied = all(p.status == APPLIES for p in report.patches)
        if outside and not applied:
            report.refusal = "; ".join(outside) + ": outside the declared range and the patch does not apply"
        elif outside:
            report.warnings += [f"{o}; the patch still applies" for o in outside]
        if report.dirty:
            report.warnings.append(f"{source} has uncommitted changes ({', '.join(report.dirty[:5])}"
                                   f"{' ...' if len(report.dirty) > 5 else ''}); checked the tree as it is on disk")
        if not applied:
            return report  # nothing meaningful to lint or test
        changed = git(work, "diff", "--cached", "--name-only", "--diff-filter=AM").stdout.split()
        py_changed = [c for c in changed if c.endswith(".py")]
        for rel in py_changed:
            try:
                compile((work / rel).read_text(), rel, "exec")
                report.compiled.append((rel, None))
            except SyntaxError as exc:
                report.compiled.append((rel, f"{exc.msg} (line {exc.lineno})"))
        if import_check:
            modules = [m for t in (manifest or {}).get("templates", []) for m in t.get("import_checks", [])]
            modules += [m for p in patches for m in trailers[p].get("Graft-Import-Check", []) if manifest is None]
            report.imports = [(m, _import_error(python, work, m)) for m in modules]
        framework = (manifest or {}).get("framework") or next(iter(report.version), None)
        if lint and framework and py_changed:
            from graft.tools.patches.linters import lint as run_linters
            from graft.tools.patches.projects import project

            report.lint = run_linters(project(framework), work, py_changed)
            report.warnings += [r.note for r in report.lint if r.note]
        if run_tests:
            files = [f for t in (manifest or {}).get("templates", []) for f in t.get("tests", [])]
            extra = [a for t in (manifest or {}).get("templates", []) for a in t.get("test_args", [])]
            added = set(git(work, "diff", "--cached", "--name-only", "--diff-filter=A").stdout.split())
            missing = [f for f in files if not (work / f).exists()]
            if [f for f in missing if f in added or f == files[0]]:
                report.tests.append(TestRun(missing, False, f"test files not in the patched tree: {', '.join(missing)}"))
            elif files:
                if missing:  # e.g. a tree copied from an installed package: no tests/ beside it
                    report.warnings.append(f"existing upstream tests not in {source}, not checked: {', '.join(missing)}")
                present = [f for f in files if f not in missing]
                report.tests += _run_tests(python, source, work, Path(tmp) / "base", present, extra, test_timeout)
    return report


def _run_tests(python, source, work, base_dir, files, extra, timeout) -> list:
    """The patch's own tests must pass. Existing upstream tests must not fail where they pass
    in the unpatched tree (some upstream tests cannot pass on a CPU-only machine at all)."""
    added = git(work, "diff", "--cached", "--name-only", "--diff-filter=A").stdout.split()
    new = [f for f in files if f in added]
    existing = [f for f in files if f not in added]
    runs = []
    if new:
        runs.append(_pytest(python, work, new, timeout, extra))
    if existing:
        patched = _pytest(python, work, existing, timeout, extra)
        scratch_copy(source, base_dir, worktree=True)
        unpatched = _pytest(python, base_dir, existing, timeout, extra)
        patched.baseline = unpatched.summary
        patched.baseline_counts = unpatched.counts
        patched.regressions = sorted(patched.failed - unpatched.failed)
        collection_broke = patched.summary.startswith("exit code") and not unpatched.summary.startswith("exit code")
        patched.ok = patched.ok or (not patched.regressions and not collection_broke)
        runs.append(patched)
    return runs


def _env(root: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _import_error(python: str, root: Path, module: str) -> str | None:
    proc = subprocess.run([python, "-c", f"import importlib; importlib.import_module({module!r})"],
                          cwd=root, env=_env(root), capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return None
    tail = proc.stderr.strip().splitlines()[-3:]
    return "\n".join(tail) or f"exit code {proc.returncode}"


def _has_gpu(python: str) -> bool:
    proc = subprocess.run([python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                          capture_output=True, timeout=300)
    return proc.returncode == 0


def _pytest(python: str, root: Path, files: list, timeout: int, extra=()) -> TestRun:
    """The tests, in the patched tree (its modules shadow any installed copy); on a machine
    without a GPU, Triton kernels run in the interpreter."""
    env = _env(root)
    if not _has_gpu(python):
        env["TRITON_INTERPRET"] = "1"
    argv = [python, "-m", "pytest", "-q", "-rsfE", "--color=no", "-p", "no:cacheprovider", *extra, *files]
    try:
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return TestRun(files, False, f"timed out after {timeout} s")
    output = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # some projects force colour
    summary = next((line.strip("= ").strip() for line in reversed(output.splitlines())
                    if re.search(r"\b(passed|failed|error|skipped|no tests ran)\b", line)), f"exit code {proc.returncode}")
    device = "GPU" if "TRITON_INTERPRET" not in env else "CPU, Triton interpreter"
    failed = {line.split()[1] for line in output.splitlines() if re.match(r"(FAILED|ERROR) \S", line)}
    return TestRun(files, proc.returncode == 0, f"{summary} [{device}]", output, failed, counts=summary_counts(summary))


def summary_counts(summary: str) -> dict:
    """``{"passed": 3, "skipped": 2}`` from pytest's last line ("3 passed, 2 skipped in 1.2s")."""
    counts: dict = {}
    for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b", summary):
        kind = "error" if kind.startswith("error") else kind
        counts[kind] = counts.get(kind, 0) + int(number)
    return counts
