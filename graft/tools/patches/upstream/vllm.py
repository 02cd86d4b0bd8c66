"""vLLM patches: the fix graft's out-of-tree registration needs, and graft's Triton RMSNorm.

1. ``vllm-oot-custom-op-name`` (the series a maintainer takes today).

   Why: ``CustomOp.register_oot`` (how vllm-ascend, graft and other platform plugins replace
   an in-tree op) overwrites the replacement's ``name`` with the registry key, the in-tree
   *class* name (``"RMSNorm"``). ``CustomOp.enabled()`` matches ``compilation_config.custom_ops``
   against ``name``, so ``+rms_norm``/``-rms_norm`` no longer reach the replacement, and
   ``enabled_custom_ops`` reports it under the class name. graft restores the name after
   registering (``graft.adapters.vllm._registration.register_oot``).

   How: ``register_oot`` keeps the name a subclass inherits from a registered in-tree op (for
   ``CustomOp`` and ``PluggableLayer`` alike); classes that are not such a subclass still get
   the registry key, as today. Runs wherever a plugin registers a replacement, with vLLM's
   default configuration; tests in ``tests/model_executor`` (no marker, CPU-only).

2. ``vllm-triton-rms-norm`` (a kernel patch: generated only with GPU numbers).

   Why/How: a Triton RMSNorm in ``RMSNorm.forward_cuda`` behind ``VLLM_USE_TRITON_RMS_NORM=1``
   (read once in ``__init__``), launched as vLLM custom ops with fake impls. ``forward_cuda``
   runs only when the ``rms_norm`` CustomOp is enabled (``custom_ops=["+rms_norm"]``; the
   default under Inductor is ``none``), and vLLM already has a Triton RMSNorm there (the
   batch-invariant one); the message says both.

Upstream: not submitted yet (PR link goes in ``PatchTemplate.upstream``).
Removal plan: see each template's ``retire``.
"""
from __future__ import annotations

import re
from pathlib import Path

from graft.tools.patches import rms_norm_kernel as _rms_norm
from graft.tools.patches.projects import Project, Tool
from graft.tools.patches.template import CreateFile, InsertAfter, PatchTemplate, ReplaceText
from graft.tools.patches.versions import git_tag_version

ENV = "VLLM_USE_TRITON_RMS_NORM"
MODULE_PATH = "vllm/model_executor/layers/triton_rms_norm.py"
LAYERNORM_PATH = "vllm/model_executor/layers/layernorm.py"
ENVS_PATH = "vllm/envs.py"
TEST_PATH = "tests/kernels/core/test_triton_rms_norm.py"

MODULE_HEADER = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton RMSNorm, plain and fused with the residual add.

``RMSNorm.forward_cuda`` uses it when ``VLLM_USE_TRITON_RMS_NORM=1``. The launches
are registered as ``torch.ops.vllm.triton_rms_norm`` and
``torch.ops.vllm.triton_fused_add_rms_norm`` with fake implementations, so
``torch.compile`` traces each as a single op.
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.torch_utils import direct_register_custom_op

'''

MODULE_OPS = '''

def _triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float
) -> torch.Tensor:
    return _launch(x, weight, epsilon)[0]


def _triton_rms_norm_fake(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float
) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _triton_fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, weight, epsilon, residual)


def _triton_fused_add_rms_norm_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, torch.empty_like(out)


direct_register_custom_op(
    op_name="triton_rms_norm",
    op_func=_triton_rms_norm,
    fake_impl=_triton_rms_norm_fake,
)
direct_register_custom_op(
    op_name="triton_fused_add_rms_norm",
    op_func=_triton_fused_add_rms_norm,
    fake_impl=_triton_fused_add_rms_norm_fake,
)


def triton_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` (of ``x + residual``, also returned, when given)."""
    if residual is None:
        return torch.ops.vllm.triton_rms_norm(x, weight, epsilon)
    return torch.ops.vllm.triton_fused_add_rms_norm(x, residual, weight, epsilon)
'''

TEST = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the Triton RMSNorm behind VLLM_USE_TRITON_RMS_NORM.

Run on CUDA-alike GPUs, and on CPU with TRITON_INTERPRET=1 (Triton interpreter).
"""

import os

import pytest
import torch

import vllm.model_executor.layers.layernorm as layernorm
import vllm.model_executor.layers.triton_rms_norm as triton_rms_norm_module
from tests.kernels.utils import opcheck
from vllm import ir
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON

if current_platform.is_cuda_alike():
    DEVICES = ["cuda:0"]
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES = ["cpu"]
else:
    pytest.skip(
        "needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 on CPU",
        allow_module_level=True,
    )

# Nothing here initialises distributed state or device memory to clean up.
pytestmark = pytest.mark.skip_global_cleanup

DTYPES = [torch.half, torch.bfloat16, torch.float]
NUM_TOKENS = [1, 7]
HIDDEN_SIZES = [8, 769, 9000]  # 9000 > 8192: the two-pass streamed path


@pytest.fixture(autouse=True)
def _triton_without_driver(monkeypatch):
    # Without a GPU driver vllm.triton_utils hands out placeholders; the Triton
    # interpreter needs no driver, so bind the real Triton for CPU runs.
    if HAS_TRITON:
        return
    triton = pytest.importorskip("triton")
    module = triton_rms_norm_module
    monkeypatch.setattr(module, "triton", triton)
    monkeypatch.setattr(module, "tl", triton.language)
    monkeypatch.setattr(module, "_rms_norm_kernel", triton.jit(module._rms_norm_kernel))


@pytest.fixture
def vllm_config():
    # Name the device: VllmConfig() cannot infer it on a CPU-only machine.
    device = DeviceConfig(device=DEVICES[0].split(":")[0])
    with set_current_vllm_config(VllmConfig(device_config=device)):
        yield


def _reference(x, weight, eps, residual=None):
    xf = x.float() if residual is None else x.float() + residual.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype), xf.to(x.dtype)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("add_residual", [False, True])
@pytest.mark.parametrize("has_weight", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_triton_rms_norm(
    num_tokens, hidden_size, add_residual, has_weight, dtype, device
):
    torch.manual_seed(0)
    torch.set_default_device(device)
    x = torch.randn(num_tokens, hidden_size, dtype=dtype)
    weight = torch.randn(hidden_size, dtype=dtype) if has_weight else None
    residual = torch.randn_like(x) if add_residual else None
    tol = ir.ops.rms_norm.get_tolerance(dtype)

    got = triton_rms_norm_module.triton_rms_norm(x, weight, 1e-6, residual)
    ref, ref_residual = _reference(x, weight, 1e-6, residual)
    if add_residual:
        got, got_residual = got
        torch.testing.assert_close(got_residual, ref_residual, **tol)
    torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_rms_norm_opcheck(device):
    torch.set_default_device(device)
    x = torch.randn(7, 64, dtype=torch.float)
    weight = torch.randn(64, dtype=torch.float)
    opcheck(torch.ops.vllm.triton_rms_norm, (x, weight, 1e-6))
    opcheck(torch.ops.vllm.triton_rms_norm, (x, None, 1e-6))
    opcheck(
        torch.ops.vllm.triton_fused_add_rms_norm,
        (x, torch.randn_like(x), weight, 1e-6),
    )


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_rms_norm_forward_cuda_dispatch(vllm_config, monkeypatch, enabled, device):
    monkeypatch.setenv("VLLM_USE_TRITON_RMS_NORM", "1" if enabled else "0")
    calls = []
    original = layernorm.triton_rms_norm

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(layernorm, "triton_rms_norm", spy)
    torch.set_default_device(device)
    layer = RMSNorm(256).to(dtype=torch.float)
    layer.weight.data.normal_(mean=1.0, std=0.1)
    x = torch.randn(5, 256, dtype=torch.float)
    residual = torch.randn_like(x)

    torch.testing.assert_close(layer.forward_cuda(x), layer.forward_native(x))
    out, res = layer.forward_cuda(x, residual.clone())
    ref_out, ref_res = layer.forward_native(x, residual.clone())
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(res, ref_res)
    assert len(calls) == (2 if enabled else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_triton_skips_variance_size_override(
    vllm_config, monkeypatch, device
):
    monkeypatch.setenv("VLLM_USE_TRITON_RMS_NORM", "1")
    torch.set_default_device(device)
    assert RMSNorm(64).use_triton
    assert not RMSNorm(64, var_hidden_size=32).use_triton
'''

ENV_DOC = f'''    # Use the Triton RMSNorm kernel in RMSNorm.forward_cuda instead of the
    # default implementation (no compiled extension needed, e.g. on new GPUs).
    "{ENV}": lambda: bool(int(os.getenv("{ENV}", "0"))),
'''


def _changes() -> list:
    module = (MODULE_HEADER + _rms_norm.kernel_and_launcher(name="_launch") + MODULE_OPS)
    return [
        CreateFile(MODULE_PATH, module),
        CreateFile(TEST_PATH, TEST),
        ReplaceText(ENVS_PATH, "    VLLM_BATCH_INVARIANT: bool = False\n",
                    f"    VLLM_BATCH_INVARIANT: bool = False\n    {ENV}: bool = False\n"),
        ReplaceText(ENVS_PATH,
                    '    "VLLM_BATCH_INVARIANT": lambda: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))),\n',
                    '    "VLLM_BATCH_INVARIANT": lambda: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))),\n'
                    + ENV_DOC),
        ReplaceText(LAYERNORM_PATH,
                    "from vllm.model_executor.determinism.batch_invariant import rms_norm_batch_invariant\n",
                    "from vllm.model_executor.determinism.batch_invariant import rms_norm_batch_invariant\n"
                    "from vllm.model_executor.layers.triton_rms_norm import triton_rms_norm\n"),
        ReplaceText(LAYERNORM_PATH,
                    "        self.pass_weight = self.has_weight\n        self.pass_weight_add = self.has_weight\n",
                    "        self.pass_weight = self.has_weight\n        self.pass_weight_add = self.has_weight\n"
                    f"        # Opt-in Triton kernel for forward_cuda; it normalises the whole last dim.\n"
                    f"        self.use_triton = (\n"
                    f"            envs.{ENV} and self.variance_size_override is None\n"
                    f"        )\n"),
        ReplaceText(LAYERNORM_PATH,
                    "                residual=residual,\n            )\n\n        return self.forward_native(x, residual)\n",
                    "                residual=residual,\n            )\n\n"
                    "        if self.use_triton:\n"
                    "            pass_weight = (\n"
                    "                self.pass_weight_add if residual is not None else self.pass_weight\n"
                    "            )\n"
                    "            return triton_rms_norm(\n"
                    "                x,\n"
                    "                self.weight.data if pass_weight else None,\n"
                    "                self.variance_epsilon,\n"
                    "                residual,\n"
                    "            )\n\n"
                    "        return self.forward_native(x, residual)\n"),
    ]


CUSTOM_OP_PATH = "vllm/model_executor/custom_op.py"
OOT_TEST_PATH = "tests/model_executor/test_custom_op_oot_name.py"

OOT_HELPER = '''

def _inherited_op_name(op_cls: type) -> str | None:
    """The name ``op_cls`` inherits from the registered in-tree op it subclasses.

    An out-of-tree replacement keeps it, so ``custom_ops`` directives written for
    the in-tree op (``+rms_norm``, ``-rms_norm``) reach the replacement too.
    """
    name = getattr(op_cls, "name", None)
    in_tree = op_registry.get(name) if isinstance(name, str) else None
    return name if in_tree is not None and issubclass(op_cls, in_tree) else None
'''

OOT_TEST = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An out-of-tree replacement registered with register_oot keeps the in-tree op's
name, so compilation_config.custom_ops switches it like the in-tree op."""

import pytest

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.layernorm import RMSNorm


class OOTRMSNorm(RMSNorm):
    pass


@pytest.fixture
def oot_rms_norm():
    previous = op_registry_oot.pop("RMSNorm", None)
    RMSNorm.register_oot(OOTRMSNorm)
    yield OOTRMSNorm
    op_registry_oot.pop("RMSNorm", None)
    if previous is not None:
        op_registry_oot["RMSNorm"] = previous


@pytest.mark.parametrize(
    "custom_ops,enabled",
    [
        (["none", "+rms_norm"], True),
        (["none"], False),
        (["all", "-rms_norm"], False),
        (["all"], True),
    ],
)
def test_oot_replacement_follows_the_in_tree_switch(oot_rms_norm, custom_ops, enabled):
    # No model is built: name the device so that VllmConfig needs no GPU to infer it,
    # and set custom_ops after platform defaults were applied.
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.compilation_config.custom_ops = custom_ops
    with set_current_vllm_config(config):
        layer = RMSNorm(16)
        assert type(layer) is oot_rms_norm
        assert oot_rms_norm.name == "rms_norm"
        assert oot_rms_norm.enabled() is enabled
    recorded = config.compilation_config.enabled_custom_ops
    assert ("rms_norm" in recorded) is enabled
    assert "RMSNorm" not in recorded


def test_oot_op_without_an_in_tree_base_is_named_by_its_key():
    class StandaloneOp(CustomOp):
        pass

    try:
        CustomOp.register_oot(StandaloneOp, name="StandaloneTestOp")
        assert StandaloneOp.name == "StandaloneTestOp"
    finally:
        op_registry_oot.pop("StandaloneTestOp", None)
'''


def _oot_changes() -> list:
    keep = "            # Subclasses of in-tree ops keep their name (_inherited_op_name).\n"
    return [
        InsertAfter(CUSTOM_OP_PATH, r"^op_registry_oot: dict\[", OOT_HELPER),
        ReplaceText(CUSTOM_OP_PATH,
                    '            assert reg_name not in op_registry_oot, f"Duplicate layer name: {reg_name}"\n'
                    "            layer_cls.name = reg_name\n",
                    '            assert reg_name not in op_registry_oot, f"Duplicate layer name: {reg_name}"\n'
                    + keep + "            layer_cls.name = _inherited_op_name(layer_cls) or reg_name\n"),
        ReplaceText(CUSTOM_OP_PATH,
                    '            assert reg_name not in op_registry_oot, f"Duplicate op name: {reg_name}"\n'
                    "            op_cls.name = reg_name\n",
                    '            assert reg_name not in op_registry_oot, f"Duplicate op name: {reg_name}"\n'
                    + keep + "            op_cls.name = _inherited_op_name(op_cls) or reg_name\n"),
        CreateFile(OOT_TEST_PATH, OOT_TEST),
    ]


def templates() -> list:
    return [
        PatchTemplate(
            name="vllm-oot-custom-op-name",
            framework="vllm",
            supported=">=0.33,<0.36",
            subject="[Bugfix] Keep the in-tree op name on out-of-tree CustomOp replacements",
            motivation="""\
Platform plugins replace in-tree ops with CustomOp.register_oot (e.g.
RMSNorm.register_oot(MyRMSNorm)). register_oot sets the replacement's
name to the registry key, which is the in-tree class name ("RMSNorm"),
while CustomOp.enabled() matches compilation_config.custom_ops against
name. So "+rms_norm" / "-rms_norm" silently stop applying once a plugin
replaces the op: with the default custom_ops="none" under Inductor the
replacement cannot be enabled by its documented name, and
enabled_custom_ops reports it as "RMSNorm".""",
            body="""- register_oot (CustomOp and PluggableLayer): a class that subclasses a
  registered in-tree op keeps the name it inherits ("rms_norm"); other
  classes are still named by their registry key, as before.
- tests/model_executor/test_custom_op_oot_name.py: an RMSNorm replacement
  follows "+rms_norm" / "-rms_norm" under both "none" and "all", is
  recorded in enabled_custom_ops as "rms_norm", and a standalone OOT op
  keeps its key. CPU only, no marker.""",
            changes=_oot_changes,
            import_checks=("vllm.model_executor.custom_op",),
            tests=(OOT_TEST_PATH,),
            retire="once a release carries this, graft.adapters.vllm._registration.register_oot stops restoring "
                   "the in-tree name after CustomOp.register_oot for that release; the line goes when graft's "
                   "minimum vLLM includes it.",
            checked_against={"release": "0.33.0", "vllm-0.34.0": "62d4bc3c7"},
        ),
        _rms_norm.rms_norm_template(
            framework_title="vLLM",
            what="fused.rms_norm override in graft.adapters.vllm",
            name="vllm-triton-rms-norm",
            framework="vllm",
            supported=">=0.33,<0.35",
            subject="Add a Triton RMSNorm kernel to RMSNorm.forward_cuda",
            motivation=f"""\
RMSNorm's CUDA path needs vLLM's compiled _C kernels (or AITER on ROCm).
A Triton kernel gives every CUDA-alike platform Triton supports a fused
RMSNorm (plain and with the residual add) without an extension build, and
an alternative to compare against. It is opt-in ({ENV}=1), so the default
path is unchanged.

vLLM already has a Triton RMSNorm in forward_cuda: rms_norm_batch_invariant,
used with VLLM_BATCH_INVARIANT=1. That kernel fixes its reduction order for
run-to-run determinism; this one is the throughput kernel (single pass from
registers up to 8192 wide, fused residual add), measured below against
F.rms_norm. The two are kept apart so that batch-invariant mode keeps its
guarantee.""",
            body=f"""- vllm/model_executor/layers/triton_rms_norm.py: the kernel, registered as
  torch.ops.vllm.triton_rms_norm and torch.ops.vllm.triton_fused_add_rms_norm
  with fake implementations, so torch.compile traces each as one op;
  weight=None (RMSNorm(has_weight=False)) is supported.
- RMSNorm.forward_cuda: uses it when {ENV}=1 (read once at
  construction), except with var_hidden_size, which it does not cover.
- vllm/envs.py: {ENV} (default 0).
- {TEST_PATH}: numerics against a float32 reference (fp16/bf16/fp32,
  odd and >8192 widths, with and without weight/residual), opcheck of both
  ops, and the forward_cuda dispatch.""",
            changes=_changes,
            import_checks=("vllm.model_executor.layers.triton_rms_norm", "vllm.model_executor.layers.layernorm"),
            tests=(TEST_PATH, "tests/kernels/ir/test_layernorm.py", "tests/test_envs.py"),
            reach=(f"{ENV}=1, and the rms_norm custom op enabled: forward_cuda runs only then "
                   "(compilation_config.custom_ops=['+rms_norm']; with Inductor vLLM's default is 'none', which "
                   "runs forward_native and ignores the variable)."),
            benchmark=("fused", "rms_norm"),
        )
    ]


def _version(root: Path) -> str | None:
    # Built trees and sdists carry vllm/_version.py (vcs-versioning); plain checkouts use tags.
    generated = root / "vllm" / "_version.py"
    if generated.is_file():
        m = re.search(r"""^__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", generated.read_text(), re.M)
        if m:
            return m.group(1)
    return git_tag_version(root)


# ruff v0.14.0 (.pre-commit-config.yaml), configured in pyproject.toml; DCO check on PRs;
# PR titles carry a category tag (CONTRIBUTING: [Kernel], [Core], [Bugfix], ...).
PROJECT = Project(
    framework="vllm", marker="vllm", detect_version=_version, title_tag="[Kernel]", dco=True,
    packages=("ruff==0.14.0",),
    tools=(
        # ruff reads vLLM's settings from pyproject.toml (sdists and checkouts have it; a copy of
        # the installed package does not, and ruff's defaults there would check another style).
        Tool("ruff check", ("ruff", "check", "--no-cache"), ("ruff", "check", "--no-cache", "--fix"),
             config="pyproject.toml"),
        Tool("ruff format", ("ruff", "format", "--no-cache", "--check", "--diff"), ("ruff", "format", "--no-cache"),
             config="pyproject.toml"),
    ))
