"""graft's torch backend of attention.prefill and fused.rms_norm: torch's fused kernels
(F.scaled_dot_product_attention, F.rms_norm) ranked above the references, with the same
outputs and gradients as the references, and the reference's semantics where SDPA's differ."""
import pytest
import torch

import graft
from graft.ops.attention import prefill_reference, prefill_torch
from graft.ops.fused import layer_norm_reference, layer_norm_torch, rms_norm_reference, rms_norm_torch


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_torch_matches_reference(dtype, residual):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 33, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(33, generator=gen)).to(dtype)
    r = torch.randn(7, 33, generator=gen).to(dtype) if residual else None
    got, want = rms_norm_torch(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r)
    for a, b in zip(got if residual else [got], want if residual else [want]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    xg, wg = x.float().requires_grad_(), w.float().requires_grad_()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    cot = torch.randn(7, 33, generator=gen)
    rms_norm_torch(xg, wg).backward(cot)
    rms_norm_reference(xr, wr).backward(cot)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wg.grad, wr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm_torch_matches_reference(dtype, bias):
    """Bit for bit in every dtype (fp32: torch's call itself; else the reference), gradients too."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 33, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(33, generator=gen)).to(dtype)
    b = torch.randn(33, generator=gen).to(dtype) if bias else None
    got, want = layer_norm_torch(x, w, b, 1e-5), layer_norm_reference(x, w, b, 1e-5)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    leaves = [t.float().requires_grad_() for t in (x, w)] + ([b.float().requires_grad_()] if bias else [])
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    cot = torch.randn(7, 33, generator=gen)
    layer_norm_torch(*leaves[:2], leaves[2] if bias else None).backward(cot)
    layer_norm_reference(*copies[:2], copies[2] if bias else None).backward(cot)
    for a, r in zip(leaves, copies):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_torch_backend_selects_the_fused_implementations(torch_backend):
    q = torch.randn(8, 4, 16)
    kv = torch.randn(8, 2, 16)
    cu = _cu([4, 4])
    assert graft.select("attention.prefill", q, kv, kv, cu, cu, 4, 4, True).fn is prefill_torch
    assert graft.select("fused.rms_norm", torch.randn(3, 8), torch.ones(8), 1e-6).fn is rms_norm_torch
    assert graft.select("fused.layer_norm", torch.randn(3, 8), torch.ones(8), None, 1e-5).fn is layer_norm_torch
