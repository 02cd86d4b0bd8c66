"""DeepSpeed patches: the extension point graft's integration needs, and graft's Triton RMSNorm.

1. ``deepspeed-adam-builder-from-accelerator`` (the series a maintainer takes today).

   Why: ``deepspeed.accelerator.set_accelerator()`` is DeepSpeed's documented hook for an
   out-of-tree accelerator, and the accelerator's ``create_op_builder()`` is how it supplies
   ops. But ``FusedAdam`` and ``DeepSpeedCPUAdam`` do not ask it: they call the builder name
   ``deepspeed.ops.op_builder`` bound, at ``import deepspeed``, to the builder of the
   accelerator detected *then*. So graft has to rebind those names in every imported
   ``deepspeed.*`` module (``integration._rebind_builders``).

   How: both optimizers resolve their builder through ``get_accelerator().create_op_builder()``
   when constructed, as ``deepspeed.comm`` already does for ``ShareMemCommBuilder``. Runs in
   the default configuration (every ``FusedAdam``/``DeepSpeedCPUAdam``, the optimizers of
   ``"type": "Adam"`` configs and ZeRO-Offload); tests in ``tests/unit/ops/adam`` with no
   marker, so DeepSpeed's default ``tests/pytest.ini`` selection runs them, on CPU.

2. ``deepspeed-triton-rms-norm`` (a kernel patch: generated only with GPU numbers).

   Why/How: a Triton branch in ``RMSNormOp``/``PreRMSNormOp`` when ``config.use_triton``.
   It is reached only by code that builds those ops with a ``use_triton`` config (DeepSpeed's
   own ``MLPGemmOp`` builds ``PreRMSNormOp()`` without one), and its tests carry the
   ``inference_ops`` marker DeepSpeed's default selection leaves out; the message says so.

Upstream: not submitted yet. Removal plan: see each template's ``retire``.
"""
from __future__ import annotations

import re
from pathlib import Path

from graft.tools.patches import rms_norm_kernel as _rms_norm
from graft.tools.patches.projects import Project, Tool
from graft.tools.patches.template import CreateFile, InsertAfter, PatchTemplate, ReplaceText
from graft.tools.patches.versions import git_tag_version

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


ADAM_PATH = "deepspeed/ops/adam/fused_adam.py"
CPU_ADAM_PATH = "deepspeed/ops/adam/cpu_adam.py"
ADAM_TEST_PATH = "tests/unit/ops/adam/test_adam_builder_from_accelerator.py"
RESOLVE_COMMENT = ("        # Ask the accelerator now, not the name op_builder bound at import: an\n"
                   "        # accelerator set later with set_accelerator() then supplies the op.\n")

ADAM_TEST = '''\
# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""FusedAdam and DeepSpeedCPUAdam take their op from the accelerator current at construction,
so one set with set_accelerator() after ``import deepspeed`` supplies it."""

import copy

import pytest
import torch

from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam


def _adam(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, adamw_mode, bias_correction, weight_decay):
    if weight_decay and not adamw_mode:
        grad = grad + weight_decay * param
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    c1 = 1 - beta1**step if bias_correction else 1.0
    c2 = 1 - beta2**step if bias_correction else 1.0
    update = (exp_avg / c1) / ((exp_avg_sq / c2).sqrt() + eps)
    if weight_decay and adamw_mode:
        update = update + weight_decay * param
    param.add_(update, alpha=-lr)


class _FusedAdamOps:
    calls = 0

    @classmethod
    def multi_tensor_adam(cls, chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, adamw_mode,
                          bias_correction, weight_decay):
        cls.calls += 1
        for grad, param, exp_avg, exp_avg_sq in zip(*tensor_lists):
            _adam(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, adamw_mode, bias_correction,
                  weight_decay)


class _CPUAdamOps:
    calls = 0
    modes = {}

    @classmethod
    def create_adam(cls, opt_id, lr, beta1, beta2, eps, weight_decay, adamw_mode, should_log):
        cls.modes[opt_id] = adamw_mode

    @classmethod
    def destroy_adam(cls, opt_id):
        cls.modes.pop(opt_id, None)

    @classmethod
    def adam_update(cls, opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, param, grad, exp_avg,
                    exp_avg_sq):
        cls.calls += 1
        _adam(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, cls.modes[opt_id], bias_correction,
              weight_decay)


class _Builder:

    def __init__(self, ops):
        self.ops = ops

    def load(self, verbose=True):
        return self.ops


@pytest.fixture
def accelerator_with_adam_ops():
    """The current accelerator, set again with its Adam builders answered by the ops above."""
    original = get_accelerator()
    accelerator = copy.copy(original)
    ops = {"FusedAdamBuilder": _FusedAdamOps, "CPUAdamBuilder": _CPUAdamOps}

    def create_op_builder(class_name):
        return _Builder(ops[class_name]) if class_name in ops else original.create_op_builder(class_name)

    accelerator.create_op_builder = create_op_builder
    set_accelerator(accelerator)
    yield ops
    set_accelerator(original)


def _train(optimizer_class, steps=3, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33, 7)), torch.nn.Parameter(torch.randn(5))]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = optimizer_class(params, lr=1e-2, weight_decay=0.1, **kwargs)
    torch_optimizer = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        for p, r in zip(params, reference):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        optimizer.step()
        torch_optimizer.step()
    for p, r in zip(params, reference):
        torch.testing.assert_close(p, r)


def test_fused_adam_uses_the_accelerator_set_after_import(accelerator_with_adam_ops):
    calls = _FusedAdamOps.calls
    _train(FusedAdam)
    assert _FusedAdamOps.calls == calls + 3


def test_cpu_adam_uses_the_accelerator_set_after_import(accelerator_with_adam_ops):
    calls = _CPUAdamOps.calls
    _train(DeepSpeedCPUAdam)
    assert _CPUAdamOps.calls == calls + 3 * 2
'''


def _adam_changes() -> list:
    return [
        ReplaceText(ADAM_PATH, "from deepspeed.ops.op_builder import FusedAdamBuilder\n", ""),
        ReplaceText(ADAM_PATH, "        fused_adam_cuda = FusedAdamBuilder().load()\n",
                    RESOLVE_COMMENT + '        fused_adam_cuda = get_accelerator().create_op_builder("FusedAdamBuilder").load()\n'),
        ReplaceText(CPU_ADAM_PATH, "from deepspeed.ops.op_builder import CPUAdamBuilder\n",
                    "from deepspeed.accelerator import get_accelerator\n"),
        ReplaceText(CPU_ADAM_PATH, "self.ds_opt_adam = CPUAdamBuilder().load()",
                    'self.ds_opt_adam = get_accelerator().create_op_builder("CPUAdamBuilder").load()'),
        CreateFile(ADAM_TEST_PATH, ADAM_TEST),
    ]


def templates() -> list:
    return [
        PatchTemplate(
            name="deepspeed-adam-builder-from-accelerator",
            framework="deepspeed",
            supported=">=0.19,<0.20",
            subject="FusedAdam/DeepSpeedCPUAdam: get the op builder from the current accelerator",
            motivation="""\
set_accelerator() is the documented way to run DeepSpeed on an
accelerator that lives outside the tree, and the accelerator's
create_op_builder() is how it supplies ops. FusedAdam and
DeepSpeedCPUAdam bypass it: they call the FusedAdamBuilder /
CPUAdamBuilder name that deepspeed.ops.op_builder bound when deepspeed
was imported, i.e. the builder of the accelerator detected then. An
accelerator set afterwards (the usual order: import deepspeed, then set
it) never gets asked, so its Adam kernels are not used, and out-of-tree
accelerators end up rebinding DeepSpeed's module attributes instead.""",
            body="""- FusedAdam and DeepSpeedCPUAdam call
  get_accelerator().create_op_builder(...) when they are constructed, as
  deepspeed.comm does for ShareMemCommBuilder; with the accelerator
  detected at import nothing changes (same builder, same op).
- tests/unit/ops/adam/test_adam_builder_from_accelerator.py: both
  optimizers, built after set_accelerator() replaced the accelerator,
  run the ops its builders return, and match torch.optim.AdamW over
  three steps. No marker: the default tests/pytest.ini selection runs
  them, on CPU.""",
            changes=_adam_changes,
            import_checks=("deepspeed.ops.adam.fused_adam", "deepspeed.ops.adam.cpu_adam"),
            tests=(ADAM_TEST_PATH,),
            retire="once a release carries this, graft.adapters.deepspeed.integration stops rebinding "
                   "FusedAdamBuilder/CPUAdamBuilder in deepspeed.* modules (_rebind_builders) for that release; "
                   "set_accelerator(GraftAccelerator(...)) alone then routes Adam to graft.",
            checked_against={"release": "0.19.8", "deepspeed-main": "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"},
        ),
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
            reach=("DeepSpeedInferenceConfig(use_triton=True) passed to RMSNormOp/PreRMSNormOp by the caller, "
                   "with Triton and a GPU (deepspeed.HAS_TRITON). DeepSpeed's own MLPGemmOp builds PreRMSNormOp() "
                   "without its config, so no DeepSpeed model reaches it yet; its tests carry the inference_ops "
                   "marker, which tests/pytest.ini deselects (run them with -m inference_ops)."),
            benchmark=("fused", "rms_norm"),
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
        Tool("yapf", ("yapf", "--diff", "--style", ".style.yapf"), ("yapf", "-i", "--style", ".style.yapf"),
             config=".style.yapf"),
        Tool("flake8", ("flake8", "--config=.flake8"), config=".flake8"),
    ),
    # DeepSpeed's sdists leave its dot-files out; these are the files of the pinned release
    # (and of main at the commit the templates record).
    default_configs={
        ".style.yapf": ("[style]\nSPLIT_ALL_COMMA_SEPARATED_VALUES = false\nCOLUMN_LIMIT = 119\n",
                        "DeepSpeed 0.19 and main (edaa722)"),
        ".flake8": ("[flake8]\nignore = E,F403,F405,F541,F841,W\nselect = E9,F,W6\nper-file-ignores =\n"
                    "    __init__.py:F401\n", "DeepSpeed 0.19 and main (edaa722)"),
    })
