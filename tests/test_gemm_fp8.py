"""gemm.fp8: quantizers, the Triton kernel (per-tensor, per-row and 128x128 block scales,
split-K) vs the torch reference, validation, dispatch and the custom op."""
import math

import pytest
import torch

from graft import quant
from graft.errors import GraftInputError
from graft.ops import gemm as G

pytestmark = pytest.mark.usefixtures("fresh_graft")
FP8 = torch.float8_e4m3fn
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _tol(out_dtype, device):
    """TOL, but on a GPU fp8 tensor-core MMAs accumulate inside one K block in about 14 mantissa
    bits (Hopper; DeepSeek-V3 report, section 3.3.2), not fp32: 1.6e-3 absolute seen at fp32
    output on an H200. The CPU interpreter accumulates in fp32: TOL there."""
    if torch.device(device).type == "cpu":
        return TOL[out_dtype]
    return {key: max(value, 2e-3) for key, value in TOL[out_dtype].items()}


def _inputs(m, n, k, scales, seed=0, dtype=FP8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(max(k, 1))
    if scales == "block":
        return (*quant.quantize_fp8_per_token_group(x, dtype=dtype), *quant.quantize_fp8_block(w, dtype=dtype))
    if scales == "tensor":
        return (*quant.quantize_fp8_per_tensor(x, dtype), *quant.quantize_fp8_per_tensor(w, dtype))
    row = max(k, 1)
    return (*quant.quantize_fp8_per_token_group(x, row, dtype), *quant.quantize_fp8_per_token_group(w, row, dtype))


def _args(m, n, k, scales, seed=0, dtype=FP8):
    x_q, xs, w_q, ws = _inputs(m, n, k, scales, seed, dtype)
    return x_q, w_q, xs, ws


def test_quantizers_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=gen)
    w[:128, :128] = 0  # an all-zero block: scale 1, codes 0
    q, s = quant.quantize_fp8_block(w)
    assert q.dtype == FP8 and s.shape == (3, 3) and s[0, 0] == 1 and (q[:128, :128].float() == 0).all()
    err = (quant.dequantize_fp8(q, s, (128, 128)) - w).abs()
    step = quant.dequantize_fp8(torch.ones_like(q), s, (128, 128)) * 2**-9  # e4m3's subnormal step, scaled
    assert (err <= w.abs() * 2**-4 + step).all()  # 3 mantissa bits: half a step relative
    x = torch.randn(5, 200, generator=gen)
    qx, sx = quant.quantize_fp8_per_token_group(x)
    assert sx.shape == (5, 2) and qx.shape == x.shape
    step = quant.dequantize_fp8(torch.ones_like(qx), sx, (1, 128)) * 2**-9
    assert (quant.dequantize_fp8(qx, sx, (1, 128)) - x).abs().le(x.abs() * 2**-4 + step).all()
    assert qx.float().abs().max() <= quant.fp8_max()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m, n, k, scales", [(1, 7, 16, "tensor"), (17, 48, 33, "row"), (5, 130, 300, "block"),
                                             (33, 129, 128, "block"), (2, 24, 200, "tensor")])
def test_fp8_matches_reference(m, n, k, scales, out_dtype, device):
    x_q, w_q, xs, ws = (t.to(device) for t in _args(m, n, k, scales, seed=m + n))
    assert G.fp8_blockwise(x_q, w_q, xs, ws) == (scales == "block")
    b = torch.randn(n).to(device, out_dtype) if m % 2 else None
    y = G.fp8(x_q, w_q, xs, ws, b, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    ref = G.fp8_reference(x_q, w_q, xs, ws, b, out_dtype)
    torch.testing.assert_close(y.float(), ref.float(), **_tol(out_dtype, device))


@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
def test_fp8_split_k_and_strided(scales, device):
    from graft.kernels.triton import gemm_fp8

    x_q, w_q, xs, ws = (t.to(device) for t in _args(3, 40, 520, scales, seed=3))
    blockwise = G.fp8_blockwise(x_q, w_q, xs, ws)
    cfg = gemm_fp8.plan(3, 40, 520, device, blockwise, split_k=3)
    assert cfg["SPLIT_K"] == 3
    orig = gemm_fp8.plan
    try:
        gemm_fp8.plan = lambda *a, **kw: dict(cfg)
        y = gemm_fp8._fp8(x_q, w_q, xs, ws, None, torch.float32)
    finally:
        gemm_fp8.plan = orig
    tol = _tol(torch.float32, device)
    torch.testing.assert_close(y, G.fp8_reference(x_q, w_q, xs, ws, None, torch.float32), **tol)
    wt = w_q.t().contiguous().t()  # column-major weight view
    torch.testing.assert_close(G.fp8(x_q, wt, xs, ws, None, torch.float32),
                               G.fp8_reference(x_q, w_q, xs, ws, None, torch.float32), **tol)


def test_fp8_fnuz_and_empty(device):
    x_q, w_q, xs, ws = (t.to(device) for t in _args(4, 16, 64, "tensor", dtype=torch.float8_e4m3fnuz))
    torch.testing.assert_close(G.fp8(x_q, w_q, xs, ws).float(), G.fp8_reference(x_q, w_q, xs, ws).float(),
                               **TOL[torch.bfloat16])
    x0 = torch.zeros(0, 64, dtype=torch.float8_e4m3fnuz, device=device)
    assert G.fp8(x0, w_q, torch.ones(1, device=device), ws).shape == (0, 16)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: (a[0].float(), *a[1:]), "x_q has dtype float32"),
    (lambda a: (a[0], a[1].to(torch.float8_e4m3fnuz), *a[2:]), "w_q dtype"),
    (lambda a: (a[0], a[1][:, :-1], *a[2:]), "K mismatch"),
    (lambda a: (a[0], a[1], a[2].half(), a[3]), "x_scale has dtype float16"),
    (lambda a: (a[0], a[1], a[2], torch.ones(2, 2)), "block scales need both"),
    (lambda a: (a[0], a[1], torch.ones(7), torch.ones(1)), "x_scale has shape"),
    (lambda a: (*a, None, torch.int8), "out_dtype"),
    (lambda a: (*a, torch.ones(3)), "bias has 3 elements"),
])
def test_fp8_bad_input(mutate, match):
    args = _args(5, 200, 300, "block")
    with pytest.raises(GraftInputError, match=match):
        G.fp8(*mutate(args))


def test_fp8_dispatch_and_custom_op(device):
    from graft.dispatch import select
    from graft.kernels.triton.gemm_fp8 import fp8_op

    args = tuple(t.to(device) for t in _args(5, 24, 64, "row"))
    assert select("gemm.fp8", *args, None, torch.bfloat16).backend == "triton"
    # test_schema is left out: its SchemaCheckMode multiplies fp8 tensors, which CPU torch lacks
    torch.library.opcheck(fp8_op, (*args, None, torch.float32),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    out = torch.compile(lambda *a: fp8_op(*a, None, torch.float32) * 2, backend="eager", fullgraph=True)(*args)
    torch.testing.assert_close(out, 2 * G.fp8_reference(*args, None, torch.float32), **TOL[torch.float32])


@pytest.mark.parametrize("arch, fmt, refused", [
    ("gfx942", torch.float8_e4m3fn, True), ("gfx942", torch.float8_e4m3fnuz, False),
    ("sm_90", torch.float8_e4m3fnuz, True), ("sm_90", torch.float8_e4m3fn, False),
    ("gfx950", torch.float8_e4m3fn, False),
])
def test_fp8_flavour_refused_per_arch(monkeypatch, arch, fmt, refused):
    """e4m3fn on MI300 (bf16 MFMAs and spills) and e4m3fnuz on Hopper (no lowering) are refused
    by check(), naming the format and the architecture; the interpreter takes both."""
    from types import SimpleNamespace

    from graft.kernels.triton import gemm_fp8, moe_fused_experts_fp8
    from graft.platform import DeviceInfo

    for module in (gemm_fp8, moe_fused_experts_fp8):
        monkeypatch.setattr(module, "device_info", lambda device: DeviceInfo("cuda", "x", arch, arch))
    on_gpu = SimpleNamespace(dtype=fmt, device=torch.device("cuda", 0))  # check() reads dtype and device
    reasons = [gemm_fp8.check(on_gpu, on_gpu, None, None),
               moe_fused_experts_fp8.check(None, on_gpu, on_gpu, None, None, None, None)]
    for reason in reasons:
        if refused:
            assert reason is not None and str(fmt) in reason and arch in reason, reason
        else:
            assert reason is None, reason
    x_q, w_q, xs, ws = _args(4, 16, 64, "tensor", dtype=fmt)  # the CPU interpreter: no refusal
    assert gemm_fp8.check(x_q, w_q, xs, ws) is None
