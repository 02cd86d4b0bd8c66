"""adapters/megatron/_autograd.call_with_reference_grad: one dispatch per call (validation and
selection once), counted under the implementation that served; a forward-only implementation
is trained by recomputing the reference in backward, counted and logged."""
import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.fixture
def forward_only_rms_norm(fresh_graft, monkeypatch):
    """A vendor-style fused.rms_norm implementation with no backward (its output has no graph)."""
    from graft.ops.fused import rms_norm_reference
    from graft.plugins import get_registry
    from graft.registry import Implementation

    def forward_only(x, weight, eps=1e-6, residual=None):
        with torch.no_grad():
            return rms_norm_reference(x, weight, eps, residual)

    get_registry().add_impl(Implementation(op="fused.rms_norm", backend="acme", fn=forward_only, provider="test",
                                           devices=frozenset({"cpu"})))
    monkeypatch.setenv("GRAFT_BACKENDS", "acme,torch")
    import graft

    graft.reload_config()
    from graft.adapters.megatron.integration import counter

    counter.reset()
    return counter.calls


def test_forward_only_implementation_trains_through_the_reference(forward_only_rms_norm):
    import graft.dispatch
    from graft.adapters.megatron._autograd import call_with_reference_grad
    from graft.ops.fused import rms_norm_reference

    selections = []
    real = graft.dispatch.select

    def counting(*args, **kwargs):  # a second selection besides dispatch.run's own
        selections.append(args[0])
        return real(*args, **kwargs)

    graft.dispatch.select = counting
    try:
        x = torch.randn(5, 16, requires_grad=True)
        w = (1 + 0.1 * torch.randn(16)).requires_grad_()
        out = call_with_reference_grad("fused.rms_norm", rms_norm_reference, x, w, 1e-6)
    finally:
        graft.dispatch.select = real
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = rms_norm_reference(x2, w2, 1e-6)
    torch.testing.assert_close(out, ref)
    cot = torch.randn_like(ref)
    out.backward(cot)
    ref.backward(cot)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    calls = forward_only_rms_norm
    assert calls["fused.rms_norm:acme"] == 1 and calls["fallback.reference_backward"] == 1, dict(calls)
    assert selections == [], selections
