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
import warnings
from pathlib import Path

import pytest

from graft.patches.check import ALREADY, APPLIES, FAILS, check
from graft.patches.generate import PatchWarning, generate
from graft.patches.template import PatchError
from graft.adapters.deepspeed import patch as ds_template
from graft.adapters.megatron import patch as mlm_template
from graft.adapters.vllm import patch as vllm_template

SIGNER = "Jane Dev <jane@example.com>"

# Just the upstream text the templates anchor on (the real-source tests below check the anchors
# against the installed releases).
VLLM_ENVS = f"""import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    VLLM_BATCH_INVARIANT: bool = False

environment_variables = {{
{'    "VLLM_BATCH_INVARIANT": lambda: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))),'}
}}
"""
VLLM_LAYERNORM = """from vllm import envs
from vllm.model_executor.determinism.batch_invariant import rms_norm_batch_invariant


class RMSNorm:
    def __init__(self):
        self.pass_weight = self.has_weight
        self.pass_weight_add = self.has_weight

    def forward_cuda(self, x, residual=None):
        if envs.VLLM_BATCH_INVARIANT:
            return rms_norm_batch_invariant(
                x,
                residual=residual,
            )

        return self.forward_native(x, residual)
"""
DS_INIT = '''# DeepSpeed Team

from .residual_add import residual_add_bias
from .layer_norm import layer_norm, layer_norm_residual
from .gelu import gelu
'''
DS_OP = "from .base import BaseOp\n\n\nclass RMSNormOp(BaseOp):\n\n    def __init__(self, config=None):\n" + ds_template.OP_OLD
DS_PRE_OP = "from .base import BaseOp\n\n\nclass PreRMSNormOp(BaseOp):\n\n    def __init__(self, config=None):\n" + ds_template.PRE_OLD
MLM_SPECS = "def get_gpt_layer_local_spec(normalization=None):\n    \"\"\"Spec.\n\n    Args:\n" + mlm_template.DOC_OLD + \
    "    \"\"\"\n" + mlm_template.SPEC_OLD + "        pass\n"


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


def gen(*args, **kwargs):
    """generate() with a DCO sign-off, as a contributor would run it."""
    kwargs.setdefault("signoff", True)
    kwargs.setdefault("author", SIGNER)
    return generate(*args, **kwargs)


@pytest.fixture
def vllm_repo(tmp_path):
    return make_repo(tmp_path / "vllm-src", {
        "vllm/__init__.py": "",
        "vllm/_version.py": "__version__ = version = '0.33.0'\n",
        "vllm/envs.py": VLLM_ENVS,
        "vllm/model_executor/layers/layernorm.py": VLLM_LAYERNORM,
    })


@pytest.fixture
def ds_repo(tmp_path):
    return make_repo(tmp_path / "ds-src", {
        "version.txt": "0.19.8\n",
        "deepspeed/ops/transformer/inference/triton/__init__.py": DS_INIT,
        "deepspeed/ops/transformer/inference/op_binding/rms_norm.py": DS_OP,
        "deepspeed/ops/transformer/inference/op_binding/pre_rms_norm.py": DS_PRE_OP,
    })


@pytest.fixture
def megatron_repo(tmp_path):
    return make_repo(tmp_path / "mlm-src", {
        "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n",
        "megatron/core/fusions/__init__.py": "",
        "megatron/core/models/gpt/gpt_layer_specs.py": MLM_SPECS,
    })


def set_vllm_version(repo, version):
    (repo / "vllm/_version.py").write_text(f"__version__ = version = '{version}'\n")
    git(repo, "commit", "-qam", f"version {version}")


def graft_cli(*args):
    return subprocess.run([sys.executable, "-m", "graft", "patches", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_writes_git_format_patches_that_git_am_accepts(vllm_repo, tmp_path):
    (patch,) = gen("vllm", vllm_repo, tmp_path / "out")
    text = patch.read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] [Kernel] Add a Triton RMSNorm kernel to RMSNorm.forward_cuda" in text
    assert f"Signed-off-by: {SIGNER}" in text and "base-commit: " in text
    assert "new file mode 100644" in text and "+        if self.use_triton:" in text
    assert "+def _rms_norm_kernel(" in text  # graft's kernel itself travels in the patch
    assert "tests/kernels/core/test_triton_rms_norm.py" in text  # with tests in vLLM's layout
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(vllm_repo), str(clone)], check=True)
    git(clone, "am", "-q", "--keep-non-patch", str(patch))  # keep the [Kernel] tag (git am strips [..])
    log = git(clone, "log", "-1", "--format=%an <%ae>|%s").stdout.strip()
    assert log == f"{SIGNER}|[Kernel] Add a Triton RMSNorm kernel to RMSNorm.forward_cuda"
    assert (clone / "vllm/model_executor/layers/triton_rms_norm.py").is_file()


def test_message_has_no_graft_internal_text_unless_asked(vllm_repo, tmp_path):
    (patch,) = gen("vllm", vllm_repo, tmp_path / "out")
    text = patch.read_text()
    message = text.split("\n---\n", 1)[0]
    for internal in ("Graft-", "graft conformance", "Kernel from graft", "Generated-by", "graft 0."):
        assert internal not in text, internal
    assert "Testing:" in message and "TRITON_INTERPRET=1" in message and "no performance claim" in message
    (patch,) = gen("vllm", vllm_repo, tmp_path / "out2", graft_trailers=True)
    assert "Graft-Template: vllm-triton-rms-norm" in patch.read_text()


def test_signoff_needs_a_person_and_dco_projects_warn_without_it(vllm_repo, megatron_repo, tmp_path):
    with pytest.raises(PatchError, match="--author"):
        generate("vllm", vllm_repo, tmp_path / "a", signoff=True)
    with pytest.warns(PatchWarning, match="requires a DCO Signed-off-by"):
        (patch,) = generate("vllm", vllm_repo, tmp_path / "b")
    assert "Signed-off-by" not in patch.read_text()
    (patch,) = gen("megatron", megatron_repo, tmp_path / "c")
    text = patch.read_text()
    assert "Subject: [PATCH] Add a Triton RMSNorm module" in text  # Megatron titles carry no tag
    assert f"Signed-off-by: {SIGNER}" in text


def test_cover_letter_and_reroll(vllm_repo, tmp_path):
    out = tmp_path / "out"
    (patch,) = gen("vllm", vllm_repo, out, reroll=2, cover_letter=True)
    assert patch.name.startswith("v2-0001-") and "Subject: [PATCH v2 1/1] [Kernel] " in patch.read_text()
    letter = out / "v2-0000-cover-letter.patch"
    text = letter.read_text()
    assert "Subject: [PATCH v2 0/1] [Kernel] Add a Triton RMSNorm kernel" in text
    assert "***" not in text and "This series:" in text and f"{SIGNER}" in text
    # a re-run replaces its own output (the manifest names it) and leaves other files alone
    (out / "notes.txt").write_text("mine")
    (again,) = gen("vllm", vllm_repo, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([again.name, "notes.txt", "series.json"])
    assert again.name.startswith("0001-")
    with pytest.raises(PatchError, match="--reroll-count must be a positive integer"):
        gen("vllm", vllm_repo, out, reroll=0)


def test_a_series_of_several_templates_gets_a_cover_letter(vllm_repo, tmp_path):
    from graft.patches.template import CreateFile, PatchTemplate

    def template(name, path):
        return PatchTemplate(name=name, framework="vllm", supported=">=0.33", subject=f"Add {path}",
                             body="What changes.", motivation="Why.", changes=lambda: [CreateFile(path, "x = 1\n")])

    written = gen("vllm", vllm_repo, tmp_path / "out", templates=[template("a", "a.py"), template("b", "b.py")])
    assert [p.name[:5] for p in written] == ["0001-", "0002-"]
    letter = (tmp_path / "out" / "0000-cover-letter.patch").read_text()
    assert "[PATCH 0/2]" in letter and "[Kernel] Add a.py" in letter and "[Kernel] Add b.py" in letter


@pytest.mark.parametrize("framework,repo", [("vllm", "vllm_repo"), ("deepspeed", "ds_repo"), ("megatron", "megatron_repo")])
def test_each_framework_applies_cleanly_and_compiles(framework, repo, request, tmp_path):
    source = request.getfixturevalue(repo)
    patches = gen(framework, source, tmp_path / "out")
    assert len(patches) == 1
    report = check(source, tmp_path / "out", import_check=False)
    assert [p.status for p in report.patches] == [APPLIES]
    assert report.compiled and all(err is None for _, err in report.compiled)
    assert report.ok and not report.dirty and not report.warnings


def test_generation_is_deterministic(vllm_repo, tmp_path):
    out = tmp_path / "out"
    (first,) = gen("vllm", vllm_repo, out)
    before = first.read_bytes()
    (second,) = gen("vllm", vllm_repo, out)
    assert second.read_bytes() == before


def test_already_applied_is_reported_and_never_ok(vllm_repo, tmp_path):
    out = tmp_path / "out"
    (patch,) = gen("vllm", vllm_repo, out)
    git(vllm_repo, "am", "-q", str(patch))
    report = check(vllm_repo, out, import_check=False)
    assert [p.status for p in report.patches] == [ALREADY] and not report.ok
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import")
    assert proc.returncode == 1 and "already applied" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED")
    with pytest.raises(PatchError, match="already"):
        gen("vllm", vllm_repo, tmp_path / "again")


def test_dirty_tree_refused_by_generate_and_reported_by_check(vllm_repo, tmp_path):
    out = tmp_path / "out"
    gen("vllm", vllm_repo, out)
    layernorm = vllm_repo / "vllm/model_executor/layers/layernorm.py"
    layernorm.write_text(layernorm.read_text().replace("        return self.forward_native(x, residual)\n",
                                                      "        return self.forward_native(x, residual)  # local\n"))
    with pytest.raises(PatchError, match=r"uncommitted changes \(vllm/model_executor/layers/layernorm.py\).*--allow-dirty"):
        gen("vllm", vllm_repo, tmp_path / "out2")
    with pytest.warns(PatchWarning, match="against HEAD"):
        gen("vllm", vllm_repo, tmp_path / "out3", allow_dirty=True)
    # check looks at the tree on disk: the local edit breaks the patch there, and it says so
    report = check(vllm_repo, out, import_check=False)
    assert report.dirty == ["vllm/model_executor/layers/layernorm.py"]
    assert any("uncommitted changes" in w for w in report.warnings)
    assert [p.status for p in report.patches] == [FAILS] and not report.ok
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import")
    assert proc.returncode == 1 and "uncommitted changes" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED")


def test_dirty_tree_that_still_applies_is_a_warning(vllm_repo, tmp_path):
    out = tmp_path / "out"
    gen("vllm", vllm_repo, out)
    (vllm_repo / "NOTES.md").write_text("untracked\n")
    report = check(vllm_repo, out, import_check=False)
    assert report.dirty == ["NOTES.md"] and report.ok and report.warnings


def test_newer_than_range_warns_when_it_applies_and_refuses_when_not(vllm_repo, tmp_path):
    out = tmp_path / "out"
    gen("vllm", vllm_repo, out)
    set_vllm_version(vllm_repo, "0.35.0")  # a release after the declared range, same files
    with pytest.warns(PatchWarning, match=r"vllm 0\.35\.0 is outside the range vllm-triton-rms-norm was written for \(>=0\.33,<0\.35\)"):
        (patch,) = gen("vllm", vllm_repo, tmp_path / "newer")
    assert patch.is_file()
    report = check(vllm_repo, out, import_check=False)
    assert report.ok and any("still applies" in w for w in report.warnings)
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import", "--no-lint",
                     "--no-tests")
    assert proc.returncode == 0 and "warning:" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("OK")
    # main moved the code the patch anchors on: outside the range and not applying is a refusal
    layernorm = vllm_repo / "vllm/model_executor/layers/layernorm.py"
    layernorm.write_text(layernorm.read_text().replace("rms_norm_batch_invariant\n", "rms_norm_bi\n"))
    git(vllm_repo, "commit", "-qam", "main moved on")
    with pytest.raises(PatchError, match=r"outside the range .* and the template does not apply"):
        gen("vllm", vllm_repo, tmp_path / "newer2")
    report = check(vllm_repo, out, import_check=False)
    assert report.refusal and "does not apply" in report.refusal and not report.ok


def test_main_branch_prerelease_inside_range(vllm_repo, tmp_path):
    set_vllm_version(vllm_repo, "0.34.1.dev12+g0123abc")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchWarning)
        (patch,) = gen("vllm", vllm_repo, tmp_path / "out")
    assert "[Kernel]" in patch.read_text()


def test_cli_exit_codes(vllm_repo, tmp_path):
    out = tmp_path / "out"
    proc = graft_cli("generate", "vllm", "--source", str(vllm_repo), "--out", str(out), "--no-format",
                     "--signoff", "--author", SIGNER)
    assert proc.returncode == 0, proc.stderr
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import", "--no-lint", "--no-tests")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "OK: patches apply"
    # a patch that no longer applies: the upstream file changed under it
    envs = vllm_repo / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VLLM_BATCH_INVARIANT: bool = False", "VLLM_BATCH_INVARIANT: bool = True"))
    git(vllm_repo, "commit", "-qam", "drift")
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import", "--no-lint", "--no-tests")
    assert proc.returncode == 1 and FAILS in proc.stdout and "patch does not apply" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED")
    proc = graft_cli("generate", "vllm", "--source", str(tmp_path / "missing"), "--out", str(out), "--no-format")
    assert proc.returncode == 2 and "does not look like a vllm source tree" in proc.stderr


def test_missing_anchor_is_a_clear_error(ds_repo, tmp_path):
    init = ds_repo / "deepspeed/ops/transformer/inference/triton/__init__.py"
    init.write_text(DS_INIT.replace("from .layer_norm import layer_norm, layer_norm_residual\n", ""))
    git(ds_repo, "commit", "-qam", "layer norm moved")
    with pytest.raises(PatchError, match=r"anchor .* not found in deepspeed/ops/transformer/inference/triton/__init__.py"):
        gen("deepspeed", ds_repo, tmp_path / "out")


def test_plain_directory_source_and_version_override(tmp_path):
    source = make_repo(tmp_path / "sdist", {"megatron/core/fusions/__init__.py": "",
                                            "megatron/core/models/gpt/gpt_layer_specs.py": MLM_SPECS}, commit=False)
    with pytest.raises(PatchError, match="pass --upstream-version"):
        gen("megatron", source, tmp_path / "out")
    (patch,) = gen("megatron", source, tmp_path / "out", upstream_version="0.16.0")
    assert "base-commit" not in patch.read_text()  # no upstream commit to name
    assert check(source, tmp_path / "out", upstream_version="0.16.0", import_check=False).ok


def test_version_override_must_agree(megatron_repo, tmp_path):
    with pytest.raises(PatchError, match="disagrees"):
        gen("megatron", megatron_repo, tmp_path / "out", upstream_version="0.16.2")


def _report(device, impls):
    return {"meta": {"graft_version": "0.1.0", "device": device},
            "cases": [{"op": "fused.rms_norm", "case": f"c{i}", "dtype": "float16", "impls": [impl]}
                      for i, impl in enumerate(impls)]
            + [{"op": "gemm.linear", "case": "x", "dtype": "float16",
                "impls": [{"backend": "triton", "status": "fail", "max_abs": 9.0}]}]}


def test_gpu_conformance_results_name_the_device_and_speedups(megatron_repo, tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report({"name": "NVIDIA H200", "arch": "sm_90"}, [
        {"backend": "triton", "status": "pass", "max_abs": 0.0009765625, "speedups": {"torch": 2.5}},
        {"backend": "triton", "status": "pass", "max_abs": 0.0078125, "speedups": {"torch": 3.5}},
        {"backend": "hip", "status": "skip", "reason": "no ROCm device"}])))
    (patch,) = gen("megatron", megatron_repo, tmp_path / "out", conformance=path)
    text = patch.read_text()
    assert "(NVIDIA H200 sm_90)" in text
    assert ("fused.rms_norm [triton]: 2/2 cases pass, max abs err 0.00781, speedup vs PyTorch median 3.50x "
            "(min 2.50x, max 3.50x)") in text
    assert "fused.rms_norm [hip]: skipped: no ROCm device" in text and "0/1" not in text
    assert "gemm.linear" not in text
    path.write_text("{not json")
    with pytest.raises(PatchError, match="not a graft conformance JSON report"):
        gen("megatron", megatron_repo, tmp_path / "out2", conformance=path)


def test_cpu_conformance_results_say_interpreter_and_claim_no_speedup(megatron_repo, tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report({"name": "cpu", "arch": "x86_64"}, [
        {"backend": "triton", "status": "pass", "max_abs": 0.001, "speedups": {"torch": 0.01}},
        {"backend": "hip", "status": "skipped"}])))
    (patch,) = gen("megatron", megatron_repo, tmp_path / "out", conformance=path)
    text = patch.read_text()
    assert "(CPU, Triton interpreter, numerics only)" in text
    assert "fused.rms_norm [triton]: 1/1 cases pass" in text and "speedup" not in text
    assert "fused.rms_norm [hip]: skipped" in text


def test_templates_document_why_how_upstream_and_removal():
    from graft.patches.generate import available_templates

    templates = available_templates()
    assert {t.framework for t in templates} >= {"vllm", "deepspeed", "megatron"}
    for t in templates:
        assert t.motivation and t.body and t.tests and t.upstream and "graft" in t.retire, t.name
        assert t.tests[0].startswith("tests/"), t.name
    for module in (vllm_template, ds_template, mlm_template):
        doc = module.__doc__
        assert "Why:" in doc and "How:" in doc and "Upstream:" in doc and "Removal plan" in doc


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


VLLM_LAYER_CHECK = """
import os, torch, triton
os.environ["VLLM_USE_TRITON_RMS_NORM"] = "1"
import vllm.model_executor.layers.triton_rms_norm as m
# Without a GPU driver vLLM hands out Triton placeholders; the interpreter needs none.
m.triton, m.tl, m._rms_norm_kernel = triton, triton.language, triton.jit(m._rms_norm_kernel)
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
torch.manual_seed(0)
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    for hidden, has_weight in [(37, True), (64, False), (9000, True)]:
        layer = RMSNorm(hidden, has_weight=has_weight)
        assert layer.use_triton
        if has_weight:
            layer.weight.data.normal_(1.0, 0.1)
        x, r = torch.randn(3, hidden), torch.randn(3, hidden)
        torch.testing.assert_close(layer.forward_cuda(x), layer.forward_native(x))
        got, ref = layer.forward_cuda(x, r.clone()), layer.forward_native(x, r.clone())
        torch.testing.assert_close(got, ref)
    # traced as one op with its fake implementation (what vLLM's compile passes see)
    fn = torch.compile(lambda x, w: torch.ops.vllm.triton_rms_norm(x, w, 1e-6) * 2, fullgraph=True, backend="aot_eager")
    x, w = torch.randn(4, 64), torch.randn(64)
    torch.testing.assert_close(fn(x, w), m.triton_rms_norm(x, w, 1e-6) * 2)
print("REAL-UPSTREAM-OK", m.__file__)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_vllm_sources_patch_imports_and_runs(tmp_path):
    tree = _installed_sources("vllm", tmp_path / "vllm")
    out = tmp_path / "out"
    (patch,) = gen("vllm", tree, out)
    report = check(tree, out, import_check=False)  # the run below imports the patched modules
    assert report.ok, report.patches
    git(tree, "am", "-q", "--keep-non-patch", str(patch))
    # RMSNorm.forward_cuda with VLLM_USE_TRITON_RMS_NORM=1 runs the kernel; compare with forward_native.
    _run_patched(tree, VLLM_LAYER_CHECK)


@pytest.mark.slow
def test_real_deepspeed_sources_patch_imports_and_runs(tmp_path):
    tree = _installed_sources("deepspeed", tmp_path / "ds")
    out = tmp_path / "out"
    (patch,) = gen("deepspeed", tree, out)
    report = check(tree, out, import_check=False)
    assert report.ok
    git(tree, "am", "-q", str(patch))
    _run_patched(tree, REAL_CHECK.format(
        setup="import importlib.util as u\n"
              "spec = u.spec_from_file_location('rms', 'deepspeed/ops/transformer/inference/triton/rms_norm.py')\n"
              "m = u.module_from_spec(spec); spec.loader.exec_module(m)",
        call_plain="m.rms_norm(x, w, 1e-6)", call_residual="m.rms_norm_residual(x, r, w, 1e-6)", module="m"))


DS_LINT_FILES = {".style.yapf": "[style]\nSPLIT_ALL_COMMA_SEPARATED_VALUES = false\nCOLUMN_LIMIT = 119\n",
                 ".flake8": "[flake8]\nignore = E,F403,F405,F541,F841,W\nselect = E9,F,W6\nper-file-ignores =\n"
                            "    __init__.py:F401\n"}


@pytest.mark.slow
def test_project_linters_format_and_check_the_patch(tmp_path):
    """DeepSpeed's yapf/flake8 with its config (installed into the scratch linter venv on first use)."""
    repo = make_repo(tmp_path / "ds-src", {
        "version.txt": "0.19.8\n", **DS_LINT_FILES,
        "deepspeed/ops/transformer/inference/triton/__init__.py": DS_INIT,
        "deepspeed/ops/transformer/inference/op_binding/rms_norm.py": DS_OP,
        "deepspeed/ops/transformer/inference/op_binding/pre_rms_norm.py": DS_PRE_OP,
    })
    out = tmp_path / "out"
    gen("deepspeed", repo, out, format_code=True)
    report = check(repo, out, import_check=False, lint=True)
    assert [r.tool for r in report.lint] == ["yapf", "flake8"] and report.ok, [r.output for r in report.lint]
    # unformatted output (kernel lifted in graft's own style) fails DeepSpeed's yapf, and check says so
    gen("deepspeed", repo, tmp_path / "raw", format_code=False)
    report = check(repo, tmp_path / "raw", import_check=False, lint=True)
    assert not report.ok and [r.tool for r in report.lint if not r.ok] == ["yapf"]
