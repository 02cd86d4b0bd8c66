"""moe.fused_experts_fp8: DeepSeek-V3-style fp8 experts (128x128 block scales, per-token-group
fp8 activations), the Triton kernels vs the torch reference, validation and the custom op."""
import pytest
import torch

from graft.errors import GraftInputError
from graft.ops import moe as M
from graft.ops import moe as F

pytestmark = pytest.mark.usefixtures("fresh_graft")
# The SiLU-and-mul rows are rounded to hidden's dtype and re-quantized to fp8 per 128-group:
# when the kernel's and the reference's fp32 sums round to neighbouring bf16 values, a group's
# scale (its amax) and so its codes can move by one fp8 step: bf16 gets a few fp8 steps.
TOL = {torch.float16: dict(atol=8e-3, rtol=1e-2), torch.bfloat16: dict(atol=0.16, rtol=0.1),
       torch.float32: dict(atol=2e-4, rtol=1e-3)}


def _inputs(t, e, k, h, i, dtype, seed=0, skip_expert=None, fmt=torch.float8_e4m3fn):
    gen = torch.Generator().manual_seed(seed)
    (hidden, w13, w2, weights, ids), _ = M.make_moe_inputs(t, e, k, h, i, "cpu", torch.float32, gen, skip_expert)
    w13_q, w2_q, w13_s, w2_s = F.quantize_experts(w13, w2, fmt)
    return (hidden.to(dtype), w13_q, w2_q, w13_s, w2_s, weights, ids), (w13, w2)


@pytest.mark.parametrize("t, e, k, h, i, skip, dtype", [
    (1, 4, 1, 48, 40, None, torch.float16), (1, 4, 1, 48, 40, None, torch.bfloat16),
    (1, 4, 1, 48, 40, None, torch.float32),
    (17, 8, 2, 200, 136, 5, torch.float16),  # H, I not multiples of 128; an expert nobody routes to
    (40, 2, 1, 64, 64, None, torch.bfloat16),  # several M blocks per expert: the grouped order's bands
], ids=str)
def test_matches_reference(t, e, k, h, i, skip, dtype, device):
    args, _ = _inputs(t, e, k, h, i, dtype, seed=t, skip_expert=skip)
    args = tuple(a.to(device) for a in args)
    y = F.fused_experts_fp8(*args)
    assert y.shape == (t, h) and y.dtype == dtype
    torch.testing.assert_close(y.float(), F.fused_experts_fp8_reference(*args).float(), **TOL[dtype])


def test_close_to_the_unquantized_moe(device):
    """The block scales are applied where they belong: within fp8 error of the bf16 MoE."""
    args, (w13, w2) = _inputs(9, 4, 2, 256, 192, torch.float32, seed=3)
    args, w13, w2 = tuple(a.to(device) for a in args), w13.to(device), w2.to(device)
    hidden, weights, ids = args[0], args[5], args[6]
    exact = M.fused_experts_reference(hidden, w13, w2, weights, ids)
    y = F.fused_experts_fp8(*args)
    rel = (y - exact).norm() / exact.norm()
    assert rel < 0.08, rel  # e4m3 keeps 3 mantissa bits: a few percent after two GEMMs


def test_fnuz_format_and_empty(device):
    args, _ = _inputs(5, 4, 2, 48, 40, torch.float16, fmt=torch.float8_e4m3fnuz)
    args = tuple(a.to(device) for a in args)
    torch.testing.assert_close(F.fused_experts_fp8(*args).float(), F.fused_experts_fp8_reference(*args).float(),
                               **TOL[torch.float16])
    empty, _ = _inputs(0, 4, 2, 48, 40, torch.float16)
    empty = tuple(a.to(device) for a in empty)
    assert F.fused_experts_fp8(*empty).shape == (0, 48)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # (inf / inf, interpreted)
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, k", [(3, 128), (5, 300), (1, 1), (2, 1100), (0, 256), (2, 0)], ids=str)
def test_activation_quantization_kernel_is_graft_quant(m, k, dtype, fmt, device):
    """The one-launch per-token-group quantization gives graft.quant's codes and scales exactly:
    odd widths (a partial last group), more groups than one program takes, empty, a transposed
    (non-contiguous) input, an all-zero group (scale 1), and a group holding NaN and inf."""
    from graft.kernels.triton.moe_fused_experts_fp8 import quantize_act_launch
    from graft.quant import quantize_fp8_per_token_group

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * 3).to(dtype)
    if m > 2 and k >= 128:
        x[2, :128] = 0
    if m > 1 and k > 200:
        x[1, 130], x[1, 5] = float("nan"), float("inf")
    for arg in (x, x.t().contiguous().t()):
        q, scale = quantize_act_launch(arg.to(device), fmt)
        want_q, want_scale = quantize_fp8_per_token_group(arg, 128, fmt)
        assert q.dtype == fmt and q.shape == (m, k) and scale.shape == want_scale.shape
        torch.testing.assert_close(q.cpu().float(), want_q.float(), atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(scale.cpu(), want_scale, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: (a[0], a[1].float(), *a[2:]), "w13_q has dtype float32"),
    (lambda a: (a[0], a[1], a[2].to(torch.float8_e4m3fnuz), *a[3:]), "w2_q dtype"),
    (lambda a: (a[0], a[1], a[2], a[3][:2], *a[4:]), "w13_scale has shape"),
    (lambda a: (a[0], a[1], a[2], a[3], a[4].half(), *a[5:]), "w2_scale has dtype float16"),
    (lambda a: (a[0][:, :-1], *a[1:]), "w13_q is"),
    (lambda a: (*a, "gelu"), "activation"),
])
def test_bad_input(mutate, match):
    args, _ = _inputs(3, 4, 2, 48, 40, torch.float16)
    with pytest.raises(GraftInputError, match=match):
        F.fused_experts_fp8(*mutate(args))


def test_dispatch_and_custom_op(device):
    from graft.dispatch import select
    from graft.kernels.triton.moe_fused_experts_fp8 import fused_experts_fp8_triton

    args, _ = _inputs(5, 4, 2, 48, 40, torch.float32)
    args = tuple(a.to(device) for a in args)
    assert select("moe.fused_experts_fp8", *args).backend == "triton"
    torch.library.opcheck(fused_experts_fp8_triton, (*args, "silu"),
                          test_utils=("test_faketensor", "test_autograd_registration"))  # test_schema: fp8 mul on CPU
    out = torch.compile(lambda *a: fused_experts_fp8_triton(*a, "silu") + 1, backend="eager", fullgraph=True)(*args)
    torch.testing.assert_close(out, F.fused_experts_fp8_reference(*args) + 1, **TOL[torch.float32])
