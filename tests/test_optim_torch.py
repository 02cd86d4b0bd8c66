"""graft's torch backend of fused.adam_step (torch's fused Adam kernel) and the in-place
multi-tensor form optimizers use (graft.ops.fused.adam_step_): same numbers as the
reference, one torch kernel call for all tensors, the per-tensor path where that kernel
does not apply, and clear errors."""
import pytest
import torch

import graft
from graft.errors import GraftInputError
from graft.kernels.torch.fused import adam_step_torch
from graft.ops.fused import adam_step_, adam_step_reference

HYPER = (1e-2, 0.9, 0.999, 1e-8)


def _tensors(shape, dtype=torch.float32, state_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state_dtype = state_dtype or dtype
    return (torch.randn(shape, generator=gen).to(dtype), (0.1 * torch.randn(shape, generator=gen)).to(dtype),
            (0.01 * torch.randn(shape, generator=gen)).to(state_dtype),
            (1e-4 * torch.rand(shape, generator=gen)).to(state_dtype))


@pytest.fixture
def torch_backend(fresh_graft, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_torch_backend_matches_reference(dtype, state_dtype, adam_w_mode, bias_correction):
    args = _tensors((33, 7), dtype, state_dtype)
    inputs = [t.clone() for t in args]
    ours = adam_step_torch(*args, *HYPER, 4, 0.05, adam_w_mode, bias_correction)
    ref = adam_step_reference(*args, *HYPER, 4, 0.05, adam_w_mode, bias_correction)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        tol = dict(rtol=1e-5, atol=1e-6) if a.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert all(torch.equal(a, b) for a, b in zip(args, inputs)), "the op is functional: inputs untouched"


def test_torch_backend_is_selected_over_the_reference(torch_backend):
    impl = graft.select("fused.adam_step", *_tensors((5,)), *HYPER, 1)
    assert impl.fn is adam_step_torch and impl.backend == "torch"


def test_in_place_many_tensors_is_one_fused_call(torch_backend, monkeypatch):
    calls = []
    real = torch._fused_adamw_

    def counting(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    shapes = [(7,), (33, 5), (1,), (4, 4, 4)]
    sets = [_tensors(s, seed=i) for i, s in enumerate(shapes)]
    expected = [adam_step_reference(*t, *HYPER, 3, 0.01, True, True) for t in sets]
    params, grads, ms, vs = ([t[i].clone() for t in sets] for i in range(4))
    assert adam_step_(params, grads, ms, vs, *HYPER, 3, 0.01, True, True) == "torch"
    assert calls == [len(shapes)]
    for got, want in zip(zip(params, ms, vs), expected):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_in_place_mixed_tensors_take_the_per_tensor_path(torch_backend):
    """A non-contiguous tensor, fp32 moments of a bf16 parameter and no bias correction:
    every tensor still gets the reference's update, in place."""
    p_nc = torch.randn(6, 8).t()  # non-contiguous
    g_nc, m_nc, v_nc = torch.randn(8, 6) * 0.1, torch.zeros(8, 6), torch.zeros(8, 6)
    mixed = _tensors((9,), torch.bfloat16, torch.float32, seed=3)
    plain = _tensors((5,), seed=4)
    sets = [(p_nc, g_nc, m_nc, v_nc), mixed, plain]
    for bias_correction in (True, False):
        expected = [adam_step_reference(*t, *HYPER, 2, 0.0, False, bias_correction) for t in sets]
        params, grads, ms, vs = ([t[i].clone() for t in sets] for i in range(4))
        adam_step_(params, grads, ms, vs, *HYPER, 2, 0.0, False, bias_correction)
        for got, want in zip(zip(params, ms, vs), expected):
            for a, b in zip(got, want):
                tol = dict(rtol=1e-5, atol=1e-6) if a.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(a.float(), b.float(), **tol)
        assert params[0].stride() == p_nc.stride(), "updated in place, layout kept"


def test_triton_steps_a_group_in_place_in_one_launch_per_dtype_group(fresh_graft, monkeypatch):
    """The Triton backend's multi-tensor form: every contiguous tensor of a group updated in
    place by one launch per dtype combination (bf16 params with fp32 moments, fp32), exactly
    as its per-tensor kernel computes; a non-contiguous view, a misaligned view and an empty
    tensor go their own way; the address table is built once and reused while the tensors
    stay the same."""
    from graft.kernels.triton import fused_adam_step as K

    monkeypatch.setenv("GRAFT_BACKENDS", "triton,torch")
    gen = torch.Generator().manual_seed(11)
    shapes = [(1030,), (7, 5), (3000,), (1,), (0, 4), (6, 9)]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32]
    params = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]
    params[5] = params[5].t()  # a non-contiguous view: per tensor
    params.append(torch.randn(1001, generator=gen)[1:])  # contiguous but not 16-byte aligned: per tensor
    grads = [(0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype) for p in params]
    ms = [0.01 * torch.randn(p.shape, generator=gen) for p in params]
    vs = [1e-4 * torch.rand(p.shape, generator=gen) for p in params]
    launches = []
    real = K._adam_multi_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(K, "_adam_multi_kernel", Spy())
    tables = []
    for step in (1, 2):
        expected = [K.adam_step(p, g, m, v, *HYPER, step, 0.1, True, True) for p, g, m, v in zip(params, grads, ms, vs)]
        addresses = [p.data_ptr() for p in params]
        assert adam_step_(params, grads, ms, vs, *HYPER, step, 0.1, True, True) == "triton"
        assert [p.data_ptr() for p in params] == addresses  # in place
        for got, want in zip(zip(params, ms, vs), expected):
            for a, b in zip(got, want):
                assert torch.equal(a, b), "the group kernel computes what the per-tensor kernel does"
        tables.append(dict(K._TABLES))
    # per step: one launch for the bf16 group (2 tensors), one for fp32 (2); blocks cover each tensor
    assert len(launches) == 4, launches
    block = K.tile_config(K.TILES, "cpu")["block"]
    assert launches[0] == (2 + 3,) and launches[1] == (1 + 1,), (launches, block)
    assert tables[0] == tables[1] and all(a is b for a, b in zip(tables[0].values(), tables[1].values()))


def test_in_place_with_another_backend_copies_back(fresh_graft, monkeypatch):
    """Under the Triton interpreter Triton serves (functional kernel): results copied into place."""
    monkeypatch.setenv("GRAFT_BACKENDS", "triton,torch")
    sets = [_tensors((17,), seed=5), _tensors((3, 3), seed=6)]
    expected = [adam_step_reference(*t, *HYPER, 1, 0.1, True, True) for t in sets]
    params, grads, ms, vs = ([t[i].clone() for t in sets] for i in range(4))
    assert adam_step_(params, grads, ms, vs, *HYPER, 1, 0.1, True, True) == "triton"
    for got, want in zip(zip(params, ms, vs), expected):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (lambda L: L.update(grads=L["grads"][:1]), "the tensor lists differ in length"),
    (lambda L: L.update(params=L["params"][0]), "params must be a list of tensors, got Tensor"),
    (lambda L: L["grads"].__setitem__(1, torch.zeros(2)), "grad has shape"),
    (lambda L: L["exp_avgs"].__setitem__(1, torch.zeros(3, dtype=torch.int32)), "exp_avg has dtype"),
    (lambda L: L.update(step=0), "step must be an int >= 1"),
])
def test_in_place_rejects_bad_input(torch_backend, change, message):
    lists = dict(params=[torch.zeros(3), torch.zeros(3)], grads=[torch.zeros(3), torch.zeros(3)],
                 exp_avgs=[torch.zeros(3), torch.zeros(3)], exp_avg_sqs=[torch.zeros(3), torch.zeros(3)], step=1)
    change(lists)
    step = lists.pop("step")
    with pytest.raises(GraftInputError, match=message):
        adam_step_(**lists, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=step)


def test_empty_lists_do_nothing(torch_backend):
    assert adam_step_([], [], [], [], *HYPER, 1) is None
