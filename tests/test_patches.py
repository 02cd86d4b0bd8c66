"""Upstream patch generation and checking.

Fake upstream repositories (just the files the templates touch) cover generation,
clean apply, idempotence and refusals; the real vLLM/DeepSpeed/Megatron sources
installed in this environment cover the anchors and imports against actual upstream code.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graft.patches.check import ALREADY, APPLIES, FAILS, check
from graft.patches.generate import generate
from graft.patches.template import PatchError

VLLM_INIT = '''# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton kernel implementations."""

from . import activation

__all__ = ["activation"]
'''
DS_INIT = '''# DeepSpeed Team

from .residual_add import residual_add_bias
from .layer_norm import layer_norm, layer_norm_residual
from .gelu import gelu
'''


def git(root, *args):
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True, env=env)


def make_repo(root: Path, files: dict, commit=True) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if commit:
        git(root, "init", "-q")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "upstream")
    return root


@pytest.fixture
def vllm_repo(tmp_path):
    return make_repo(tmp_path / "vllm-src", {
        "vllm/__init__.py": "",
        "vllm/_version.py": "__version__ = version = '0.33.0'\n",
        "vllm/kernels/triton/__init__.py": VLLM_INIT,
    })


@pytest.fixture
def ds_repo(tmp_path):
    return make_repo(tmp_path / "ds-src", {
        "version.txt": "0.19.8\n",
        "deepspeed/ops/transformer/inference/triton/__init__.py": DS_INIT,
    })


@pytest.fixture
def megatron_repo(tmp_path):
    return make_repo(tmp_path / "mlm-src", {
        "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n",
        "megatron/core/fusions/__init__.py": "",
    })


def test_generate_writes_git_format_patches_that_git_am_accepts(vllm_repo, tmp_path):
    (patch,) = generate("vllm", vllm_repo, tmp_path / "out")
    text = patch.read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] Add Triton RMSNorm provider for the rms_norm IR ops" in text
    assert "Graft-Template: vllm-triton-rms-norm" in text and "Graft-Upstream: vllm >=0.33,<0.34" in text
    assert "generated against vllm 0.33.0" in text and "base-commit: " in text
    assert "new file mode 100644" in text and "+from . import activation, rms_norm" in text
    assert "+def _rms_norm_kernel(" in text  # graft's kernel itself travels in the patch
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(vllm_repo), str(clone)], check=True)
    git(clone, "am", "-q", str(patch))
    log = git(clone, "log", "-1", "--format=%an <%ae>|%s").stdout.strip()
    assert log == "graft <graft@users.noreply.github.com>|Add Triton RMSNorm provider for the rms_norm IR ops"
    assert (clone / "vllm/kernels/triton/rms_norm.py").is_file()


@pytest.mark.parametrize("framework,repo", [("vllm", "vllm_repo"), ("deepspeed", "ds_repo"), ("megatron", "megatron_repo")])
def test_each_framework_applies_cleanly_and_compiles(framework, repo, request, tmp_path):
    source = request.getfixturevalue(repo)
    patches = generate(framework, source, tmp_path / "out")
    assert len(patches) == 1
    report = check(source, tmp_path / "out", import_check=False)
    assert [p.status for p in report.patches] == [APPLIES]
    assert report.compiled and all(err is None for _, err in report.compiled)
    assert report.ok


def test_generation_is_deterministic_and_replaces_earlier_output(vllm_repo, tmp_path):
    out = tmp_path / "out"
    (first,) = generate("vllm", vllm_repo, out)
    before = first.read_bytes()
    (out / "README").write_text("not a patch: left alone")
    (second,) = generate("vllm", vllm_repo, out)
    assert second.read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == sorted([first.name, "README"])


def test_check_on_already_patched_tree_reports_already_applied(vllm_repo, tmp_path):
    out = tmp_path / "out"
    (patch,) = generate("vllm", vllm_repo, out)
    git(vllm_repo, "am", "-q", str(patch))
    report = check(vllm_repo, out, import_check=False)
    assert [p.status for p in report.patches] == [ALREADY] and report.ok
    with pytest.raises(PatchError, match="already"):
        generate("vllm", vllm_repo, tmp_path / "again")


def test_refuses_unsupported_upstream_version(vllm_repo, tmp_path):
    out = tmp_path / "out"
    generate("vllm", vllm_repo, out)
    (vllm_repo / "vllm/_version.py").write_text("__version__ = version = '0.32.1'\n")
    git(vllm_repo, "commit", "-qam", "older")
    with pytest.raises(PatchError, match=r"vllm 0\.32\.1 .* outside the supported range: vllm-triton-rms-norm supports vllm >=0.33,<0.34"):
        generate("vllm", vllm_repo, tmp_path / "out2")
    with pytest.raises(PatchError, match=r"is for vllm >=0.33,<0.34, but .* is vllm 0\.32\.1; refusing"):
        check(vllm_repo, out)


def test_cli_exit_codes(vllm_repo, tmp_path):
    def graft(*args):
        return subprocess.run([sys.executable, "-m", "graft", "patches", *args], capture_output=True, text=True, timeout=300)

    out = tmp_path / "out"
    proc = graft("generate", "vllm", "--source", str(vllm_repo), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = graft("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import")
    assert proc.returncode == 0 and "OK: patches apply cleanly" in proc.stdout
    # a patch that no longer applies: the upstream file changed under it
    (vllm_repo / "vllm/kernels/triton/__init__.py").write_text(VLLM_INIT.replace("from . import activation", "from . import act2"))
    git(vllm_repo, "commit", "-qam", "drift")
    proc = graft("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import")
    assert proc.returncode == 1 and FAILS in proc.stdout and "patch does not apply" in proc.stdout
    proc = graft("generate", "vllm", "--source", str(tmp_path / "missing"), "--out", str(out))
    assert proc.returncode == 2 and "does not look like a vllm source tree" in proc.stderr


def test_missing_anchor_is_a_clear_error(ds_repo, tmp_path):
    init = ds_repo / "deepspeed/ops/transformer/inference/triton/__init__.py"
    init.write_text(DS_INIT.replace("from .layer_norm import layer_norm, layer_norm_residual\n", ""))
    git(ds_repo, "commit", "-qam", "layer norm moved")
    with pytest.raises(PatchError, match=r"anchor .* not found in deepspeed/ops/transformer/inference/triton/__init__.py"):
        generate("deepspeed", ds_repo, tmp_path / "out")


def test_plain_directory_source_and_version_override(tmp_path):
    source = make_repo(tmp_path / "sdist", {"megatron/core/fusions/__init__.py": ""}, commit=False)
    with pytest.raises(PatchError, match="pass --upstream-version"):
        generate("megatron", source, tmp_path / "out")
    (patch,) = generate("megatron", source, tmp_path / "out", upstream_version="0.16.0")
    assert "base-commit" not in patch.read_text()  # no upstream commit to name
    assert check(source, tmp_path / "out", upstream_version="0.16.0", import_check=False).ok


def test_version_override_must_agree(megatron_repo, tmp_path):
    with pytest.raises(PatchError, match="disagrees"):
        generate("megatron", megatron_repo, tmp_path / "out", upstream_version="0.16.2")


def test_conformance_results_go_into_the_message(megatron_repo, tmp_path):
    report = {"meta": {"graft_version": "0.1.0", "device": {"name": "NVIDIA H200", "arch": "sm_90"}},
              "cases": [{"op": "fused.rms_norm", "case": "t7_h33", "dtype": "float16",
                         "impls": [{"backend": "triton", "status": "pass", "max_abs": 0.0009765625,
                                    "speedups": {"torch": 2.5}}]},
                        {"op": "fused.rms_norm", "case": "t64_h4096", "dtype": "bfloat16",
                         "impls": [{"backend": "triton", "status": "pass", "max_abs": 0.0078125,
                                    "speedups": {"torch": 3.5}}]},
                        {"op": "gemm.linear", "case": "x", "dtype": "float16",
                         "impls": [{"backend": "triton", "status": "fail", "max_abs": 9.0}]}]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    (patch,) = generate("megatron", megatron_repo, tmp_path / "out", conformance=path)
    text = patch.read_text()
    assert "device NVIDIA H200 sm_90" in text
    assert "fused.rms_norm [triton]: 2/2 cases pass, max abs err 0.00781, speedup median 3.50x (min 2.50x, max 3.50x)" in text
    assert "gemm.linear" not in text
    path.write_text("{not json")
    with pytest.raises(PatchError, match="not a graft conformance JSON report"):
        generate("megatron", megatron_repo, tmp_path / "out2", conformance=path)


# ---------------------------------------------------------------- real upstream sources


def _installed_sources(package: str, dest: Path, extra=()) -> Path:
    """The Python sources of an installed framework as a git repository (a stand-in for a
    checkout of the same release: same files, no compiled extensions)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{package} is not installed; ci/setup.sh installs it")
    pkg_root = Path(next(iter(spec.submodule_search_locations)))
    def python_only(folder, names):  # sources only: compiled extensions and data stay behind
        return [n for n in names if n == "__pycache__" or (not n.endswith(".py") and not os.path.isdir(os.path.join(folder, n)))]

    shutil.copytree(pkg_root, dest / package, ignore=python_only)
    for rel in extra:
        (dest / rel).write_text((pkg_root.parent / rel).read_text())
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "installed release")
    return dest


REAL_CHECK = """
import os, sys, torch
{setup}
torch.manual_seed(0)
for shape in [(5, 37), (3, 4, 64), (2, 9000)]:
    x = torch.randn(*shape); w = torch.randn(shape[-1]); r = torch.randn(*shape)
    got = {call_plain}
    xf = x.float(); ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    out, res = {call_residual}
    s = x + r
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(out, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w, atol=1e-5, rtol=1e-5)
print("REAL-UPSTREAM-OK", {module}.__file__)
"""


def _run_patched(tree: Path, code: str):
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "REAL-UPSTREAM-OK" in proc.stdout, proc.stderr[-3000:]
    assert str(tree) in proc.stdout  # the patched tree's module ran, not an installed copy


@pytest.mark.slow
def test_real_vllm_sources_patch_imports_and_runs(tmp_path):
    tree = _installed_sources("vllm", tmp_path / "vllm")
    out = tmp_path / "out"
    (patch,) = generate("vllm", tree, out)
    report = check(tree, out)
    assert report.ok, (report.patches, report.imports)
    assert report.imports == [("vllm.kernels.triton.rms_norm", None)]
    git(tree, "am", "-q", str(patch))
    # vLLM's own IR-op registry dispatches to the new provider; compare with the math.
    _run_patched(tree, REAL_CHECK.format(
        # Without a GPU driver vLLM hands out a Triton placeholder; give it the real Triton
        # (running in its interpreter) so the patched kernel module can launch on the CPU.
        setup="import triton, triton.language as tl, vllm.triton_utils as tu\n"
              "tu.triton, tu.tl = triton, tl\n"
              "from vllm import ir\nimport vllm.kernels.triton.rms_norm as m",
        call_plain='ir.ops.rms_norm.impls["triton_rms"].impl_fn(x, w, 1e-6, None)',
        call_residual='ir.ops.fused_add_rms_norm.impls["triton_rms"].impl_fn(x, r, w, 1e-6, None)',
        module="m"))


@pytest.mark.slow
def test_real_deepspeed_sources_patch_imports_and_runs(tmp_path):
    tree = _installed_sources("deepspeed", tmp_path / "ds")
    out = tmp_path / "out"
    (patch,) = generate("deepspeed", tree, out)
    assert "generated against deepspeed 0.19.8" in patch.read_text()
    report = check(tree, out, import_check=False)
    assert report.ok
    git(tree, "am", "-q", str(patch))
    _run_patched(tree, REAL_CHECK.format(
        setup="import importlib.util as u\n"
              "spec = u.spec_from_file_location('rms', 'deepspeed/ops/transformer/inference/triton/rms_norm.py')\n"
              "m = u.module_from_spec(spec); spec.loader.exec_module(m)",
        call_plain="m.rms_norm(x, w, 1e-6)", call_residual="m.rms_norm_residual(x, r, w, 1e-6)", module="m"))
