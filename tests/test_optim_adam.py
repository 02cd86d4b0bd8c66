"""Triton fused.adam_step vs the torch reference: odd sizes, fp32/fp16/bf16 params with
same-dtype or fp32 moments, AdamW and L2 modes, first and later steps, with and without
weight decay and bias correction; several tensors over several steps; the functional
contract (inputs untouched); the custom op's schema, fake impl and tracing; selection
(triton under the interpreter, GRAFT_FUSED=torch honoured) and input validation."""
import pytest
import torch

import graft
from graft.errors import GraftInputError
from graft.ops.fused import adam_step, adam_step_reference

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One output ulp: the GPU may contract multiply-adds (fp32 results differ in the last bits),
# which can flip the final rounding of a 16-bit output.
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 8e-3)}
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="module")
def kernel():
    from graft.kernels.triton import fused_adam_step

    return fused_adam_step


def _inputs(shape, dtype, state_dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    grad = (0.1 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
    exp_avg = (0.01 * torch.randn(shape, generator=gen)).to(device=device, dtype=state_dtype)
    exp_avg_sq = (1e-4 * torch.rand(shape, generator=gen)).to(device=device, dtype=state_dtype)
    return param, grad, exp_avg, exp_avg_sq


def _check(actual, expected):
    """Each output matches within an ulp of its dtype, and 16-bit outputs round like torch
    almost everywhere (a truncating or otherwise biased store would miss half the elements)."""
    for name, a, e in zip(("param", "exp_avg", "exp_avg_sq"), actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        atol, rtol = TOL[e.dtype]
        torch.testing.assert_close(a.float(), e.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
        if e.dtype != torch.float32 and e.numel() >= 100:
            differing = (a != e).sum().item()
            assert differing <= 0.01 * e.numel(), f"{name}: {differing}/{e.numel()} elements rounded differently"


@pytest.mark.parametrize("shape", [(1,), (33,), (1000 + 7,), (5, 7, 3)], ids=str)
@pytest.mark.parametrize("dtype, state_dtype", [(d, d) for d in PARAM_DTYPES] + [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("step, weight_decay", [(1, 0.0), (10, 0.1)], ids=["step1_nodecay", "step10_decay"])
def test_kernel_matches_reference(kernel, device, shape, dtype, state_dtype, adam_w_mode, step, weight_decay):
    args = _inputs(shape, dtype, state_dtype, device)
    scalars = (*HYPER.values(), step, weight_decay, adam_w_mode, True)
    _check(kernel.adam_step(*args, *scalars), adam_step_reference(*args, *scalars))


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("step", [1, 10])
def test_kernel_without_bias_correction_and_mixed_hyperparameters(kernel, device, adam_w_mode, step):
    args = _inputs((257,), torch.float32, torch.float32, device, seed=3)
    for lr, beta1, beta2, eps, wd in ((1e-3, 0.0, 0.0, 1e-6, 0.0), (0.5, 0.5, 0.9, 1e-3, 1.0), (0.0, 0.9, 0.99, 1e-8, 0.1)):
        scalars = (lr, beta1, beta2, eps, step, wd, adam_w_mode, False)
        _check(kernel.adam_step(*args, *scalars), adam_step_reference(*args, *scalars))


def test_several_tensors_over_several_steps(kernel, device):
    """The DeepSpeed adapter's pattern: one call per tensor of a group, results fed back."""
    shapes = [(1,), (33, 5), (1031,), (2, 3, 4)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    ours = [_inputs(s, d, torch.float32, device, seed=i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    theirs = [tuple(t.clone() for t in group) for group in ours]
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 6):
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            grad = (0.1 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
            p, _, m, v = ours[i]
            ours[i] = (lambda r: (r[0], grad, r[1], r[2]))(kernel.adam_step(p, grad, m, v, *HYPER.values(), step, 0.01))
            p, _, m, v = theirs[i]
            theirs[i] = (lambda r: (r[0], grad, r[1], r[2]))(
                adam_step_reference(p, grad, m, v, *HYPER.values(), step, 0.01))
    for a, e in zip(ours, theirs):
        _check((a[0], a[2], a[3]), (e[0], e[2], e[3]))


def test_functional_noncontiguous_and_empty(kernel, device):
    args = _inputs((9, 13), torch.float32, torch.float32, device, seed=5)
    strided = tuple(t.t() for t in args)  # transposed views: not contiguous
    before = tuple(t.clone() for t in strided)
    out = kernel.adam_step(*strided, *HYPER.values(), 4, 0.1, False, True)
    for t, b in zip(strided, before):
        assert torch.equal(t, b), "the op is functional: inputs must not be written"
    _check(out, adam_step_reference(*strided, *HYPER.values(), 4, 0.1, False, True))
    for o, t in zip(out, args):
        assert o.data_ptr() != t.data_ptr()
    empty = _inputs((0, 4), torch.bfloat16, torch.float32, device)
    outs = kernel.adam_step(*empty, *HYPER.values(), 1)
    assert [o.shape for o in outs] == [(0, 4)] * 3
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.float32, torch.float32]


def test_custom_op_opcheck_fake_and_compile(kernel, device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _inputs((3, 11), torch.bfloat16, torch.float32, device)
    torch.library.opcheck(kernel.adam_step_op, (*args, 1e-3, 0.9, 0.999, 1e-8, 2, 0.01, True, True),
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in _inputs((4, 6), torch.float16, torch.float32, "cpu")]
        p, m, v = kernel.adam_step(*fake, *HYPER.values(), 3)
        assert (p.shape, p.dtype, m.dtype, v.dtype) == ((4, 6), torch.float16, torch.float32, torch.float32)
    step_fn = torch.compile(lambda *a: kernel.adam_step(*a, *HYPER.values(), 2, 0.1)[0] * 1.0,
                            backend="eager", fullgraph=True)
    plain = _inputs((40,), torch.float32, torch.float32, device)
    _check((step_fn(*plain),), (adam_step_reference(*plain, *HYPER.values(), 2, 0.1)[0],))


def test_dispatch_selects_triton_and_honours_graft_fused(fresh_graft, device, monkeypatch):
    args = _inputs((65,), torch.bfloat16, torch.float32, device)
    scalars = (*HYPER.values(), 3, 0.01, True, True)
    # On the CPU only the Triton interpreter competes with the reference; a GPU may pick hip first.
    expected = ("triton",) if device.type == "cpu" else ("hip", "triton")
    assert graft.select("fused.adam_step", *args, *scalars).backend in expected
    _check(adam_step(*args, *scalars), adam_step_reference(*args, *scalars))
    monkeypatch.setenv("GRAFT_FUSED", "torch")
    assert graft.select("fused.adam_step", *args, *scalars).backend == "torch"
    _check(adam_step(*args, *scalars), adam_step_reference(*args, *scalars))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"grad": torch.zeros(6)}, "grad has shape"),
        ({"grad": torch.zeros(5, dtype=torch.float16)}, "grad has dtype"),
        ({"exp_avg_sq": torch.zeros(5, dtype=torch.bfloat16)}, "exp_avg_sq has dtype"),
        ({"param": torch.zeros(5, dtype=torch.int64), "grad": torch.zeros(5, dtype=torch.int64)}, "param has dtype"),
        ({"lr": -1.0}, "lr must be in"),
        ({"beta2": 1.0}, "beta2 must be in"),
        ({"eps": "1e-8"}, "eps must be a number"),
        ({"weight_decay": -0.1}, "weight_decay must be in"),
        ({"step": 0}, "step must be an int >= 1"),
        ({"step": 2.0}, "step must be an int >= 1"),
    ],
)
def test_bad_input_raises_before_the_kernel(fresh_graft, device, change, message):
    args = dict(param=torch.zeros(5), grad=torch.zeros(5), exp_avg=torch.zeros(5), exp_avg_sq=torch.zeros(5),
                lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1)
    args.update(change)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(GraftInputError, match=message):
        adam_step(**args)
