"""Small git helpers: a scratch copy of a source tree to commit into or apply onto."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from graft.tools.patches.template import PatchError


def git(root: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    # Keep the user's git configuration (hooks, signing, templates) out of generated commits.
    full_env.update({"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"})
    full_env.update(env or {})
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, env=full_env, timeout=300)
    if check and proc.returncode != 0:
        raise PatchError(f"git {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def is_git_repo(root: Path) -> bool:
    return (root / ".git").exists() and git(root, "rev-parse", "HEAD", check=False).returncode == 0


def status_paths(root: Path) -> list:
    """Paths with uncommitted changes (modified, staged, deleted or untracked; not ignored)."""
    out = git(root, "status", "--porcelain", "-z", "--untracked-files=all").stdout
    paths, entries = [], out.split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":  # a rename/copy is followed by its source path
            i += 1
    return paths


dirty_paths = status_paths
changed_paths = status_paths


def scratch_copy(source: Path, dest: Path, worktree: bool = False) -> str:
    """Put the source tree at ``dest`` as a git repository; returns the base commit.

    A git checkout is cloned (its HEAD is the base, so patches carry base-commit);
    with ``worktree`` its uncommitted changes are carried over too, so the copy is the
    tree as it is on disk. Anything else is copied and committed once as the base.
    """
    if shutil.which("git") is None:
        raise PatchError("git is not installed; patch generation and checking need it")
    source = Path(source).resolve()
    if not source.is_dir():
        raise PatchError(f"--source {source} is not a directory")
    if is_git_repo(source):
        subprocess.run(["git", "clone", "-q", "--shared", str(source), str(dest)], check=True,
                       capture_output=True, timeout=600)
        if worktree:
            for rel in status_paths(source):
                src, dst = source / rel, dest / rel
                if src.is_file():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)
                elif dst.is_file():
                    dst.unlink()
    else:
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        git(dest, "init", "-q")
        git(dest, "add", "-A")
        git(dest, "commit", "-q", "-m", "base", env=identity("graft <graft@localhost>", "1970-01-01T00:00:00+00:00"))
    return git(dest, "rev-parse", "HEAD").stdout.strip()


def identity(author: str, date: str) -> dict:
    name, _, email = author.partition("<")
    name, email = name.strip(), email.rstrip(">").strip()
    return {
        "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": date,
    }
