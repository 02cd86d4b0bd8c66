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
    for pkg in ("adapters", "kernels", "kernels/triton", "kernels/hip", "patches", "conformance", "ops"):
        assert f"graft/{pkg}/__init__.py" in names, pkg


def test_entry_points_declared(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "[graft.adapters]" in text and "torch = graft.adapters.torch_reference" in text
    assert "[vllm.general_plugins]" in text and "[console_scripts]" in text
