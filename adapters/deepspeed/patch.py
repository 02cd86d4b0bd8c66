"""DeepSpeed: graft's Triton RMSNorm as the Triton branch of the inference RMSNorm op bindings.

Why: DeepSpeed-Inference has Triton kernels for layer_norm, GELU, softmax and the GEMMs
(``config.use_triton``), but ``RMSNormOp``/``PreRMSNormOp`` (used by ``MLPGemmOp`` and the
Llama-style containers) only have the compiled ``InferenceBuilder`` kernel or a torch
fallback. graft serves the norm from its own adapter (``graft.adapters.deepspeed``).

How: ``deepspeed/ops/transformer/inference/triton/rms_norm.py`` carries the kernel with the
op bindings' signatures; ``RMSNormOp`` and ``PreRMSNormOp`` select it when
``deepspeed.HAS_TRITON and config.use_triton``, exactly like ``VectorMatMulOp`` and
``LinearOp`` select their Triton kernels. Tests sit with the other inference op tests.

Upstream: not submitted yet. Removal plan: see ``retire``.
"""
from __future__ import annotations

import re
from pathlib import Path

from graft.patches import rms_norm_kernel as _rms_norm
from graft.patches.projects import Project, Tool
from graft.patches.template import CreateFile, InsertAfter, ReplaceText
from graft.patches.versions import git_tag_version

MODULE_PATH = "deepspeed/ops/transformer/inference/triton/rms_norm.py"
INIT_PATH = "deepspeed/ops/transformer/inference/triton/__init__.py"
OP_PATH = "deepspeed/ops/transformer/inference/op_binding/rms_norm.py"
PRE_OP_PATH = "deepspeed/ops/transformer/inference/op_binding/pre_rms_norm.py"
TEST_PATH = "tests/unit/ops/transformer/inference/test_triton_rms_norm.py"

HEADER = '''\
# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Triton RMSNorm for inference, plain and fused with the residual add.

Selected by RMSNormOp and PreRMSNormOp when ``config.use_triton`` is set.
"""

import torch
import triton
import triton.language as tl

'''

API = '''

def rms_norm(vals, gamma, epsilon):
    """RMSNormOp's signature: rms_norm(vals) * gamma."""
    return _rms_norm(vals, gamma, epsilon)[0]


def rms_norm_residual(vals, residual, gamma, epsilon):
    """PreRMSNormOp's signature: (rms_norm(vals + residual) * gamma, vals + residual)."""
    return _rms_norm(vals, gamma, epsilon, residual=residual)
'''

OP_OLD = '''        super(RMSNormOp, self).__init__(config)
        try:
            self.rms_norm_func = self.inference_module.rms_norm
        except AttributeError:
            self.rms_norm_func = self.rms_norm_fallback
'''
OP_NEW = '''        super(RMSNormOp, self).__init__(config)
        if deepspeed.HAS_TRITON and self.config.use_triton:
            from deepspeed.ops.transformer.inference.triton import rms_norm as _triton_rms_norm
            self.rms_norm_func = _triton_rms_norm
            return
        try:
            self.rms_norm_func = self.inference_module.rms_norm
        except AttributeError:
            self.rms_norm_func = self.rms_norm_fallback
'''
PRE_OLD = '''        super(PreRMSNormOp, self).__init__(config)
        try:
            self.pre_rms_norm_func = self.inference_module.pre_rms_norm
        except AttributeError:
            self.pre_rms_norm_func = self.pre_rms_norm_fallback
'''
PRE_NEW = '''        super(PreRMSNormOp, self).__init__(config)
        if deepspeed.HAS_TRITON and self.config.use_triton:
            from deepspeed.ops.transformer.inference.triton import rms_norm_residual
            self.pre_rms_norm_func = rms_norm_residual
            return
        try:
            self.pre_rms_norm_func = self.inference_module.pre_rms_norm
        except AttributeError:
            self.pre_rms_norm_func = self.pre_rms_norm_fallback
'''

TEST = '''\
# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import os

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.transformer.inference.config import DeepSpeedInferenceConfig
from deepspeed.ops.transformer.inference.op_binding.base import BaseOp
from deepspeed.ops.transformer.inference.op_binding.pre_rms_norm import PreRMSNormOp
from deepspeed.ops.transformer.inference.op_binding.rms_norm import RMSNormOp
from .inference_test_utils import allclose

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (get_accelerator().is_triton_supported() or INTERPRET):
    pytest.skip("triton is not supported on this system", allow_module_level=True)

from deepspeed.ops.transformer.inference.triton import rms_norm, rms_norm_residual  # noqa: E402


@pytest.fixture
def use_triton(monkeypatch):
    # HAS_TRITON asks for an active GPU driver, which the interpreter does not need.
    if INTERPRET:
        monkeypatch.setattr(deepspeed, "HAS_TRITON", True, raising=False)
    # The op bindings load the compiled inference ops first; the Triton branch does not use them.
    if BaseOp.inference_module is None:
        monkeypatch.setattr(BaseOp, "inference_module", object())
    return DeepSpeedInferenceConfig(use_triton=True)


def ref_implementation(vals, gamma, epsilon, residual=None):
    vals_f = vals.to(torch.float32)
    if residual is not None:
        vals_f = vals_f + residual.to(torch.float32)
    out = vals_f * torch.rsqrt(vals_f.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.to(torch.float32)
    return out.to(vals.dtype), vals_f.to(vals.dtype)


@pytest.mark.inference_ops
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seq_len", [1, 5])
@pytest.mark.parametrize("channels", [384, 769, 9000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_rms_norm(batch, seq_len, channels, dtype):
    device = "cpu" if INTERPRET else get_accelerator().current_device_name()
    vals = torch.randn((batch, seq_len, channels), dtype=dtype, device=device)
    residual = torch.randn((batch, seq_len, channels), dtype=dtype, device=device)
    gamma = torch.randn((channels), dtype=dtype, device=device)
    epsilon = 1e-5

    assert allclose(rms_norm(vals, gamma, epsilon), ref_implementation(vals, gamma, epsilon)[0])
    out, res = rms_norm_residual(vals, residual, gamma, epsilon)
    ref_out, ref_res = ref_implementation(vals, gamma, epsilon, residual)
    assert allclose(out, ref_out)
    assert allclose(res, ref_res)


@pytest.mark.inference_ops
def test_op_bindings_select_triton(use_triton):
    device = "cpu" if INTERPRET else get_accelerator().current_device_name()
    vals = torch.randn((2, 5, 768), dtype=torch.float16, device=device)
    residual = torch.randn_like(vals)
    gamma = torch.randn((768), dtype=torch.float16, device=device)

    op = RMSNormOp(use_triton)
    assert op.rms_norm_func is rms_norm
    assert allclose(op(vals, gamma, 1e-5), ref_implementation(vals, gamma, 1e-5)[0])
    pre_op = PreRMSNormOp(use_triton)
    assert pre_op.pre_rms_norm_func is rms_norm_residual
    out, res = pre_op(vals, residual, gamma, 1e-5)
    ref_out, ref_res = ref_implementation(vals, gamma, 1e-5, residual)
    assert allclose(out, ref_out)
    assert allclose(res, ref_res)
'''


def _changes() -> list:
    return [
        CreateFile(MODULE_PATH, HEADER + _rms_norm.kernel_and_launcher(name="_rms_norm") + API),
        InsertAfter(INIT_PATH, r"^from \.layer_norm import layer_norm, layer_norm_residual$",
                    "from .rms_norm import rms_norm, rms_norm_residual"),
        ReplaceText(OP_PATH, "from .base import BaseOp\n", "from .base import BaseOp\nimport deepspeed\n"),
        ReplaceText(OP_PATH, OP_OLD, OP_NEW),
        ReplaceText(PRE_OP_PATH, "from .base import BaseOp\n", "from .base import BaseOp\nimport deepspeed\n"),
        ReplaceText(PRE_OP_PATH, PRE_OLD, PRE_NEW),
        CreateFile(TEST_PATH, TEST),
    ]


def templates() -> list:
    return [
        _rms_norm.rms_norm_template(
            framework_title="DeepSpeed",
            what="RMSNorm override in graft.adapters.deepspeed",
            name="deepspeed-triton-rms-norm",
            framework="deepspeed",
            supported=">=0.19,<0.20",
            subject="Add a Triton RMSNorm branch to the inference RMSNorm op bindings",
            motivation="""\
With config.use_triton, DeepSpeed-Inference runs layer_norm, GELU,
softmax and the GEMMs through Triton, but RMSNormOp and PreRMSNormOp
(Llama-style models) still need the compiled InferenceBuilder kernel or
fall back to unfused torch code. This adds the missing Triton branch.""",
            body="""- deepspeed/ops/transformer/inference/triton/rms_norm.py: the kernel, as
  rms_norm(vals, gamma, epsilon) and rms_norm_residual(vals, residual,
  gamma, epsilon) with the op bindings' signatures; exported from the
  triton package next to layer_norm.
- RMSNormOp and PreRMSNormOp: use it when deepspeed.HAS_TRITON and
  config.use_triton, as VectorMatMulOp and LinearOp do.
- tests/unit/ops/transformer/inference/test_triton_rms_norm.py: numerics
  against a float32 reference (odd and >8192 widths, fp16/fp32, with the
  residual) and the op bindings' selection.""",
            changes=_changes,
            import_checks=("deepspeed.ops.transformer.inference.triton.rms_norm",
                           "deepspeed.ops.transformer.inference.op_binding.pre_rms_norm"),
            tests=(TEST_PATH, "tests/unit/ops/transformer/inference/test_rms_norm.py",
                   "tests/unit/ops/transformer/inference/test_layer_norm.py"),
            test_args=("-m", "inference_ops"),  # tests/pytest.ini deselects inference_ops by default
        )
    ]


def _version(root: Path) -> str | None:
    for candidate in (root / "version.txt", root / "deepspeed" / "git_version_info_installed.py"):
        if candidate.is_file():
            m = re.search(r"(\d+\.\d+\.\d+[\w.+-]*)", candidate.read_text())
            if m:
                return m.group(1)
    return git_tag_version(root)


# yapf v0.40.0 with .style.yapf and flake8 5.0.4 with .flake8; DCO required.
PROJECT = Project(
    framework="deepspeed", marker="deepspeed", detect_version=_version, title_tag="", dco=True,
    packages=("yapf==0.40.0", "flake8==5.0.4"),
    tools=(
        Tool("yapf", ("yapf", "--diff", "--style", ".style.yapf"), ("yapf", "-i", "--style", ".style.yapf")),
        Tool("flake8", ("flake8", "--config=.flake8")),
    ))
