"""What ARCHITECTURE.md promises about adding things: a new framework integration and a new
backend are each found through hooks from their own folder plus one entry-point line; no
list elsewhere names them. Both are pip-installed here as separate distributions, as a
vendor would ship them."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "graft-toy-extensions"
version = "0.3.0"

[project.entry-points."graft.adapters"]
toyfw = "toyfw.adapter:plugin"
toybackend = "toybackend.plugin"

[tool.setuptools]
packages = ["toyfw", "toybackend"]
"""

FILES = {
    "toyfw/__init__.py": "",
    # the four pieces of a framework folder, as in adapters/<framework>/
    "toyfw/adapter.py": '''
from graft.integration import FrameworkPlugin

plugin = FrameworkPlugin("toyfw", description="toy framework integration")
''',
    "toyfw/integration.py": '''
from graft.integration import FrameworkIntegration

ACTIVATED = []


def integration():
    return FrameworkIntegration(name="toyfw", distribution="graft-toy-extensions", supported=">=0.3,<0.4",
                                activate=lambda: ACTIVATED.append(True) or True,
                                description="toy framework")
''',
    "toyfw/upstream.py": '''
from graft.tools.patches.projects import Project
from graft.tools.patches.template import CreateFile, PatchTemplate

PROJECT = Project(framework="toyfw", marker="toyfw", detect_version=lambda root: "1.0.0",
                  title_tag="[toy]", dco=False, packages=())


def templates():
    return [PatchTemplate(name="toyfw-hello", framework="toyfw", supported=">=1,<2", subject="Say hello",
                          body="Adds hello.txt.", changes=lambda: [CreateFile("hello.txt", "hello\\n")],
                          tests=("tests/test_hello.py",), retire="never")]
''',
    "toyfw/baselines.py": '''
import torch
from graft.baselines import Baseline, adapt_same_args


def baselines():
    return [Baseline("toyfw silu_and_mul", "fused.silu_and_mul",
                     lambda: (lambda x: torch.nn.functional.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:]),
                     adapt_same_args)]
''',
    # a backend folder, as in kernels/<backend>/: hooks in plugin.py, kernels beside it
    "toybackend/__init__.py": "",
    "toybackend/plugin.py": '''
from graft.hookspecs import hookimpl
from graft.plugins import register_kernel_modules


@hookimpl
def graft_register_kernels(registry):
    register_kernel_modules("toybackend", registry)
''',
    "toybackend/fused_silu_and_mul.py": '''
import torch
from graft.registry import Implementation


def _silu_and_mul(x):
    d = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def register(registry):
    registry.add_impl(Implementation(op="fused.silu_and_mul", backend="toybackend", fn=_silu_and_mul,
                                     devices=frozenset({"cpu"})))
''',
}

PROBE = """
import json, torch, graft
from graft.baselines import baselines_for
from graft.tools.info import collect
from graft.tools.patches.generate import available_templates
from graft.tools.patches.projects import project

report = collect(ops=["fused.silu_and_mul"])
x = torch.randn(3, 8)
out, impl = graft.dispatch.run("fused.silu_and_mul", x)
print(json.dumps({
    "integrations": [i["name"] for i in report["integrations"]],
    "templates": [t.name for t in available_templates() if t.framework == "toyfw"],
    "project_tag": project("toyfw").title_tag,
    "baselines": [b.name for b in baselines_for("fused.silu_and_mul")],
    "served_by": impl.backend,
    "candidates": [c["backend"] for c in report["ops"][0]["candidates"]],
}))
"""


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory):
    src = tmp_path_factory.mktemp("toy_src")
    (src / "pyproject.toml").write_text(PYPROJECT)
    for rel, text in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text.lstrip("\n"))
    target = tmp_path_factory.mktemp("toy_site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(src)], check=True, timeout=240)
    return target


def test_new_framework_and_backend_are_found_through_hooks_alone(toy_site):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env["PYTHONPATH"] = str(toy_site)
    env["GRAFT_FUSED_SILU_AND_MUL"] = "toybackend,torch"
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "toyfw" in got["integrations"]
    assert got["templates"] == ["toyfw-hello"] and got["project_tag"] == "[toy]"
    assert "toyfw silu_and_mul" in got["baselines"]
    assert got["served_by"] == "toybackend" and "toybackend" in got["candidates"]


def test_architecture_names_only_files_that_exist():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    for path in re.findall(r"`((?:graft|ci|tests)/[A-Za-z0-9_./]+\.(?:py|sh|c|cpp|json))`", text):
        assert (ROOT / path).exists(), path
    for path in ("graft/dispatch.py", "graft/selection.py", "graft/config.py",
                 "graft/custom_ops.py", "graft/kernels/torch/plugin.py", "graft/kernels/triton/plugin.py",
                 "graft/kernels/hip/plugin.py", "graft/kernels/collectives/plugin.py",
                 "graft/adapters/vllm/integration.py", "graft/tools/patches/upstream/vllm.py",
                 "graft/adapters/vllm/baselines.py", "ci/setup.sh"):
        assert (ROOT / path).exists(), path
    for framework in ("vllm", "deepspeed", "megatron"):
        for piece in ("adapter.py", "integration.py"):
            assert (ROOT / "graft" / "adapters" / framework / piece).exists(), (framework, piece)
        assert (ROOT / "graft" / "tools" / "patches" / "upstream" / f"{framework}.py").exists(), framework
    assert "graft/kernels/<backend>/<family>_<op>.py" in text
