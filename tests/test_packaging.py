"""The built wheel keeps everything under the single `graft` namespace (no bare top-level
`adapters`/`kernels` modules that would clash with other PyPI packages) and ships the
kernel sources and entry points."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True, timeout=300, capture_output=True,
    )
    (path,) = out.glob("graft-*.whl")
    return zipfile.ZipFile(path)


def test_single_top_level_namespace(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"graft"}, tops
    names = set(wheel.namelist())
    for pkg in ("adapters", "kernels", "kernels/triton", "kernels/hip", "tools", "tools/patches", "tools/conformance",
                "tools/bench", "ops"):
        assert f"graft/{pkg}/__init__.py" in names, pkg
    # the data files the runtime reads: the Triton tile tables, one per GPU generation
    tiles = {n for n in names if n.startswith("graft/kernels/triton/tiles/") and n.endswith(".json")}
    source = {f"graft/kernels/triton/tiles/{p.name}" for p in (ROOT / "graft/kernels/triton/tiles").glob("*.json")}
    assert source and tiles == source, (sorted(source), sorted(tiles))


def test_entry_points_declared(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "[graft.adapters]" in text and "torch = graft.kernels.torch.plugin" in text
    assert "[vllm.general_plugins]" in text and "[console_scripts]" in text


BARE = {"adapters", "kernels", "patches", "conformance", "ops", "tools"}


def test_no_import_uses_a_bare_top_level_name():
    """`python -m pytest` from the repository root puts the root on sys.path, where a bare
    `import kernels` would work by accident and then break once installed; forbid it."""
    import ast

    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"build", ".venv", "dist"} or "site-packages" in rel.parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(rel))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            offenders += [f"{rel}:{node.lineno}: {n}" for n in names if n.split(".")[0] in BARE]
    assert not offenders, offenders
