"""Run an upstream project's own linters/formatters on changed files, from a scratch venv.

The pinned tools go into ``$GRAFT_PATCH_LINTERS`` (default ``~/.cache/graft-patch-linters``),
one venv per set of pins, created on first use with ``python -m venv`` + ``pip install``;
tools already on ``PATH`` at the same version are not reinstalled.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import venv
import warnings
from dataclasses import dataclass
from pathlib import Path

from graft.tools.patches.projects import Project, Tool
from graft.tools.patches.template import PatchError, PatchWarning


@dataclass
class LintResult:
    tool: str
    paths: list
    ok: bool
    output: str = ""
    note: str = ""  # e.g. the tree had no config file and the project's stored one was used


def linter_root() -> Path:
    from graft import settings

    return Path(settings.raw("GRAFT_PATCH_LINTERS") or Path.home() / ".cache" / "graft-patch-linters")


def pinned_packages(project: Project, root: Path | None = None) -> tuple:
    """``project.packages`` at the versions the tree's own ``.pre-commit-config.yaml`` pins,
    where it pins them (a main-branch checkout moves its pins; e.g. Megatron main's black);
    the release's pins otherwise (unpacked sdists have no pre-commit file)."""
    path = None if root is None else Path(root) / ".pre-commit-config.yaml"
    if path is None or not path.is_file():
        return tuple(project.packages)
    import yaml

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return tuple(project.packages)
    revs = {}
    for repo in config.get("repos") or []:
        found = re.search(r"(\d+(?:\.\d+)+)", str(repo.get("rev", "")))
        if found is None:
            continue
        for hook in repo.get("hooks") or []:
            revs[str(hook.get("id"))] = found.group(1)
    pinned = []
    for requirement in project.packages:
        name, _, _ = requirement.partition("==")
        version = revs.get(name) or revs.get(f"{name}-check")
        pinned.append(f"{name}=={version}" if version else requirement)
    return tuple(pinned)


def ensure_tools(project: Project, packages: tuple | None = None) -> Path:
    """The bin directory of a venv holding ``packages`` (default ``project.packages``);
    installs them when missing."""
    packages = tuple(project.packages if packages is None else packages)
    key = hashlib.sha256("\n".join(sorted(packages)).encode()).hexdigest()[:12]
    env_dir = linter_root() / f"{project.framework}-{key}"
    bin_dir = env_dir / "bin"
    marker = env_dir / "installed.txt"
    wanted = "\n".join(sorted(packages))
    if marker.is_file() and marker.read_text() == wanted:
        return bin_dir
    if not (bin_dir / "python").exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    proc = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *packages], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise PatchError(f"could not install {project.framework}'s linters ({', '.join(packages)}) into "
                         f"{env_dir}: {proc.stderr.strip()[-800:]}")
    marker.write_text(wanted)
    return bin_dir


def _configured(project: Project, tool: Tool, argv: tuple, root: Path, tmp: Path) -> tuple:
    """(argv, note): ``argv`` naming a config file the tree has, or the project's stored copy
    of it when the tree lacks it (unpacked sdists leave dot-files out); a clear error when
    there is neither."""
    if not tool.config or (root / tool.config).is_file():
        return argv, ""
    if tool.config not in project.default_configs:
        raise PatchError(f"the source tree has no {tool.config}, which {project.framework}'s {tool.name} reads; unpacked "
                         f"sdists leave it out: use a git checkout of {project.framework}, or copy {tool.config} "
                         "from it into the tree")
    content, origin = project.default_configs[tool.config]
    stored = tmp / Path(tool.config).name
    stored.write_text(content)
    swapped = tuple(str(stored) if a == tool.config else a.replace("=" + tool.config, f"={stored}") for a in argv)
    return swapped, (f"the source tree has no {tool.config} (unpacked sdists leave it out): {tool.name} used "
                     f"{project.framework}'s, as in {origin}")


def _run(bin_dir: Path, argv: tuple, paths: list, root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)  # the tools lint the tree; they must not import graft's environment
    exe = bin_dir / argv[0]
    return subprocess.run([str(exe), *argv[1:], *paths], cwd=root, capture_output=True, text=True,
                          env=env, timeout=600)


def fix(project: Project, root: Path, paths: list) -> None:
    """Rewrite ``paths`` into the project's style with its own formatters (generate)."""
    bin_dir = ensure_tools(project, pinned_packages(project, root))
    with tempfile.TemporaryDirectory(prefix="graft-lint-config-") as tmp:
        for tool, hits in project.tools_for(paths):
            if tool.fix:
                argv, note = _configured(project, tool, tool.fix, root, Path(tmp))
                if note:
                    warnings.warn(note, PatchWarning, stacklevel=3)
                proc = _run(bin_dir, argv, hits, root)
                if proc.returncode != 0 and tool.name != "ruff check":  # ruff --fix exits 1 on unfixable findings
                    raise PatchError(f"{tool.name} could not format {', '.join(hits)}: "
                                     f"{(proc.stderr or proc.stdout).strip()[-800:]}")


def lint(project: Project, root: Path, paths: list) -> list:
    """Each of the project's linters over the changed files it covers; nothing is modified."""
    bin_dir = ensure_tools(project, pinned_packages(project, root))
    results = []
    with tempfile.TemporaryDirectory(prefix="graft-lint-config-") as tmp:
        for tool, hits in project.tools_for(paths):
            argv, note = _configured(project, tool, tool.check, root, Path(tmp))
            proc = _run(bin_dir, argv, hits, root)
            output = (proc.stdout + proc.stderr).strip()
            results.append(LintResult(tool.name, hits, proc.returncode == 0, output, note))
    return results


def describe(tool: Tool) -> str:
    return " ".join(tool.check)


if __name__ == "__main__":  # python -m graft.tools.patches.linters FRAMEWORK: pre-install a project's linters
    from graft.tools.patches.projects import project

    print(ensure_tools(project(sys.argv[1])))
