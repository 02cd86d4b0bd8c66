"""The package type-checks, and static tools resolve every graft import.

Every folder of the package is a real folder under ``graft/`` (no symlinks), so mypy and
any import-graph tool follow ``graft.kernels.triton._common`` to a real file; an
unresolved graft import or a type error in graft's own code fails here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_holds_no_symlinks():
    proc = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in proc.stdout.splitlines() if line.startswith("120000")]
    assert links == [], links
    for folder in ("adapters", "kernels", "tools", "ops"):
        path = ROOT / "graft" / folder
        assert path.is_dir() and not path.is_symlink(), path
    for old in ("adapters", "kernels", "patches", "conformance"):
        assert not (ROOT / old).exists(), f"{old}/ moved into graft/"


def test_mypy_passes_over_the_package():
    pytest.importorskip("mypy")
    env = dict(os.environ, MYPY_CACHE_DIR=str(ROOT / ".mypy_cache"))
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert "Cannot find implementation or library stub for module named \"graft" not in out, out
    assert proc.returncode == 0, out[-6000:]
