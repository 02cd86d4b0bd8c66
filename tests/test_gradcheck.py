"""``torch.autograd.gradcheck`` over every op that has a backward, per backend.

The ops with a backward are the registered ops whose OpSpec names ``grad_inputs``
(attention.prefill, fused.layer_norm, fused.rms_norm (with and without residual),
fused.rotary_embedding, fused.silu_and_mul, gemm.linear, loss.fused_linear_cross_entropy,
moe.fused_experts); the test fails if one appears that this table does not cover.

- torch backend (graft's torch-native fast paths and the references): ``gradcheck`` and
  ``gradgradcheck`` in float64 — first and second derivatives against finite differences.
- Triton (interpreted here, ``TRITON_INTERPRET=1`` from conftest.py): the kernels serve
  fp16/bf16/fp32 only (their implementations declare no float64), so float64 gradcheck does
  not apply. Instead, in float32: ``gradcheck`` of the kernel's registered backward against
  finite differences of its own forward (eps 1e-3; atol/rtol 2e-2, what fp32 central
  differences allow), and its gradients against the float64 reference's autograd gradients
  (atol 1e-4 x the gradient's RMS + rtol 1e-4). Their backward is a kernel: a double backward
  must raise "no double backward for <op> on triton", never return a silently wrong number.

Implementations run directly (``impl.fn``, no dispatch), so each check is of that backend.
Shapes are the conformance's smallest cases; gradcheck uses fast mode (random projections).
"""
from __future__ import annotations

import pytest
import torch

from graft.tools.conformance.cases import builtin_cases
from graft.tools.fuzz import grad_function
from graft.plugins import get_registry

# op -> the cases (graft.ops.<family>.CASES names) checked: small, and covering the op's variants.
CHECKED = {
    "attention.prefill": ["b3_empty_seq_h2_d64_causal", "b2_q_lt_k_mqa_d64_causal"],
    "fused.layer_norm": ["t1_h33", "t7_h128_nobias"],
    "fused.rms_norm": ["t1_h33", "t1_h33_residual"],
    "fused.rotary_embedding": ["t3_hq3_hk1_d80_rot32_neox", "t3_hq3_hk1_d80_rot32_gptj"],
    "fused.silu_and_mul": ["t1_d33", "b2_t3_d17"],
    "gemm.linear": ["m1_n7_k16_none", "m3_n48_k33_bias_relu", "m2x5_n33_k64_bias_silu"],
    "loss.fused_linear_cross_entropy": ["t7_h32_v50", "t19_h48_v97_bias_ignore3", "t11_h32_v70_none_ignore2"],
    "moe.fused_experts": ["t1_e4_k1_h48_i40"],
}
# (op, provider) of the torch backend whose backward cannot be differentiated again: torch's
# fused SDPA kernels have no double backward, and graft names the op instead of torch's
# "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented".
TORCH_NO_DOUBLE_BACKWARD = {("attention.prefill", "graft")}
# Cases too slow for the fast run when interpreted (Triton).
SLOW_TRITON = {"attention.prefill", "moe.fused_experts"}


def _case(op, name):
    for case in builtin_cases():
        if case.op == op and case.name == name:
            return case
    raise LookupError(f"no case {op}[{name}]")


def _impls(op, backend):
    return [i for i in get_registry().implementations(op) if i.backend == backend and not i.framework]


def test_every_op_with_a_backward_is_checked():
    registry = get_registry()
    with_grad = sorted(name for name in registry.ops if registry.op(name).grad_inputs)
    assert with_grad == sorted(CHECKED), "ops with grad_inputs changed: add them to CHECKED"


def _wrapped(impl, case, args, kwargs):
    """(function of the differentiable inputs -> tuple of floating outputs, those inputs):
    the same wrapping graft fuzz's gradcheck class uses."""
    return grad_function(impl.fn, case, get_registry().op(case.op), args, kwargs)


def _params(backend):
    out = []
    for op, names in CHECKED.items():
        for impl in _impls(op, backend):
            for name in names:
                marks = [pytest.mark.slow] if backend == "triton" and op in SLOW_TRITON else []
                out.append(pytest.param(op, name, impl.provider, id=f"{op}[{name}]-{impl.provider}", marks=marks))
    return out


def _impl(op, backend, provider):
    return next(i for i in _impls(op, backend) if i.provider == provider)


@pytest.mark.parametrize("op,name,provider", _params("torch"))
def test_torch_backend_gradcheck_and_gradgradcheck_float64(op, name, provider):
    impl = _impl(op, "torch", provider)
    case = _case(op, name)
    args, kwargs = case.inputs("cpu", torch.float64)
    # Every floating input in float64 (a case keeps some in fp32: moe's routing weights).
    args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    fn, leaves = _wrapped(impl, case, args, kwargs)
    assert all(t.dtype == torch.float64 for t in fn(*leaves)), "a float64 call must stay float64"
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)
    if (op, provider) in TORCH_NO_DOUBLE_BACKWARD:
        with pytest.raises(RuntimeError, match=rf"no double backward for {op} on torch \("):
            torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)
    else:
        assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)


def _triton_or_skip(op, provider):
    impl = _impl(op, "triton", provider)
    reason = impl.static_reason("cpu", torch.float32, None)
    if reason:
        pytest.skip(f"triton cannot run here: {reason}")
    return impl


@pytest.mark.parametrize("op,name,provider", _params("triton"))
def test_triton_gradcheck_float32_and_against_the_float64_reference(op, name, provider):
    impl = _triton_or_skip(op, provider)
    assert torch.float64 not in impl.dtypes  # if it ever serves float64, check it there instead
    case = _case(op, name)
    args, kwargs = case.inputs("cpu", torch.float32)
    fn, leaves = _wrapped(impl, case, args, kwargs)
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-3, atol=2e-2, rtol=2e-2, fast_mode=True)

    outputs = fn(*leaves)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]
    got = torch.autograd.grad(outputs, leaves, [c.float() for c in cotangents], allow_unused=True)

    reference = get_registry().op(op).reference
    ref_args = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref_fn, ref_leaves = _wrapped(type("Ref", (), {"fn": staticmethod(reference)}), case, ref_args, kwargs)
    # The reference computes in at least float32; on float64 inputs it stays float64.
    expected = torch.autograd.grad(ref_fn(*ref_leaves), ref_leaves, cotangents, allow_unused=True)
    for leaf, g, e in zip(leaves, got, expected):
        e = torch.zeros_like(leaf, dtype=torch.float64) if e is None else e
        g = torch.zeros_like(leaf) if g is None else g
        rms = e.pow(2).mean().sqrt().item() if e.numel() else 0.0
        torch.testing.assert_close(g.double(), e, atol=1e-4 * max(rms, 1e-6), rtol=1e-4)


@pytest.mark.parametrize("op,name,provider", _params("triton"))
def test_triton_double_backward_is_a_named_error(op, name, provider):
    impl = _triton_or_skip(op, provider)
    case = _case(op, name)
    args, kwargs = case.inputs("cpu", torch.float32)
    fn, leaves = _wrapped(impl, case, args, kwargs)
    outputs = fn(*leaves)
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outputs)
    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    differentiable = [g for g in grads if g is not None and g.requires_grad]
    assert differentiable, "create_graph=True gave gradients that cannot be differentiated at all"
    with pytest.raises(RuntimeError, match=rf"no double backward for {op}\b.* on triton"):
        torch.autograd.grad(sum(g.pow(2).sum() for g in differentiable), leaves, allow_unused=True)
