"""Megatron-core: graft's Triton RMSNorm as a trainable norm module, selectable from the local layer spec.

Why: without Transformer Engine or Apex, Megatron-core's local spec normalises with
``WrappedTorchNorm`` (unfused ``torch.nn.RMSNorm``). graft swaps the norm in from its own
spec (``graft.adapters.megatron``); upstream, the module needs no adapter.

How: ``megatron/core/fusions/fused_rms_norm_triton.py`` holds the forward kernel and a
``torch.autograd.Function`` whose backward recomputes the normalisation in fp32 (input and
weight gradients), so it trains; ``TritonRMSNorm`` has the ``(config, hidden_size, eps)``
constructor norm submodules are built with, honours ``layernorm_zero_centered_gamma`` and
marks its weight for sequence-parallel gradient reduction. ``get_gpt_layer_local_spec(
normalization="TritonRMSNorm")`` selects it. Tests sit under ``tests/unit_tests/fusions``.

Upstream: not submitted yet. Removal plan: see ``retire``.
"""
from __future__ import annotations

import re
from pathlib import Path

from graft.patches import rms_norm_kernel as _rms_norm
from graft.patches.projects import Project, Tool
from graft.patches.template import CreateFile, ReplaceText
from graft.patches.versions import git_tag_version

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
DOC_OLD = '''        qk_l2_norm (bool, optional): To use l2 norm for queries/keys. Defaults to False.

    Returns:
        ModuleSpec: Module specification with Megatron-Core modules
'''
DOC_NEW = '''        qk_l2_norm (bool, optional): To use l2 norm for queries/keys. Defaults to False.
        normalization (str, optional): "RMSNorm" for RMSNorm, "TritonRMSNorm" for the
            Triton RMSNorm in megatron.core.fusions.fused_rms_norm_triton, else LayerNorm.

    Returns:
        ModuleSpec: Module specification with Megatron-Core modules
'''


def _changes() -> list:
    return [
        CreateFile(MODULE_PATH, HEADER + _rms_norm.kernel_and_launcher(name="_rms_norm") + MODULE),
        ReplaceText(SPECS_PATH, SPEC_OLD, SPEC_NEW),
        ReplaceText(SPECS_PATH, DOC_OLD, DOC_NEW),
        CreateFile(TEST_PATH, TEST),
    ]


def templates() -> list:
    return [
        _rms_norm.rms_norm_template(
            framework_title="Megatron-core",
            what="norm override in graft.adapters.megatron's layer spec",
            name="megatron-triton-rms-norm",
            framework="megatron",
            supported=">=0.16,<0.18",
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


# Megatron-LM: black 24.4.2 / isort 5.13.2 / pylint 3.2.6 (.pre-commit-config.yaml, pyproject.toml,
# .pylintrc); pylint and isort cover megatron/core only, black also tests/unit_tests.
PROJECT = Project(
    framework="megatron", marker="megatron/core", detect_version=_version, title_tag="", dco=False,
    packages=("black==24.4.2", "isort==5.13.2", "pylint==3.2.6"),
    tools=(
        Tool("black", ("black", "--check", "--diff", "--skip-magic-trailing-comma", "--skip-string-normalization"),
             ("black", "-q", "--skip-magic-trailing-comma", "--skip-string-normalization"),
             files=r"^(megatron/core/|tests/unit_tests/).*\.py$"),
        Tool("isort", ("isort", "--check-only", "--diff"), ("isort", "-q"), files=r"^megatron/core/.*\.py$"),
        Tool("pylint", ("pylint", "--rcfile=.pylintrc", "--score=n"), files=r"^megatron/core/.*\.py$"),
    ))
