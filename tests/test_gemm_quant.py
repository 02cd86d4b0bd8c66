"""gemm.w8a8 and gemm.w4a16: quantization/packing helpers, Triton kernels vs the torch
references, input validation, dispatch and the custom ops."""
import math

import pytest
import torch

from graft import quant
from graft.errors import GraftInputError
from graft.ops import gemm as G

pytestmark = pytest.mark.usefixtures("fresh_graft")

TOL = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- int8 helpers


def test_quantize_per_token_and_channel_int8():
    gen = _gen()
    x = torch.randn(5, 3, 40, generator=gen) * torch.linspace(0.1, 10, 5).reshape(5, 1, 1)
    x[1, 2] = 0  # an all-zero row must not divide by zero
    q, s = quant.quantize_per_token_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 3, 1)
    assert q.abs().max() <= 127 and (q.float() * s - x).abs().le(s / 2 + 1e-6).all()
    assert (q[1, 2] == 0).all()
    w = torch.randn(12, 40, generator=gen)
    wq, ws = quant.quantize_per_channel_int8(w)
    assert ws.shape == (12,) and torch.equal(wq.abs().amax(dim=1), torch.full((12,), 127, dtype=torch.int8))
    assert (wq.float() * ws[:, None] - w).abs().le(ws[:, None] / 2 + 1e-6).all()
    tq, ts = quant.quantize_per_tensor_int8(w)
    assert ts.dim() == 0 and (tq.float() * ts - w).abs().max() <= ts / 2 + 1e-6
    with pytest.raises(GraftInputError):
        quant.quantize_per_token_int8(q)


# ----------------------------------------------------------------------------- w8a8


def _w8a8_inputs(m, n, k, device, x_scale_kind="token", w_scale_kind="channel", bias_dtype=None, seed=0):
    gen = _gen(seed)
    x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    xs = (torch.rand(m, generator=gen) + 0.5) / 73.0
    ws = (torch.rand(n, generator=gen) + 0.5) / (73.0 * math.sqrt(k))
    xs = {"token": xs, "token_col": xs[:, None], "tensor": xs[:1], "scalar": xs[0]}[x_scale_kind]
    ws = {"channel": ws, "channel_col": ws[:, None], "tensor": ws[:1], "scalar": ws[0]}[w_scale_kind]
    b = torch.randn(n, generator=gen).to(bias_dtype) if bias_dtype is not None else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x_q), to(w_q), to(xs), to(ws), to(b)


W8A8_SHAPES = [(m, n, k) for m in (1, 3, 17, 64) for n in (7, 48, 129) for k in (16, 33, 128)]


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mnk", W8A8_SHAPES, ids=lambda s: "m%d_n%d_k%d" % s)
def test_w8a8_matches_reference(mnk, out_dtype, device):
    i = W8A8_SHAPES.index(mnk)
    x_kind = ("token", "token_col", "tensor", "scalar")[i % 4]
    w_kind = ("channel", "channel_col", "tensor", "scalar")[(i // 2) % 4]
    bias_dtype = (None, torch.float32, out_dtype)[i % 3]
    args = _w8a8_inputs(*mnk, device, x_kind, w_kind, bias_dtype, seed=i)
    y = G.w8a8(*args, out_dtype)
    ref = G.w8a8_reference(*args, out_dtype)
    assert y.dtype == out_dtype and y.shape == (mnk[0], mnk[1])
    torch.testing.assert_close(y.float(), ref.float(), **TOL[out_dtype])


def test_w8a8_int32_accumulation_is_exact(device):
    """Extreme codes over a long K: the int32 sum must be exact (compared to int64)."""
    k = 2048
    x_q = torch.full((3, k), -128, dtype=torch.int8, device=device)
    w_q = torch.full((5, k), -128, dtype=torch.int8, device=device)
    w_q[1] = 127
    x_q[2, ::2] = 127
    one = torch.ones(1, device=device)
    scale = torch.tensor([2.0**-20], device=device)  # keeps |y| in fp16 range, exact power of two
    y = G.w8a8(x_q, w_q, scale, one, None, torch.float16)
    exact = (x_q.cpu().long() @ w_q.cpu().long().t()).double() * 2.0**-20  # CUDA has no int64 matmul
    torch.testing.assert_close(y.cpu().double(), exact.to(torch.float16).double(), atol=0, rtol=0)


@pytest.mark.parametrize("m, n, k, splits", [(1, 40, 200, 3), (5, 33, 129, 2), (17, 64, 96, 4), (3, 8, 64, 8)])
def test_w8a8_split_k_is_bit_exact(m, n, k, splits, device):
    """Split-K sums int32 partials, then scales once: the same output bits as one split."""
    from graft.kernels.triton.gemm_w8a8 import _w8a8, plan

    # the shapes split on the interpreter's plan; a GPU's wider BLOCK_K may leave fewer
    # splits (one where K is a single step), and _w8a8 plans for the tensors' device
    assert plan(m, n, k, "cpu", splits)["SPLIT_K"] > 1
    x_kind = ("token", "tensor")[m % 2]
    args = _w8a8_inputs(m, n, k, device, x_kind, "channel", torch.float32, seed=m + n + k)
    for out_dtype in (torch.float16, torch.bfloat16):
        split = _w8a8(*args, out_dtype, split_k=splits)
        assert torch.equal(split, _w8a8(*args, out_dtype, split_k=1))
        torch.testing.assert_close(split.float(), G.w8a8_reference(*args, out_dtype).float(), **TOL[out_dtype])


@pytest.mark.parametrize("generation, sms", [("hopper", 132), ("cdna3", 304)])
def test_w8a8_plan_fills_the_gpu_at_small_m(generation, sms):
    from graft.kernels.triton import _gemm_common as c
    from graft.kernels.triton.gemm_w8a8 import plan

    for n, k in ((4096, 4096), (6144, 4096), (1280, 8192)):
        for m in (1, 16):
            cfg = plan(m, n, k, "cuda", generation=generation, sms=sms)
            tiles = math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
            assert cfg["SPLIT_K"] > 1, (m, n, k, cfg)
            if tiles * cfg["SPLIT_K"] < sms:  # under one wave only where K runs out of splits
                assert k // cfg["BLOCK_K"] < c.MIN_K_STEPS_PER_SPLIT * (cfg["SPLIT_K"] + 1), (m, n, k, cfg)
            assert c.buffered_stages(cfg, generation) * c.stage_bytes(cfg, 1, 1) <= c.SHARED_LIMIT[generation] - 8192
    assert plan(4096, 4096, 4096, "cuda", generation=generation, sms=sms)["SPLIT_K"] == 1


def test_w8a8_end_to_end_with_quant_helpers(device):
    gen = _gen(3)
    x = torch.randn(9, 64, generator=gen).to(device)
    w = (torch.randn(24, 64, generator=gen) / 8).to(device)
    b = torch.randn(24, generator=gen).to(device)
    x_q, xs = quant.quantize_per_token_int8(x)
    w_q, ws = quant.quantize_per_channel_int8(w)
    y = G.w8a8(x_q, w_q, xs, ws, b, torch.bfloat16)
    torch.testing.assert_close(y.float(), x @ w.t() + b, atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: (a[0].float(),) + a[1:], "x_q has dtype float32"),
        (lambda a: (a[0], a[1].float()) + a[2:], "w_q has dtype float32"),
        (lambda a: (a[0], a[1][:, :-1]) + a[2:], "K mismatch"),
        (lambda a: (a[0], a[1], a[2][:-1]) + a[3:], "x_scale has shape"),
        (lambda a: (a[0], a[1], a[2].half()) + a[3:], "x_scale has dtype float16"),
        (lambda a: a[:3] + (a[3].reshape(1, -1).repeat(2, 1),) + a[4:], "w_scale has shape"),
        (lambda a: a[:4] + (a[4][:-1],) + a[5:], "bias has 7 elements"),
        (lambda a: a[:5] + (torch.float32,), "out_dtype"),
        (lambda a: (a[0], a[1].to("meta")) + a[2:], "one device"),
        (lambda a: (a[0], a[1], a[2].to("meta")) + a[3:], "x_scale is on meta"),
        (lambda a: (a[0][None],) + a[1:], "x_q must be 2-D"),
    ],
)
def test_w8a8_bad_input_raises(mutate, match):
    args = _w8a8_inputs(4, 8, 16, "cpu", bias_dtype=torch.float32) + (torch.float16,)
    with pytest.raises(GraftInputError, match=match):
        G.w8a8(*mutate(args))


# ----------------------------------------------------------------------------- int4 packing


def test_gptq_and_awq_pack_conventions():
    """Pin the documented bit layouts with hand-computed words."""
    codes = torch.arange(8, dtype=torch.int32)
    # GPTQ: 8 consecutive K rows of one column -> one word, row j in nibble j.
    qweight, _ = quant.pack_gptq(codes.reshape(8, 1))
    assert qweight.shape == (1, 1) and qweight.item() == 0x76543210
    # GPTQ qzeros: 8 columns -> one word, zero - 1 stored (symmetric 8 -> 0x77777777).
    _, qzeros = quant.pack_gptq(torch.zeros(8, 8, dtype=torch.int32), torch.full((1, 8), 8, dtype=torch.int32))
    assert qzeros.item() == 0x77777777
    # AWQ: 8 consecutive N columns -> one word, nibble i = column (0, 2, 4, 6, 1, 3, 5, 7)[i].
    qweight, qzeros = quant.pack_awq(codes.reshape(1, 8), codes.reshape(1, 8))
    assert qweight.item() == 0x75316420 and qzeros.item() == 0x75316420
    # Bit 31 set: stored as a negative int32 with the same bits.
    qweight, _ = quant.pack_gptq(torch.full((8, 1), 15, dtype=torch.int32))
    assert qweight.dtype == torch.int32 and qweight.item() == -1


def _k_for(fmt, k):
    """K for a case in ``fmt``: gptq_interleaved packs K in blocks of 128 (rounded up to that)."""
    return -(-k // quant.INTERLEAVE_K) * quant.INTERLEAVE_K if fmt == "gptq_interleaved" else k


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("k, n, g", [(32, 8, 32), (64, 24, -1), (256, 136, 64)])
def test_pack_unpack_roundtrip(fmt, k, n, g):
    k = _k_for(fmt, k)
    gen = _gen(k + n)
    groups = 1 if g == -1 else k // g
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(1, 16, (groups, n), generator=gen, dtype=torch.int32)
    qweight, qzeros = quant.pack_int4(q, z, fmt)
    expected = (k, n // 8) if fmt == "awq" else (k // 8, n)
    assert qweight.shape == expected and qweight.dtype == torch.int32
    assert qzeros.shape == (groups, n // 8) and qzeros.dtype == torch.int32
    q2, z2 = quant.unpack_int4(qweight, qzeros, fmt)
    assert torch.equal(q2, q) and torch.equal(z2, z)


def test_pack_rejects_bad_input():
    q = torch.zeros(16, 16, dtype=torch.int32)
    with pytest.raises(GraftInputError, match="multiple of 8"):
        quant.pack_gptq(torch.zeros(12, 8, dtype=torch.int32))
    with pytest.raises(GraftInputError, match="multiple of 8"):
        quant.pack_awq(torch.zeros(8, 12, dtype=torch.int32))
    with pytest.raises(GraftInputError, match="1..15"):
        quant.pack_gptq(q, torch.zeros(1, 16, dtype=torch.int32))  # zero point 0: not in GPTQ v1
    with pytest.raises(GraftInputError, match="0..15"):
        quant.pack_awq(q + 16)
    with pytest.raises(GraftInputError, match="integer"):
        quant.pack_awq(q.float())
    with pytest.raises(GraftInputError, match="unknown int4 format"):
        quant.pack_int4(q, None, "marlin")
    with pytest.raises(GraftInputError, match="multiple of 128; got K=64"):
        quant.pack_int4(torch.zeros(64, 8, dtype=torch.int32), None, "gptq_interleaved")
    with pytest.raises(GraftInputError, match="multiple of 128; got K=64"):
        quant.interleave_gptq(torch.zeros(8, 8, dtype=torch.int32))
    with pytest.raises(GraftInputError, match="int32"):
        quant.interleave_gptq(torch.zeros(16, 8, dtype=torch.int64))


def test_gptq_interleaved_layout_is_pinned():
    """Nibble j of word row r in a block of 128 rows of K holds row 16j + r: with q[k] = k // 16
    every word of every block reads 0x76543210; de-interleaving gives GPTQ's words back."""
    k = 256
    q = (torch.arange(k, dtype=torch.int32) % 128 // 16).reshape(k, 1).expand(k, 3).contiguous()
    gptq, _ = quant.pack_gptq(q)
    interleaved = quant.interleave_gptq(gptq)
    assert interleaved.shape == gptq.shape == (k // 8, 3)
    assert (interleaved == 0x76543210).all()
    assert not torch.equal(gptq, interleaved)  # GPTQ's word r holds rows 8r..8r+7: two slices per word
    assert torch.equal(quant.deinterleave_gptq(interleaved), gptq)
    assert torch.equal(quant.pack_int4(q, None, "gptq_interleaved")[0], interleaved)


# ----------------------------------------------------------------------------- w4a16


def _w4a16_inputs(lead, n, k, g, fmt, dtype, device, zeros=True, bias=False, seed=0):
    k = _k_for(fmt, k)
    gen = _gen(seed)
    groups = 1 if g == -1 else k // g
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(1, 16, (groups, n), generator=gen, dtype=torch.int32) if zeros else None
    qweight, qzeros = quant.pack_int4(q, z, fmt)
    scales = (torch.rand(groups, n, generator=gen) + 0.5) / (4.0 * math.sqrt(k))
    x = torch.randn(*lead, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    to = lambda t, dt=None: None if t is None else t.to(device, dt)  # noqa: E731
    return to(x, dtype), to(qweight), to(scales, dtype), to(qzeros), to(b, dtype), g, fmt


W4_CASES = [
    # (lead, n, k, group_size, zeros, bias)
    ((1,), 8, 32, 32, True, False),
    ((3,), 24, 64, -1, True, True),
    ((17,), 136, 128, 64, False, False),
    ((64,), 48, 256, 128, True, True),
    ((2, 3), 16, 128, 32, True, False),
    ((5,), 8, 40, -1, False, True),  # K not a multiple of 16: masked K tail
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: "m%s_n%d_k%d_g%d_z%d_b%d" % ("x".join(map(str, c[0])), *c[1:]))
def test_w4a16_matches_reference(case, fmt, dtype, device):
    lead, n, k, g, zeros, bias = case
    args = _w4a16_inputs(lead, n, k, g, fmt, dtype, device, zeros, bias, seed=W4_CASES.index(case))
    y = G.w4a16(*args)
    ref = G.w4a16_reference(*args)
    assert y.shape == (*lead, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_w4a16_fp32_tight(fmt, device):
    args = _w4a16_inputs((7,), 40, 96, 32, fmt, torch.float32, device, bias=True)
    torch.testing.assert_close(G.w4a16(*args), G.w4a16_reference(*args), **TOL[torch.float32])


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_w4a16_end_to_end_with_quant_helpers(fmt, device):
    """Quantize a float weight, pack it, and check the GEMM against the float linear."""
    gen = _gen(11)
    w = torch.randn(32, 128, generator=gen) / 11
    x = torch.randn(6, 128, generator=gen)
    q, z, s = quant.quantize_int4(w, group_size=32)
    w_deq = quant.dequantize_int4(q, z, s.half().float(), 32)  # [K, N]
    assert (w_deq.t() - w).abs().max() <= s.max() * 0.51  # round to nearest: half a step at most
    qweight, qzeros = quant.pack_int4(q, z, fmt)
    y = G.w4a16(x.half().to(device), qweight.to(device), s.half().to(device), qzeros.to(device), None, 32, fmt)
    torch.testing.assert_close(y.float().cpu(), x.half().float() @ w_deq, **TOL[torch.float16])
    exact = x @ w.t()
    assert (y.float().cpu() - exact).norm() / exact.norm() < 0.1  # int4 error, small against the signal


def test_gptq_and_awq_layouts_agree(device):
    """The same codes packed as AWQ and as GPTQ give the same product."""
    args = list(_w4a16_inputs((4,), 8, 64, 32, "awq", torch.float32, device))
    q, z = quant.unpack_awq(args[1], args[3])
    args[1], args[3] = quant.pack_gptq(q, z)
    args[6] = "gptq"
    y_awq = G.w4a16(*_w4a16_inputs((4,), 8, 64, 32, "awq", torch.float32, device))
    torch.testing.assert_close(G.w4a16(*args), y_awq, **TOL[torch.float32])


@pytest.mark.parametrize("g", [32, 128, -1])
def test_gptq_interleaved_gives_gptqs_product(g, device):
    """A GPTQ checkpoint interleaved once (graft.quant.interleave_gptq) gives the same GEMM: the
    Triton kernel reads it as [16, N] slices per MMA instead of reshaping 8-row words."""
    from graft.dispatch import select

    args = list(_w4a16_inputs((5,), 24, 384, g, "gptq", torch.float16, device, bias=True))
    y_gptq, gptq_args = G.w4a16(*args), tuple(args)
    args[1], args[6] = quant.interleave_gptq(args[1]), "gptq_interleaved"
    if device.type == "cpu":
        assert select("gemm.w4a16", *args).backend == "triton"  # the kernel's interleaved path, interpreted
    torch.testing.assert_close(G.w4a16(*args).float(), y_gptq.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(G.w4a16_reference(*args), G.w4a16_reference(*gptq_args), atol=0, rtol=0)


def test_interleaved_layout_refused_where_it_cannot_be_read():
    """K off the 128-row block is a clear input error; the HIP kernel (GPTQ/AWQ words only)
    refuses the layout, so selection falls back instead of misreading the nibbles."""
    from graft.kernels.hip import gemm as hip_gemm

    args = list(_w4a16_inputs((2,), 16, 128, 32, "gptq_interleaved", torch.float16, "cpu"))
    assert hip_gemm.check(*args) is not None and "gptq_interleaved" in hip_gemm.check(*args)
    assert hip_gemm.check(*args[:6], "gptq") is None
    x = torch.randn(2, 64, dtype=torch.float16)
    with pytest.raises(GraftInputError, match="multiple of 128; got K=64"):
        G.w4a16(x, torch.zeros(8, 16, dtype=torch.int32), torch.ones(2, 16, dtype=torch.float16), None, None, 32,
                "gptq_interleaved")


def test_w4a16_small_group_falls_back_to_reference(device):
    from graft.dispatch import select

    args = _w4a16_inputs((3,), 16, 64, 8, "gptq", torch.float16, device)
    backend = select("gemm.w4a16", *args).backend
    assert backend != "triton"  # a group of 8 is under the kernel's smallest BLOCK_K
    if device.type == "cpu":
        assert backend == "torch"  # on a GPU the hip backend may serve it instead
    # hip dequantizes W into fp16 before its matmul: one more rounding (test_hip_kernels' GEMM_TOL)
    tol = {} if backend == "torch" else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(G.w4a16(*args), G.w4a16_reference(*args), **tol)


def _mut(i, value):
    return lambda a: a[:i] + (value(a[i]) if callable(value) else value,) + a[i + 1 :]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (_mut(0, lambda x: x.to(torch.int8)), "x has dtype int8"),
        (_mut(1, lambda w: w.float()), "qweight has dtype float32"),
        (_mut(1, lambda w: w[:-1]), "K mismatch"),
        (_mut(2, lambda s: s[:, :-1]), "scales has shape"),
        (_mut(2, lambda s: s.to(torch.int32)), "scales has dtype int32"),
        (_mut(3, lambda z: z[:-1]), "qzeros has shape"),
        (_mut(4, lambda b: b[:-1]), "bias has 15"),
        (_mut(5, 48), "group_size 48"),
        (_mut(5, 0), "group_size 0"),
        (_mut(5, "32"), "group_size must be an int"),
        (_mut(6, "marlin"), "unknown format"),
        (_mut(1, lambda w: w.to("meta")), "one device"),
        (_mut(2, lambda s: s.to("meta")), "one device"),
    ],
)
def test_w4a16_bad_input_raises(mutate, match):
    args = _w4a16_inputs((3,), 16, 64, 32, "gptq", torch.float16, "cpu", bias=True)
    with pytest.raises(GraftInputError, match=match):
        G.w4a16(*mutate(args))


def test_w4a16_rejects_unpackable_sizes():
    x = torch.randn(2, 36, dtype=torch.float16)
    with pytest.raises(GraftInputError, match="K must be a multiple of 8"):
        G.w4a16(x, torch.zeros(4, 8, dtype=torch.int32), torch.ones(1, 8, dtype=torch.float16), None, None, -1, "gptq")
    x = torch.randn(2, 32, dtype=torch.float16)
    with pytest.raises(GraftInputError, match="N must be a multiple of 8"):
        G.w4a16(x, torch.zeros(4, 12, dtype=torch.int32), torch.ones(1, 12, dtype=torch.float16),
                torch.zeros(1, 1, dtype=torch.int32), None, -1, "gptq")  # fmt: skip


# ----------------------------------------------------------------------------- dispatch and custom ops


def test_dispatch_selects_triton_and_honours_env(monkeypatch, device):
    from graft.dispatch import select

    w8 = _w8a8_inputs(4, 8, 16, device) + (torch.float16,)
    w4 = _w4a16_inputs((3,), 16, 64, 32, "awq", torch.bfloat16, device)
    assert select("gemm.w8a8", *w8).backend == "triton"
    assert select("gemm.w4a16", *w4).backend == "triton"
    monkeypatch.setenv("GRAFT_GEMM", "torch")
    assert select("gemm.w8a8", *w8).backend == "torch"
    assert select("gemm.w4a16", *w4).backend == "torch"
    monkeypatch.setenv("GRAFT_GEMM_W4A16", "triton")  # the op-level variable wins over the family's
    assert select("gemm.w4a16", *w4).backend == "triton"


def test_custom_ops_opcheck_and_fake_tracing(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft.kernels.triton.gemm_w4a16 import w4a16_op
    from graft.kernels.triton.gemm_w8a8 import w8a8_op

    w8 = _w8a8_inputs(5, 9, 32, device, bias_dtype=torch.float32) + (torch.bfloat16,)
    torch.library.opcheck(w8a8_op, w8)
    w4 = _w4a16_inputs((5,), 16, 64, 32, "gptq", torch.float16, device, bias=True)
    torch.library.opcheck(w4a16_op, w4)
    gm = make_fx(lambda x, qw, s, qz: w4a16_op(x, qw, s, qz, None, 32, "gptq"), tracing_mode="fake")(*w4[:4])
    assert any("gemm_w4a16_triton" in str(n.target) for n in gm.graph.nodes)
    gm = make_fx(lambda *a: w8a8_op(*a, None, torch.float16), tracing_mode="fake")(*w8[:4])
    assert any("gemm_w8a8_triton" in str(n.target) for n in gm.graph.nodes)
