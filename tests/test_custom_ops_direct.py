"""graft's custom ops called eagerly skip torch's dispatcher (about 10 us a call) only where it
would add nothing: a gradient to record, fake tensors, tensor subclasses and torch.compile
still go through ``torch.ops.graft.*`` (fake impl, backward, schema)."""
from __future__ import annotations

import sys

import torch

from graft.custom_ops import define_op

SEEN: list = []


def _scale(x: torch.Tensor) -> torch.Tensor:
    # Which way the call came: straight from graft's op object, or from torch's dispatcher.
    caller = sys._getframe(1).f_globals.get("__name__")
    SEEN.append("direct" if caller == "graft.custom_ops" else "dispatcher")
    return x * 2


OP = define_op("test_direct_scale", _scale, fake=lambda x: torch.empty_like(x))
OP.register_autograd(lambda ctx, grad: grad * 2)


def _way(*args) -> str:
    SEEN.clear()
    OP(*args)
    return SEEN[-1] if SEEN else "fake"


def test_plain_eager_call_is_direct():
    x = torch.randn(3)
    assert _way(x) == "direct"
    assert torch.equal(OP(x), x * 2)
    with torch.no_grad():
        assert _way(torch.randn(3, requires_grad=True)) == "direct"  # nothing to record


def test_gradients_fake_tensors_and_compile_use_the_dispatcher():
    x = torch.randn(3, requires_grad=True)
    assert _way(x) == "dispatcher"
    OP(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        assert _way(mode.from_tensor(torch.randn(3))) == "fake"  # the fake impl, not the function
    compiled = torch.compile(lambda t: OP(t) + 1, backend="eager", fullgraph=True)
    y = torch.randn(4)
    assert torch.equal(compiled(y), y * 2 + 1)
