"""graft's torch backend of attention.prefill and fused.rms_norm: torch's fused kernels
(F.scaled_dot_product_attention, F.rms_norm) ranked above the references, with the same
outputs and gradients as the references, and the reference's semantics where SDPA's differ."""
import pytest
import torch

import graft
from graft.kernels.torch.attention import prefill_torch
from graft.kernels.torch.fused import layer_norm_torch, rms_norm_torch
from graft.ops.attention import prefill_reference
from graft.ops.fused import layer_norm_reference, rms_norm_reference


@pytest.fixture
def torch_backend(fresh_graft, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _grads(fn, args, cotangent):
    leaves = [a.detach().clone().requires_grad_() if i < 3 else a for i, a in enumerate(args)]
    out = fn(*leaves)
    out.backward(cotangent)
    return out.detach(), [t.grad for t in leaves[:3]]


# (query lengths, key lengths, causal): a uniform batch (one batched SDPA call), bottom-right
# causal with longer keys, a varlen batch with an empty sequence, and causal rows that see no
# key (sq > sk: the reference's zero rows).
CASES = [([13, 13], [13, 13], True), ([5, 5, 5], [9, 9, 9], True), ([3, 0, 9, 8], [5, 2, 5, 13], False),
         ([3, 0, 9, 8], [5, 2, 5, 13], True), ([6], [4], True)]


@pytest.mark.parametrize("lq, lk, causal", CASES)
def test_prefill_torch_matches_reference_forward_and_backward(lq, lk, causal):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), 4, 16, generator=gen)
    k, v = torch.randn(sum(lk), 2, 16, generator=gen), torch.randn(sum(lk), 2, 16, generator=gen)
    args = (q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal, 0.3)
    dout = torch.randn(q.shape, generator=gen)
    out, grads = _grads(prefill_torch, args, dout)
    ref, ref_grads = _grads(prefill_reference, args, dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_prefill_torch_keeps_the_reference_semantics_for_non_finite_inputs():
    q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    q[3, 1, 2] = float("nan")  # SDPA's CPU kernel would drop it; the reference propagates it
    args = (q, k, v, _cu([5, 5]), _cu([5, 5]), 5, 5, True)
    out, ref = prefill_torch(*args), prefill_reference(*args)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()


def _norm_inputs(dtype, extra, seed):
    """x [7, 33], a weight near 1, and (``extra``) a residual [7, 33] or a bias [33], in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 33, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(33, generator=gen)).to(dtype)
    shape = {"residual": (7, 33), "bias": (33,)}.get(extra)
    return gen, x, w, torch.randn(shape, generator=gen).to(dtype) if shape else None


# (torch backend, reference, eps, the optional tensor's name): bit for bit in every dtype (fp32:
# torch's own call; else the reference's fp32 math), gradients too.
NORMS = [pytest.param(rms_norm_torch, rms_norm_reference, 1e-6, "residual", id="rms_norm"),
         pytest.param(layer_norm_torch, layer_norm_reference, 1e-5, "bias", id="layer_norm")]


@pytest.mark.parametrize("torch_fn, reference, eps, extra", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_extra", [False, True])
def test_norm_torch_backends_match_their_references(torch_fn, reference, eps, extra, dtype, with_extra):
    gen, x, w, other = _norm_inputs(dtype, extra if with_extra else None, seed=1)
    got, want = torch_fn(x, w, eps=eps, **{extra: other}), reference(x, w, eps=eps, **{extra: other})
    many = isinstance(want, tuple)  # rms_norm with a residual: (out, the sum)
    for a, b in zip(got if many else [got], want if many else [want]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if extra == "residual":
        other = None  # the gradient check without the residual add
    leaves = [t.float().requires_grad_() for t in (x, w) + ((other,) if other is not None else ())]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    cot = torch.randn(7, 33, generator=gen)
    torch_fn(*leaves[:2], eps=eps, **{extra: leaves[2] if len(leaves) > 2 else None}).backward(cot)
    reference(*copies[:2], eps=eps, **{extra: copies[2] if len(copies) > 2 else None}).backward(cot)
    for a, r in zip(leaves, copies):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_torch_backend_selects_the_fused_implementations(torch_backend):
    q = torch.randn(8, 4, 16)
    kv = torch.randn(8, 2, 16)
    cu = _cu([4, 4])
    assert graft.select("attention.prefill", q, kv, kv, cu, cu, 4, 4, True).fn is prefill_torch
    assert graft.select("fused.rms_norm", torch.randn(3, 8), torch.ones(8), 1e-6).fn is rms_norm_torch
    assert graft.select("fused.layer_norm", torch.randn(3, 8), torch.ones(8), None, 1e-5).fn is layer_norm_torch
