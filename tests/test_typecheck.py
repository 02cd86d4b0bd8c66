"""The package type-checks, and static tools resolve every graft import.

The top-level folders (adapters/, kernels/, patches/, conformance/) are linked into
``graft/``, so mypy follows ``graft.kernels.triton._common`` to a real file; an
unresolved graft import or a type error in graft's own code fails here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tree_links_the_top_level_folders_into_the_package():
    for folder in ("adapters", "kernels", "patches", "conformance"):
        link = ROOT / "graft" / folder
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), link


def test_mypy_passes_over_the_package():
    pytest.importorskip("mypy")
    env = dict(os.environ, MYPY_CACHE_DIR=str(ROOT / ".mypy_cache"))
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert "Cannot find implementation or library stub for module named \"graft" not in out, out
    assert proc.returncode == 0, out[-6000:]
