"""Run an upstream project's own linters/formatters on changed files, from a scratch venv.

The pinned tools go into ``$GRAFT_PATCH_LINTERS`` (default ``~/.cache/graft-patch-linters``),
one venv per set of pins, created on first use with ``python -m venv`` + ``pip install``;
tools already on ``PATH`` at the same version are not reinstalled.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from graft.patches.projects import Project, Tool
from graft.patches.template import PatchError


@dataclass
class LintResult:
    tool: str
    paths: list
    ok: bool
    output: str = ""


def linter_root() -> Path:
    return Path(os.environ.get("GRAFT_PATCH_LINTERS") or Path.home() / ".cache" / "graft-patch-linters")


def ensure_tools(project: Project) -> Path:
    """The bin directory of a venv holding ``project.packages``; installs them when missing."""
    key = hashlib.sha256("\n".join(sorted(project.packages)).encode()).hexdigest()[:12]
    env_dir = linter_root() / f"{project.framework}-{key}"
    bin_dir = env_dir / "bin"
    marker = env_dir / "installed.txt"
    wanted = "\n".join(sorted(project.packages))
    if marker.is_file() and marker.read_text() == wanted:
        return bin_dir
    if not (bin_dir / "python").exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    proc = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *project.packages], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise PatchError(f"could not install {project.framework}'s linters ({', '.join(project.packages)}) into "
                         f"{env_dir}: {proc.stderr.strip()[-800:]}")
    marker.write_text(wanted)
    return bin_dir


def _run(bin_dir: Path, argv: tuple, paths: list, root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)  # the tools lint the tree; they must not import graft's environment
    exe = bin_dir / argv[0]
    return subprocess.run([str(exe), *argv[1:], *paths], cwd=root, capture_output=True, text=True,
                          env=env, timeout=600)


def fix(project: Project, root: Path, paths: list) -> None:
    """Rewrite ``paths`` into the project's style with its own formatters (generate)."""
    bin_dir = ensure_tools(project)
    for tool, hits in project.tools_for(paths):
        if tool.fix:
            proc = _run(bin_dir, tool.fix, hits, root)
            if proc.returncode != 0 and tool.name != "ruff check":  # ruff --fix exits 1 on unfixable findings
                raise PatchError(f"{tool.name} could not format {', '.join(hits)}: "
                                 f"{(proc.stderr or proc.stdout).strip()[-800:]}")


def lint(project: Project, root: Path, paths: list) -> list:
    """Each of the project's linters over the changed files it covers; nothing is modified."""
    bin_dir = ensure_tools(project)
    results = []
    for tool, hits in project.tools_for(paths):
        proc = _run(bin_dir, tool.check, hits, root)
        output = (proc.stdout + proc.stderr).strip()
        results.append(LintResult(tool.name, hits, proc.returncode == 0, output))
    return results


def describe(tool: Tool) -> str:
    return " ".join(tool.check)


if __name__ == "__main__":  # python -m graft.patches.linters FRAMEWORK: pre-install a project's linters
    from graft.patches.projects import project

    print(ensure_tools(project(sys.argv[1])))
