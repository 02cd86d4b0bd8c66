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

from graft.tools.patches.check import ALREADY, APPLIES, FAILS, check
from graft.tools.patches.generate import PatchWarning, generate
from graft.tools.patches.template import PatchError
from graft.tools.patches.upstream import deepspeed as ds_template
from graft.tools.patches.upstream import megatron as mlm_template
from graft.tools.patches.upstream import vllm as vllm_template

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
VLLM_CUSTOM_OP = '''op_registry: dict[str, type] = {}
op_registry_oot: dict[str, type] = {}


class PluggableLayer:
    @classmethod
    def register_oot(cls, _decorated_layer_cls=None, name=None):
        def decorator(layer_cls):
            reg_name = name if name is not None else cls.__name__
            assert reg_name not in op_registry_oot, f"Duplicate layer name: {reg_name}"
            layer_cls.name = reg_name
            op_registry_oot[reg_name] = layer_cls
            return layer_cls

        return decorator


class CustomOp:
    @classmethod
    def register_oot(cls, _decorated_op_cls=None, name=None):
        def decorator(op_cls):
            reg_name = name if name is not None else cls.__name__
            assert reg_name not in op_registry_oot, f"Duplicate op name: {reg_name}"
            op_cls.name = reg_name
            op_registry_oot[reg_name] = op_cls
            return op_cls

        return decorator
'''
DS_FUSED_ADAM = ("from deepspeed.accelerator import get_accelerator\nfrom deepspeed.ops.op_builder import FusedAdamBuilder\n\n\n"
                 "class FusedAdam:\n\n    def __init__(self):\n        fused_adam_cuda = FusedAdamBuilder().load()\n")
DS_CPU_ADAM = ("from deepspeed.ops.op_builder import CPUAdamBuilder\n\n\nclass DeepSpeedCPUAdam:\n\n"
               "    def __init__(self):\n        self.ds_opt_adam = CPUAdamBuilder().load()\n")
MLM_LOCAL_SPEC = '''

def get_gpt_layer_local_spec(
    normalization=None,
    use_kitchen: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """Use this spec for an implementation using only modules in Megatron-Core.

    Args:
        qk_l2_norm (bool, optional): To use l2 norm for queries/keys. Defaults to False.

    Returns:
        ModuleSpec: Module specification with Megatron-Core modules
    """
    if use_kitchen:
        assert HAVE_KITCHEN
        backend = KitchenSpecProvider(
            fallback=LocalSpecProvider(),
        )
    else:
        backend = LocalSpecProvider()
'''
DS_INIT = '''# DeepSpeed Team

from .residual_add import residual_add_bias
from .layer_norm import layer_norm, layer_norm_residual
from .gelu import gelu
'''
DS_OP = "from .base import BaseOp\n\n\nclass RMSNormOp(BaseOp):\n\n    def __init__(self, config=None):\n" + ds_template.OP_OLD
DS_PRE_OP = "from .base import BaseOp\n\n\nclass PreRMSNormOp(BaseOp):\n\n    def __init__(self, config=None):\n" + ds_template.PRE_OLD
MLM_SPECS = MLM_LOCAL_SPEC.replace(
    '''    """Use this spec for an implementation using only modules in Megatron-Core.

    Args:
        qk_l2_norm (bool, optional): To use l2 norm for queries/keys. Defaults to False.

    Returns:
        ModuleSpec: Module specification with Megatron-Core modules
    """
''', '''    """Use this spec for an implementation using only modules in Megatron-Core.

    Args:
        qk_l2_norm (bool, optional): To use l2 norm for queries/keys. Defaults to False.
''' + mlm_template.DOC_OLD + '    """\n') + mlm_template.SPEC_OLD + "        pass\n"
assert MLM_SPECS.count(mlm_template.DOC_OLD) == 1


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
        "vllm/model_executor/custom_op.py": VLLM_CUSTOM_OP,
    })


@pytest.fixture
def ds_repo(tmp_path):
    return make_repo(tmp_path / "ds-src", {
        "version.txt": "0.19.8\n",
        "deepspeed/ops/transformer/inference/triton/__init__.py": DS_INIT,
        "deepspeed/ops/transformer/inference/op_binding/rms_norm.py": DS_OP,
        "deepspeed/ops/transformer/inference/op_binding/pre_rms_norm.py": DS_PRE_OP,
        "deepspeed/ops/adam/fused_adam.py": DS_FUSED_ADAM,
        "deepspeed/ops/adam/cpu_adam.py": DS_CPU_ADAM,
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


def bench_json(path: Path, gpu="NVIDIA H200", op="rms_norm") -> Path:
    """A graft/tools/bench/kernels.py results JSON as the benchmark writes it (a GPU run unless gpu=None)."""
    env = {"device": "cuda:0" if gpu else "cpu", "torch": "2.13.0", "triton": "3.6.0"}
    if gpu:
        env["gpu"] = gpu
    results = [{"family": "fused", "name": f"{op}_t{t}_h4096", "params": {"op": op, "T": t, "H": 4096},
                "status": "ok", "ratios": {"graft:triton vs F.rms_norm": r}} for t, r in ((1, 1.25), (4096, 2.0))]
    results.append({"family": "fused", "name": "silu_and_mul_t1_h4096", "params": {"op": "silu_and_mul", "T": 1},
                    "status": "ok", "ratios": {"graft:triton vs eager": 9.0}})
    path.write_text(json.dumps({"environment": env, "summary": {}, "results": results}))
    return path


def kernel(name, tmp_path):
    """generate() arguments for a kernel template, with GPU numbers."""
    return {"names": [name], "bench_results": bench_json(tmp_path / f"bench-{name}.json")}


def graft_cli(*args):
    return subprocess.run([sys.executable, "-m", "graft", "patches", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_writes_git_format_patches_that_git_am_accepts(vllm_repo, tmp_path):
    (patch,) = gen("vllm", vllm_repo, tmp_path / "out", **kernel("vllm-triton-rms-norm", tmp_path))
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
    assert "Testing:" in message and "tests/model_executor/test_custom_op_oot_name.py" in message
    assert "Active in the default configuration" in message
    (patch,) = gen("vllm", vllm_repo, tmp_path / "out2", graft_trailers=True)
    assert "Graft-Template: vllm-oot-custom-op-name" in patch.read_text()


def test_signoff_needs_a_person_and_dco_projects_warn_without_it(vllm_repo, megatron_repo, tmp_path):
    with pytest.raises(PatchError, match="--author"):
        generate("vllm", vllm_repo, tmp_path / "a", signoff=True)
    with pytest.warns(PatchWarning, match="requires a DCO Signed-off-by"):
        (patch,) = generate("vllm", vllm_repo, tmp_path / "b")
    assert "Signed-off-by" not in patch.read_text()
    (patch,) = gen("megatron", megatron_repo, tmp_path / "c")
    text = patch.read_text()
    assert "Subject: [PATCH] Let get_gpt_layer_local_spec take a BackendSpecProvider" in text  # no tag
    assert f"Signed-off-by: {SIGNER}" in text


def test_cover_letter_and_reroll(vllm_repo, tmp_path):
    out = tmp_path / "out"
    (patch,) = gen("vllm", vllm_repo, out, reroll=2, cover_letter=True)
    assert patch.name.startswith("v2-0001-") and "Subject: [PATCH v2 1/1] [Bugfix] " in patch.read_text()
    letter = out / "v2-0000-cover-letter.patch"
    text = letter.read_text()
    assert "Subject: [PATCH v2 0/1] [Bugfix] Keep the in-tree op name" in text
    assert "***" not in text and "This series:" in text and f"{SIGNER}" in text
    # a re-run replaces its own earlier series (the manifest names it): never a mix of two
    (again,) = gen("vllm", vllm_repo, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([again.name, "series.json"])
    assert again.name.startswith("0001-")
    with pytest.raises(PatchError, match="--reroll-count must be a positive integer"):
        gen("vllm", vllm_repo, out, reroll=0)


def test_a_series_of_several_templates_gets_a_cover_letter(vllm_repo, tmp_path):
    from graft.tools.patches.template import CreateFile, PatchTemplate

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
    custom_op = vllm_repo / "vllm/model_executor/custom_op.py"
    custom_op.write_text(custom_op.read_text().replace("            op_cls.name = reg_name\n",
                                                      "            op_cls.name = reg_name  # local\n"))
    with pytest.raises(PatchError, match=r"uncommitted changes \(vllm/model_executor/custom_op.py\).*--allow-dirty"):
        gen("vllm", vllm_repo, tmp_path / "out2")
    with pytest.warns(PatchWarning, match="against HEAD"):
        gen("vllm", vllm_repo, tmp_path / "out3", allow_dirty=True)
    # check looks at the tree on disk: the local edit breaks the patch there, and it says so
    report = check(vllm_repo, out, import_check=False)
    assert report.dirty == ["vllm/model_executor/custom_op.py"]
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
    set_vllm_version(vllm_repo, "0.36.0")  # a release after the declared range, same files
    with pytest.warns(PatchWarning, match=r"vllm 0\.36\.0 is outside the range vllm-oot-custom-op-name was written for \(>=0\.33,<0\.36\)"):
        (patch,) = gen("vllm", vllm_repo, tmp_path / "newer")
    assert patch.is_file()
    report = check(vllm_repo, out, import_check=False)
    assert report.ok and any("still applies" in w for w in report.warnings)
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import", "--no-lint",
                     "--no-tests")
    assert proc.returncode == 0 and "warning:" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("OK")
    # main moved the code the patch anchors on: outside the range and not applying is a refusal
    custom_op = vllm_repo / "vllm/model_executor/custom_op.py"
    custom_op.write_text(custom_op.read_text().replace("op_cls.name = reg_name\n", "op_cls.name = reg_name or name\n"))
    git(vllm_repo, "commit", "-qam", "main moved on")
    with pytest.raises(PatchError, match=r"outside the range .* and the template does not apply"):
        gen("vllm", vllm_repo, tmp_path / "newer2")
    report = check(vllm_repo, out, import_check=False)
    assert report.refusal and "does not apply" in report.refusal and not report.ok


def test_main_branch_prerelease_inside_range(vllm_repo, tmp_path):
    set_vllm_version(vllm_repo, "0.34.1.dev12+g0123abc")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchWarning)
        (patch,) = gen("vllm", vllm_repo, tmp_path / "out", names=["vllm-oot-custom-op-name"])
    assert "[Bugfix]" in patch.read_text()


def test_cli_exit_codes(vllm_repo, tmp_path):
    out = tmp_path / "out"
    proc = graft_cli("generate", "vllm", "--source", str(vllm_repo), "--out", str(out), "--no-format",
                     "--signoff", "--author", SIGNER)
    assert proc.returncode == 0, proc.stderr
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import", "--no-lint", "--no-tests")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "OK: patches apply"
    # a patch that no longer applies: the upstream file changed under it
    custom_op = vllm_repo / "vllm/model_executor/custom_op.py"
    custom_op.write_text(custom_op.read_text().replace("            op_cls.name = reg_name\n", "            op_cls.name = name\n"))
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
        gen("deepspeed", ds_repo, tmp_path / "out", **kernel("deepspeed-triton-rms-norm", tmp_path))
    adam = ds_repo / "deepspeed/ops/adam/fused_adam.py"
    adam.write_text(DS_FUSED_ADAM.replace("FusedAdamBuilder().load()", "FusedAdamBuilder(verbose=True).load()"))
    git(ds_repo, "commit", "-qam", "builder call changed")
    with pytest.raises(PatchError, match=r"text to replace not found in deepspeed/ops/adam/fused_adam.py"):
        gen("deepspeed", ds_repo, tmp_path / "out2")


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
    (patch,) = gen("megatron", megatron_repo, tmp_path / "out", conformance=path,
                   **kernel("megatron-triton-rms-norm", tmp_path))
    text = patch.read_text()
    assert "(NVIDIA H200 sm_90)" in text
    assert ("fused.rms_norm [triton]: 2/2 cases pass, max abs err 0.00781, speedup vs PyTorch median 3.50x "
            "(min 2.50x, max 3.50x)") in text
    assert "fused.rms_norm [hip]: skipped: no ROCm device" in text and "0/1" not in text
    assert "gemm.linear" not in text
    path.write_text("{not json")
    with pytest.raises(PatchError, match="not a graft conformance JSON report"):
        gen("megatron", megatron_repo, tmp_path / "out2", conformance=path, **kernel("megatron-triton-rms-norm", tmp_path))


def test_cpu_conformance_results_say_interpreter_and_claim_no_speedup(megatron_repo, tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report({"name": "cpu", "arch": "x86_64"}, [
        {"backend": "triton", "status": "pass", "max_abs": 0.001, "speedups": {"torch": 0.01}},
        {"backend": "hip", "status": "skipped"}])))
    (patch,) = gen("megatron", megatron_repo, tmp_path / "out", conformance=path,
                   **kernel("megatron-triton-rms-norm", tmp_path))
    text = patch.read_text()
    assert "(CPU, Triton interpreter, numerics only)" in text
    assert "fused.rms_norm [triton]: 1/1 cases pass" in text and "speedup" not in text
    assert "fused.rms_norm [hip]: skipped" in text


def test_templates_document_why_how_upstream_and_removal():
    from graft.tools.patches.generate import available_templates

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
    (patch,) = gen("vllm", tree, out, **kernel("vllm-triton-rms-norm", tmp_path))
    report = check(tree, out, import_check=False)  # the run below imports the patched modules
    assert report.ok, report.patches
    git(tree, "am", "-q", "--keep-non-patch", str(patch))
    # RMSNorm.forward_cuda with VLLM_USE_TRITON_RMS_NORM=1 runs the kernel; compare with forward_native.
    _run_patched(tree, VLLM_LAYER_CHECK)


@pytest.mark.slow
def test_real_deepspeed_sources_patch_imports_and_runs(tmp_path):
    tree = _installed_sources("deepspeed", tmp_path / "ds")
    out = tmp_path / "out"
    (patch,) = gen("deepspeed", tree, out, **kernel("deepspeed-triton-rms-norm", tmp_path))
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
    gen("deepspeed", repo, out, format_code=True, **kernel("deepspeed-triton-rms-norm", tmp_path))
    report = check(repo, out, import_check=False, lint=True)
    assert [r.tool for r in report.lint] == ["yapf", "flake8"] and report.ok, [r.output for r in report.lint]
    # unformatted output (kernel lifted in graft's own style) fails DeepSpeed's yapf, and check says so
    gen("deepspeed", repo, tmp_path / "raw", format_code=False, **kernel("deepspeed-triton-rms-norm", tmp_path))
    report = check(repo, tmp_path / "raw", import_check=False, lint=True)
    assert not report.ok and [r.tool for r in report.lint if not r.ok] == ["yapf"]


# ---------------------------------------------------------------- the tool's edge cases


def test_out_must_be_empty_or_hold_only_an_earlier_series(vllm_repo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "0001-someone-elses.patch").write_text("From 1234 Mon Sep 17 00:00:00 2001\n")
    with pytest.raises(PatchError, match=r"--out .* holds files that are not an earlier graft series "
                                         r"\(0001-someone-elses.patch\)"):
        gen("vllm", vllm_repo, out)
    assert sorted(p.name for p in out.iterdir()) == ["0001-someone-elses.patch"]  # nothing written, nothing lost
    # an earlier series of two patches is replaced whole by a later series of one: never a mix
    (out / "0001-someone-elses.patch").unlink()
    gen("vllm", vllm_repo, out, names=["vllm-oot-custom-op-name", "vllm-triton-rms-norm"],
        bench_results=bench_json(tmp_path / "bench.json"))
    assert len(list(out.glob("0*.patch"))) == 3  # cover letter + 2
    (only,) = gen("vllm", vllm_repo, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([only.name, "series.json"])
    proc = subprocess.run(["git", "-C", str(vllm_repo), "apply", "--check", *map(str, sorted(out.glob("*.patch")))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_out_naming_an_existing_file_is_a_clear_error(vllm_repo, tmp_path):
    target = tmp_path / "patches.txt"
    target.write_text("mine")
    with pytest.raises(PatchError, match=r"--out .*patches.txt is an existing file, not a directory"):
        gen("vllm", vllm_repo, target)
    proc = graft_cli("generate", "vllm", "--source", str(vllm_repo), "--out", str(target), "--no-format")
    assert proc.returncode == 2 and "is an existing file" in proc.stderr and "Traceback" not in proc.stderr
    assert target.read_text() == "mine"


def test_kernel_patches_are_generated_only_with_gpu_numbers(vllm_repo, tmp_path):
    with pytest.warns(PatchWarning, match=r"vllm-triton-rms-norm not generated: a kernel patch is generated only "
                                          r"with GPU benchmark numbers from graft/tools/bench/kernels.py"):
        (patch,) = gen("vllm", vllm_repo, tmp_path / "out")
    assert "oot" in patch.name.lower() or "Keep-the-in-tree" in patch.name
    with pytest.raises(PatchError, match="vllm-triton-rms-norm: a kernel patch .*; none given"):
        gen("vllm", vllm_repo, tmp_path / "out2", names=["vllm-triton-rms-norm"])
    with pytest.raises(PatchError, match="measured on cpu, not a GPU"):
        gen("vllm", vllm_repo, tmp_path / "out3", names=["vllm-triton-rms-norm"],
            bench_results=bench_json(tmp_path / "cpu.json", gpu=None))
    with pytest.raises(PatchError, match="has no measured fused rms_norm case"):
        gen("vllm", vllm_repo, tmp_path / "out4", names=["vllm-triton-rms-norm"],
            bench_results=bench_json(tmp_path / "silu.json", op="silu"))
    (broken := tmp_path / "broken.json").write_text("[]")
    with pytest.raises(PatchError, match="not a graft/tools/bench/kernels.py results JSON"):
        gen("vllm", vllm_repo, tmp_path / "out5", names=["vllm-triton-rms-norm"], bench_results=broken)
    (patch,) = gen("vllm", vllm_repo, tmp_path / "out6", **kernel("vllm-triton-rms-norm", tmp_path))
    message = patch.read_text().split("\n---\n", 1)[0]
    assert "Performance (NVIDIA H200, torch 2.13.0, triton 3.6.0;" in message
    assert "T=1, H=4096: F.rms_norm 1.25x" in message and "T=4096, H=4096: F.rms_norm 2.00x" in message
    assert "geometric mean vs F.rms_norm: 1.58x over 2 cases (min 1.25x, max 2.00x)" in message
    assert "silu" not in message and "no performance claim" not in message
    # the switch is stated, including vLLM's custom_ops default, and why a second Triton RMSNorm
    flat = " ".join(message.split())
    assert "Not active by default. Turned on by: VLLM_USE_TRITON_RMS_NORM=1, and the rms_norm custom op" in flat
    assert "'+rms_norm'" in flat and "rms_norm_batch_invariant" in flat


def test_formatter_config_missing_from_the_tree(tmp_path):
    """Unpacked sdists leave dot-files out: the project's stored copy is used (and said), or
    the error names the missing file."""
    from graft.tools.patches.linters import _configured

    ds_yapf = ds_template.PROJECT.tools[0]
    argv, note = _configured(ds_template.PROJECT, ds_yapf, ds_yapf.check, tmp_path, tmp_path)
    stored = Path(argv[argv.index("--style") + 1])
    assert stored.parent == tmp_path and "COLUMN_LIMIT = 119" in stored.read_text()
    assert "the source tree has no .style.yapf" in note and "yapf used deepspeed's" in note
    flake8 = ds_template.PROJECT.tools[1]
    argv, _ = _configured(ds_template.PROJECT, flake8, flake8.check, tmp_path, tmp_path)
    assert argv[-1] == f"--config={tmp_path / '.flake8'}"
    (tree := tmp_path / "checkout").mkdir()
    (tree / ".style.yapf").write_text("[style]\n")
    assert _configured(ds_template.PROJECT, ds_yapf, ds_yapf.check, tree, tmp_path) == (ds_yapf.check, "")
    ruff = vllm_template.PROJECT.tools[0]
    with pytest.raises(PatchError, match=r"the source tree has no pyproject.toml, which vllm's ruff check reads.*"
                                         r"git checkout"):
        _configured(vllm_template.PROJECT, ruff, ruff.check, tmp_path, tmp_path)


def test_linter_pins_follow_the_trees_pre_commit_config(tmp_path):
    from graft.tools.patches.linters import pinned_packages

    assert pinned_packages(mlm_template.PROJECT, tmp_path) == mlm_template.PROJECT.packages  # sdist: release pins
    (tmp_path / ".pre-commit-config.yaml").write_text(
        "repos:\n- repo: https://github.com/psf/black\n  rev: 'refs/tags/26.3.0:refs/tags/26.3.0'\n  hooks:\n"
        "  - id: black\n- repo: https://github.com/pycqa/pylint\n  rev: v3.2.6\n  hooks:\n  - id: pylint\n")
    assert pinned_packages(mlm_template.PROJECT, tmp_path) == ("black==26.3.0", "isort==5.13.2", "pylint==3.2.6")


def _skipping_template(new_test: str):
    from graft.tools.patches.template import CreateFile, PatchTemplate

    return PatchTemplate(name="t", framework="vllm", supported=">=0.33", subject="[Misc] Add a test", body="Body.",
                         changes=lambda: [CreateFile("tests/test_new.py", new_test)],
                         tests=("tests/test_new.py", "tests/test_old.py"))


def test_check_counts_tests_and_calls_an_all_skipped_run_not_checked(vllm_repo, tmp_path):
    skipped = "import pytest\n\n\ndef test_a():\n    pytest.skip('needs a GPU')\n"
    (vllm_repo / "tests").mkdir()
    (vllm_repo / "tests/test_old.py").write_text(skipped + "\n\ndef test_b():\n    pytest.skip('needs a GPU')\n")
    git(vllm_repo, "add", "-A")
    git(vllm_repo, "commit", "-qm", "existing tests")
    out = tmp_path / "out"
    gen("vllm", vllm_repo, out, templates=[_skipping_template("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")])
    proc = graft_cli("check", "--source", str(vllm_repo), "--patches", str(out), "--no-import", "--no-lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(2 passed, 0 failed, 0 skipped)" in proc.stdout
    assert "NOT CHECKED" in proc.stdout and "not checked: none of them passes here" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert "existing upstream tests: not checked (0 passed, 0 failed, 2 skipped" in last and "no new failures" not in last
    # the patch's own tests all skipped: nothing was checked, and that is a failure
    gen("vllm", vllm_repo, tmp_path / "out2", templates=[_skipping_template(skipped)])
    report = check(vllm_repo, tmp_path / "out2", import_check=False, run_tests=True)
    assert not report.ok and any("new tests were not checked" in f for f in report.failures())
    assert report.tests[0].counts == {"skipped": 1}


def test_explain_says_why_each_patch_matters_upstream():
    from graft.tools.patches.explain import explain

    for framework, module in (("vllm", vllm_template), ("deepspeed", ds_template), ("megatron", mlm_template)):
        text = explain(framework)
        for t in module.templates():
            assert t.name in text
        assert text.count("why upstream wants it:") == len(module.templates())
        assert "where it runs:\n    the default configuration" in text
        assert "not by default; turned on by:" in text  # the kernel patch states its switch
        assert "generated:\n    only with GPU numbers from graft/tools/bench/kernels.py" in text
        assert "graft drops:" in text
    assert "run with -m inference_ops: the project's default selection leaves it out" in " ".join(
        explain("deepspeed").split())
    proc = graft_cli("explain", "megatron")
    assert proc.returncode == 0 and proc.stdout == explain("megatron")
    proc = graft_cli("explain", "tensorflow")
    assert proc.returncode == 2 and "unknown framework 'tensorflow'" in proc.stderr
