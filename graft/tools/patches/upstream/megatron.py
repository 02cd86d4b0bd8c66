"""Megatron-core patches: the extension point graft's integration needs, and graft's Triton RMSNorm.

1. ``megatron-local-spec-backend`` (the series a maintainer takes today).

   Why: Megatron builds a layer's submodules from a ``BackendSpecProvider`` (local, TE,
   Kitchen, inference), but ``get_gpt_layer_local_spec`` always constructs its own
   ``LocalSpecProvider`` (or ``KitchenSpecProvider``). A library with its own norm, linear,
   attention or MoE modules cannot hand it a provider, so graft re-assembles the whole layer
   spec (``graft.adapters.megatron.spec.get_gpt_layer_graft_spec``) and has to follow every
   upstream change to it.

   How: ``get_gpt_layer_local_spec`` (0.16) / ``get_gpt_layer_local_submodules`` (main) take
   ``backend: Optional[BackendSpecProvider] = None``; ``None`` keeps today's choice, so
   every existing caller, ``pretrain_gpt.py --transformer-impl local`` included, builds the
   identical spec. Regex edits cover both the release and main, whose function around the
   change was split in two. Tests in ``tests/unit_tests/models`` (no marker, CPU-only).

2. ``megatron-triton-rms-norm`` (a kernel patch: generated only with GPU numbers).

   Why/How: ``TritonRMSNorm`` (Triton forward, fp32 backward) selected with
   ``get_gpt_layer_local_spec(normalization="TritonRMSNorm")``; reachable from the Python
   API only (``TransformerConfig.normalization`` does not name it), as its message says.

Upstream: not submitted yet. Removal plan: see each template's ``retire``.
"""
from __future__ import annotations

import re
from pathlib import Path

from graft.tools.patches import rms_norm_kernel as _rms_norm
from graft.tools.patches.projects import Project, Tool
from graft.tools.patches.template import CreateFile, PatchTemplate, ReplaceRegex, ReplaceText
from graft.tools.patches.versions import git_tag_version

MODULE_PATH = "megatron/core/fusions/fused_rms_norm_triton.py"
SPECS_PATH = "megatron/core/models/gpt/gpt_layer_specs.py"
TEST_PATH = "tests/unit_tests/fusions/test_rms_norm_triton.py"

HEADER = '''\
# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.
"""Triton RMSNorm (forward kernel, fp32 backward) as a norm module for layer specs."""

import torch
import triton
import triton.language as tl

from megatron.core.transformer import TransformerConfig

'''

MODULE = '''

class _TritonRMSNormFunction(torch.autograd.Function):
    """Forward through the Triton kernel; backward recomputes the norm in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # pylint: disable=arguments-differ
        """Normalise x with the Triton kernel; keep x and the weight for backward."""
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm(x, weight, eps)[0]

    @staticmethod
    def backward(ctx, grad_out):  # pylint: disable=arguments-differ
        """Gradients for x and the weight, from the norm recomputed in fp32."""
        x, weight = ctx.saved_tensors
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        x_hat = xf * rstd
        grad = grad_out.float()
        grad_x_hat = grad * weight.float()
        grad_x = rstd * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
        grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class TritonRMSNorm(torch.nn.Module):
    """RMSNorm with a Triton forward kernel, for ModuleSpec norm submodules.

    Args:
        config (TransformerConfig): params_dtype, sequence_parallel and
            layernorm_zero_centered_gamma are honoured.
        hidden_size (int): size of the normalised (last) dimension.
        eps (float): added to the mean square before the reciprocal square root.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        del kwargs  # persist_layer_norm etc.: accepted for the norm-module signature, unused
        self.config = config
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise x over its last dimension and scale by the weight."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return _TritonRMSNormFunction.apply(x, weight, self.eps)
'''

TEST = '''\
# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.
import os

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":  # Triton's interpreter runs on CPU tensors
    DEVICE = "cpu"
else:
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)

from megatron.core.fusions.fused_rms_norm_triton import TritonRMSNorm  # noqa: E402


def _config(**kwargs):
    return TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", **kwargs
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 769, 9000])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_triton_rms_norm_matches_torch(dtype, hidden_size, zero_centered_gamma):
    config = _config(params_dtype=dtype, layernorm_zero_centered_gamma=zero_centered_gamma)
    norm = TritonRMSNorm(config, hidden_size, eps=1e-5).to(DEVICE)
    ref = torch.nn.RMSNorm(hidden_size, eps=1e-5, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        norm.weight.normal_(mean=0.0 if zero_centered_gamma else 1.0, std=0.1)
        ref.weight.copy_(norm.weight.float() + (1 if zero_centered_gamma else 0))
    x = torch.randn(3, 5, hidden_size, device=DEVICE, dtype=dtype, requires_grad=True)
    x_ref = x.detach().float().requires_grad_()
    grad = torch.randn(3, 5, hidden_size, device=DEVICE, dtype=dtype)

    out = norm(x)
    out.backward(grad)
    out_ref = ref(x_ref)
    out_ref.backward(grad.float())

    tols = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), out_ref, **tols)
    torch.testing.assert_close(x.grad.float(), x_ref.grad, **tols)
    torch.testing.assert_close(norm.weight.grad.float(), ref.weight.grad, rtol=2e-2, atol=5e-2)


def test_sequence_parallel_attribute():
    norm = TritonRMSNorm(_config(sequence_parallel=False), 64)
    assert norm.weight.sequence_parallel is False


def test_local_spec_selects_triton_rms_norm():
    spec = get_gpt_layer_local_spec(normalization="TritonRMSNorm")
    assert spec.submodules.input_layernorm is TritonRMSNorm
    assert spec.submodules.pre_mlp_layernorm is TritonRMSNorm
'''

SPEC_OLD = '''    # Adjust for RMS norm.
    if normalization == "RMSNorm":
'''
SPEC_NEW = '''    # Adjust for RMS norm.
    if normalization == "TritonRMSNorm":
        from megatron.core.fusions.fused_rms_norm_triton import TritonRMSNorm

        layer_norm = qk_norm = TritonRMSNorm
    elif normalization == "RMSNorm":
'''
DOC_OLD = """
    Returns:
        ModuleSpec: Module specification with Megatron-Core modules
"""
# Inserted before the "Returns:" section, so it composes with megatron-local-spec-backend,
# which adds its own argument after qk_l2_norm.
DOC_NEW = """        normalization (str, optional): "RMSNorm" for RMSNorm, "TritonRMSNorm" for the
            Triton RMSNorm in megatron.core.fusions.fused_rms_norm_triton, else LayerNorm.
"""
# The "Returns:" line of the release (0.16) and of main, where the function builds submodules.
DOC_PATTERN = (r"^(\n    Returns:\n        (?:ModuleSpec: Module specification with Megatron-Core modules|"
               r"TransformerLayerSubmodules: Megatron-Core modules to construct a TransformerLayer)\n)")


def _changes() -> list:
    return [
        CreateFile(MODULE_PATH, HEADER + _rms_norm.kernel_and_launcher(name="_rms_norm") + MODULE),
        ReplaceText(SPECS_PATH, SPEC_OLD, SPEC_NEW),
        ReplaceRegex(SPECS_PATH, DOC_PATTERN, DOC_NEW.replace("\\", "\\\\") + r"\1",
                     applied=r'^        normalization \(str, optional\): "RMSNorm" for RMSNorm, "TritonRMSNorm"'),
        CreateFile(TEST_PATH, TEST),
    ]


BACKEND_TEST_PATH = "tests/unit_tests/models/test_gpt_layer_local_spec_backend.py"

BACKEND_SIG = (r'^    kitchen_attention_backend: str = "sdpa",\n'
               r'(\) -> (?:ModuleSpec|TransformerLayerSubmodules):\n'
               r'    """Use (?:this spec|these submodules) for an implementation using only modules in Megatron-Core\.)')
BACKEND_DOC = (r'^(        qk_l2_norm \(bool, optional\): To use l2 norm for queries/keys\. Defaults to False\.\n)'
               r'(\n    Returns:\n        (?:ModuleSpec: Module specification with Megatron-Core modules|'
               r'TransformerLayerSubmodules: Megatron-Core modules to construct a TransformerLayer)\n)')
BACKEND_KITCHEN = (r'^    if use_kitchen:\n        assert HAVE_KITCHEN\n        backend = KitchenSpecProvider\(\n'
                   r'            fallback=LocalSpecProvider\(\),\n')

BACKEND_TEST = '''\
# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.
"""get_gpt_layer_local_spec(backend=...): the provider's modules fill every submodule slot."""

import pytest

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class VendorNorm(WrappedTorchNorm):
    pass


class VendorColumnParallelLinear(ColumnParallelLinear):
    pass


class VendorRowParallelLinear(RowParallelLinear):
    pass


class VendorDotProductAttention(DotProductAttention):
    pass


class VendorSpecProvider(LocalSpecProvider):
    """A library's own modules, Megatron's local ones for everything else."""

    def layer_norm(self, rms_norm=False, for_qk=False, **kwargs):
        return VendorNorm

    def column_parallel_linear(self):
        return VendorColumnParallelLinear

    def row_parallel_linear(self):
        return VendorRowParallelLinear

    def core_attention(self):
        return VendorDotProductAttention


def _slots(spec):
    """The module chosen for each norm, linear and core-attention slot of a layer spec."""
    layer = spec.submodules
    attention = layer.self_attention.submodules
    # The MLP is a ModuleSpec, or on newer versions a functools.partial of MLP.
    mlp = layer.mlp.submodules if hasattr(layer.mlp, "submodules") else layer.mlp.keywords["submodules"]
    return {
        "input_layernorm": layer.input_layernorm,
        "pre_mlp_layernorm": layer.pre_mlp_layernorm,
        "q_layernorm": attention.q_layernorm,
        "k_layernorm": attention.k_layernorm,
        "linear_qkv": attention.linear_qkv,
        "core_attention": attention.core_attention,
        "linear_proj": attention.linear_proj,
        "linear_fc1": mlp.linear_fc1,
        "linear_fc2": mlp.linear_fc2,
    }


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_default_backend_is_local_spec_provider(normalization):
    default = get_gpt_layer_local_spec(qk_layernorm=True, normalization=normalization)
    explicit = get_gpt_layer_local_spec(
        qk_layernorm=True, normalization=normalization, backend=LocalSpecProvider()
    )
    assert _slots(default) == _slots(explicit)
    assert _slots(default)["core_attention"] is DotProductAttention


def test_backend_modules_fill_the_layer_spec():
    spec = get_gpt_layer_local_spec(qk_layernorm=True, backend=VendorSpecProvider())
    assert _slots(spec) == {
        "input_layernorm": VendorNorm,
        "pre_mlp_layernorm": VendorNorm,
        "q_layernorm": VendorNorm,
        "k_layernorm": VendorNorm,
        "linear_qkv": VendorColumnParallelLinear,
        "core_attention": VendorDotProductAttention,
        "linear_proj": VendorRowParallelLinear,
        "linear_fc1": VendorColumnParallelLinear,
        "linear_fc2": VendorRowParallelLinear,
    }


def test_backend_and_use_kitchen_are_exclusive():
    with pytest.raises(ValueError, match="backend or use_kitchen"):
        get_gpt_layer_local_spec(backend=VendorSpecProvider(), use_kitchen=True)
'''


def _backend_changes() -> list:
    return [
        ReplaceRegex(SPECS_PATH, BACKEND_SIG,
                     '    kitchen_attention_backend: str = "sdpa",\n    backend: Optional[BackendSpecProvider] = None,\n\\1',
                     applied=r"^    backend: Optional\[BackendSpecProvider\] = None,$"),
        ReplaceRegex(SPECS_PATH, BACKEND_DOC,
                     "\\1        backend (BackendSpecProvider, optional): Provider of the norm, linear, core\n"
                     "            attention and MLP/MoE modules. Defaults to LocalSpecProvider\n"
                     "            (KitchenSpecProvider with use_kitchen).\n\\2"),
        ReplaceRegex(SPECS_PATH, BACKEND_KITCHEN,
                     "    if backend is not None:\n"
                     "        if use_kitchen:\n"
                     '            raise ValueError("pass either backend or use_kitchen, not both")\n'
                     "    elif use_kitchen:\n"
                     "        assert HAVE_KITCHEN\n"
                     "        backend = KitchenSpecProvider(\n"
                     "            fallback=LocalSpecProvider(),\n"),
        CreateFile(BACKEND_TEST_PATH, BACKEND_TEST),
    ]


def templates() -> list:
    return [
        PatchTemplate(
            name="megatron-local-spec-backend",
            framework="megatron",
            supported=">=0.16,<0.21",
            subject="Let get_gpt_layer_local_spec take a BackendSpecProvider",
            motivation="""\
Layer specs are built from a BackendSpecProvider (local, TE, Kitchen,
inference), which is the natural place for a library or a hardware vendor
to supply its own norm, linear, core-attention or MoE modules. But
get_gpt_layer_local_spec always constructs its own LocalSpecProvider (or
KitchenSpecProvider), so such a provider cannot be used with it: the
caller has to copy the whole spec function and keep the copy in step with
every change to it.""",
            body="""- get_gpt_layer_local_spec (get_gpt_layer_local_submodules on main) takes
  backend: Optional[BackendSpecProvider] = None. None keeps today's choice
  (LocalSpecProvider, or KitchenSpecProvider with use_kitchen), so every
  existing caller, pretrain_gpt.py with --transformer-impl local included,
  gets the identical spec; passing both backend and use_kitchen is a
  ValueError.
- tests/unit_tests/models/test_gpt_layer_local_spec_backend.py: the
  default equals an explicit LocalSpecProvider (LayerNorm and RMSNorm),
  a provider's modules fill every norm, linear and core-attention slot,
  and backend with use_kitchen is refused. CPU only, no marker.""",
            changes=_backend_changes,
            import_checks=("megatron.core.models.gpt.gpt_layer_specs",),
            tests=(BACKEND_TEST_PATH, "tests/unit_tests/transformer/test_spec_customization.py"),
            # tests/unit_tests/conftest.py needs Transformer Engine (is_te_min_version in an autouse
            # fixture) and downloads test data; these tests need neither.
            test_args=("--noconftest",),
            retire="once a release carries this, graft.adapters.megatron.spec.get_gpt_layer_graft_spec becomes "
                   "get_gpt_layer_local_spec(..., backend=GraftSpecProvider(off)) for that release, and graft's "
                   "copy of the layer structure is deleted when graft's minimum megatron-core includes it.",
            checked_against={"release": "0.16.1", "megatron-main": "d98e8a64ddf34856e74b24714e3bedb2f5a39553"},
        ),
        _rms_norm.rms_norm_template(
            framework_title="Megatron-core",
            what="norm override in graft.adapters.megatron's layer spec",
            name="megatron-triton-rms-norm",
            framework="megatron",
            supported=">=0.16,<0.21",
            subject="Add a Triton RMSNorm module, selectable from the local GPT layer spec",
            motivation="""\
Without Transformer Engine or Apex, the local spec normalises with
WrappedTorchNorm (unfused torch.nn.RMSNorm). A Triton RMSNorm gives
TE-less setups (and GPUs TE does not cover yet) a fused norm for training,
with no extension build.""",
            body="""- megatron/core/fusions/fused_rms_norm_triton.py: TritonRMSNorm, with the
  (config, hidden_size, eps) constructor of norm submodules; forward runs
  the kernel, backward recomputes the norm in fp32 for the input and
  weight gradients; honours layernorm_zero_centered_gamma and marks the
  weight for sequence-parallel gradient reduction.
- get_gpt_layer_local_spec(normalization="TritonRMSNorm") selects it for
  the layer norms and the q/k norms.
- tests/unit_tests/fusions/test_rms_norm_triton.py: forward and both
  gradients against torch.nn.RMSNorm (fp32/bf16, odd and >8192 widths,
  zero-centred gamma) and the spec selection.""",
            changes=_changes,
            import_checks=("megatron.core.fusions.fused_rms_norm_triton", "megatron.core.models.gpt.gpt_layer_specs"),
            tests=(TEST_PATH, "tests/unit_tests/transformer/test_spec_customization.py"),
            # tests/unit_tests/conftest.py needs Transformer Engine (is_te_min_version in an autouse
            # fixture) and downloads test data; these tests need neither.
            test_args=("--noconftest",),
            reach=('get_gpt_layer_local_spec(normalization="TritonRMSNorm") from the Python API; '
                   "TransformerConfig.normalization (and so --normalization) does not name it."),
            benchmark=("fused", "rms_norm"),
        )
    ]


def _version(root: Path) -> str | None:
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", text, re.M)
        if not m:
            return None
        parts[key] = m.group(1)
    pre = re.search(r"""^PRE_RELEASE\s*=\s*['"]([^'"]*)['"]""", text, re.M)
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{pre.group(1) if pre else ''}"


PYLINTRC = """\
[MAIN]
ignore-paths=tests
max-line-length=100
load-plugins=pylint.extensions.bad_builtin
[MESSAGES CONTROL]
disable=all

enable=C0115,C0116,W0611,C0301,E0606,W0141

[BASIC]
bad-functions=print

[BAD_BUILTIN]
bad-builtins=print
"""

PYPROJECT = """\
[tool.isort]
profile = "black"
line_length = 100
known_first_party = ["megatron"]
known_third_party = ["transformer_engine"]
sections = ["FUTURE", "STDLIB", "THIRDPARTY", "FIRSTPARTY", "LOCALFOLDER"]
default_section = "THIRDPARTY"
extend_skip = ["setup.py"]

[tool.black]
line_length = 100
skip_string_normalization = true
skip_magic_trailing_comma = true
"""

# Megatron-LM: black 24.4.2 / isort 5.13.2 / pylint 3.2.6 (.pre-commit-config.yaml, pyproject.toml,
# .pylintrc); pylint and isort cover megatron/core only, black also tests/unit_tests.
PROJECT = Project(
    framework="megatron", marker="megatron/core", detect_version=_version, title_tag="", dco=False,
    packages=("black==24.4.2", "isort==5.13.2", "pylint==3.2.6"),
    tools=(
        Tool("black", ("black", "--config", "pyproject.toml", "--check", "--diff"),
             ("black", "-q", "--config", "pyproject.toml"), files=r"^(megatron/core/|tests/unit_tests/).*\.py$",
             config="pyproject.toml"),
        Tool("isort", ("isort", "--settings-path", "pyproject.toml", "--check-only", "--diff"),
             ("isort", "-q", "--settings-path", "pyproject.toml"), files=r"^megatron/core/.*\.py$",
             config="pyproject.toml"),
        Tool("pylint", ("pylint", "--rcfile=.pylintrc", "--score=n"), files=r"^megatron/core/.*\.py$",
             config=".pylintrc"),
    ),
    default_configs={".pylintrc": (PYLINTRC, "Megatron-LM main (d98e8a6)"),
                     "pyproject.toml": (PYPROJECT, "Megatron-LM main (d98e8a6; its black and isort settings)")})
