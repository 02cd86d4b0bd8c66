"""gemm.linear: Triton kernel vs the torch reference, input validation, dispatch, custom op."""
import math

import pytest
import torch

from graft.errors import GraftInputError
from graft.ops import gemm as G

pytestmark = pytest.mark.usefixtures("fresh_graft")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# |y - ref| <= atol + rtol * |ref|; both sides are rounded to the dtype, so ~1 ulp apart.
TOL = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
}


def _inputs(lead, n, k, dtype, device, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(max(k, 1))).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def _check(y, x, w, b, activation):
    ref = G.linear_reference(x, w, b, activation)
    assert y.shape == ref.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.float(), ref.float(), **TOL[x.dtype])


SHAPES = [(m, n, k) for m in (1, 3, 17, 64) for n in (7, 48, 129) for k in (16, 33, 128)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: "m%d_n%d_k%d" % s)
def test_linear_matches_reference(mnk, dtype, device):
    m, n, k = mnk
    i = SHAPES.index(mnk)
    activation = G.ACTIVATIONS[i % len(G.ACTIVATIONS)]
    x, w, b = _inputs((m,), n, k, dtype, device, bias=i % 2 == 0, seed=i)
    _check(G.linear(x, w, b, activation), x, w, b, activation)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", G.ACTIVATIONS)
def test_every_activation(activation, bias, dtype, device):
    x, w, b = _inputs((19,), 40, 48, dtype, device, bias=bias)
    x = x * 3  # reach the activations' curved parts, not only their linear middle
    _check(G.linear(x, w, b, activation), x, w, b, activation)


def test_activation_really_applied(device):
    """The epilogue must not silently skip the activation: outputs differ across them."""
    x, w, b = _inputs((8,), 16, 32, torch.float32, device)
    outs = {a: G.linear(x, w, b, a) for a in G.ACTIVATIONS}
    assert (outs["relu"] >= 0).all() and (outs["none"] < 0).any()
    for a in ("gelu", "gelu_erf", "silu"):
        assert not torch.allclose(outs[a], outs["none"])
    assert not torch.allclose(outs["gelu"], outs["gelu_erf"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_3d_and_1d_x(dtype, device):
    x, w, b = _inputs((2, 5), 33, 64, dtype, device)
    y = G.linear(x, w, b, "silu")
    assert y.shape == (2, 5, 33)
    _check(y, x, w, b, "silu")
    x1 = x[0, 0]
    _check(G.linear(x1, w, b, "none"), x1, w, b, "none")


def test_strided_inputs(device):
    """Non-contiguous views are read through their strides."""
    x, w, b = _inputs((24,), 40, 64, torch.float16, device)
    xt = x.t().contiguous().t()  # column-major x
    wt = torch.randn(64, 40, device=device, dtype=torch.float16).t() / 8  # [40, 64] view, transposed strides
    _check(G.linear(xt, wt, b, "gelu"), xt, wt, b, "gelu")
    xs = torch.randn(24, 128, device=device, dtype=torch.float16)[:, ::2]  # stride 2 along K
    _check(G.linear(xs, w, None, "none"), xs, w, None, "none")


def test_empty_dims(device):
    x, w, b = _inputs((0,), 8, 16, torch.float32, device)
    assert G.linear(x, w, b).shape == (0, 8)
    x, w, b = _inputs((4,), 8, 0, torch.float32, device)
    _check(G.linear(x, w, b, "relu"), x, w, b, "relu")  # K = 0: act(bias)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, w, b: (x.to(torch.int8), w, b, "none"), "x has dtype int8"),
        (lambda x, w, b: (x, w.to(torch.int8), b, "none"), "weight has dtype int8"),
        (lambda x, w, b: (x, w.half(), b, "none"), "weight dtype"),
        (lambda x, w, b: (x, w[:, :-1], b, "none"), "K mismatch"),
        (lambda x, w, b: (x, w[0], b, "none"), "weight must be 2-D"),
        (lambda x, w, b: (x, w, b[:-1], "none"), "bias has 7 elements"),
        (lambda x, w, b: (x, w, b.half(), "none"), "bias has dtype float16"),
        (lambda x, w, b: (x, w, b, "tanh"), "unknown activation"),
        (lambda x, w, b: (x, w.to("meta"), b, "none"), "one device"),
        (lambda x, w, b: (x, w, b.to("meta"), "none"), "bias is on meta"),
        (lambda x, w, b: (x.numpy(), w, b, "none"), "must be a torch.Tensor"),
    ],
)
def test_bad_input_raises(mutate, match):
    x, w, b = _inputs((3,), 8, 16, torch.float32, "cpu")
    with pytest.raises(GraftInputError, match=match):
        G.linear(*mutate(x, w, b))


def test_dispatch_selects_triton_and_honours_env(monkeypatch, device):
    from graft.dispatch import select

    x, w, b = _inputs((4,), 8, 16, torch.float16, device)
    assert select("gemm.linear", x, w, b, "none").backend == "triton"
    monkeypatch.setenv("GRAFT_GEMM", "torch")
    assert select("gemm.linear", x, w, b, "none").backend == "torch"
    _check(G.linear(x, w, b, "gelu"), x, w, b, "gelu")


def test_custom_op_opcheck_and_fake_tracing(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft.kernels.triton.gemm_linear import linear_op

    x, w, b = _inputs((5,), 9, 20, torch.float32, device)
    torch.library.opcheck(linear_op, (x, w, b, "gelu"))
    torch.library.opcheck(linear_op, (x, w, None, "none"))
    gm = make_fx(lambda x, w, b: linear_op(x, w, b, "silu"), tracing_mode="fake")(x, w, b)
    assert any("gemm_linear_triton" in str(n.target) for n in gm.graph.nodes)
    out = torch.compile(lambda x, w, b: linear_op(x, w, b, "relu") * 2, backend="eager", fullgraph=True)(x, w, b)
    torch.testing.assert_close(out, 2 * G.linear_reference(x, w, b, "relu"), **TOL[torch.float32])


def test_dot_policy_follows_torch_tf32_setting(monkeypatch):
    """graft.kernels.triton._dot: one tl.dot policy for gemm, attention and moe kernels."""
    from types import SimpleNamespace

    from graft.kernels.triton import _dot

    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        monkeypatch.setattr(_dot, "triton_interpret", lambda: True)
        matmul.fp32_precision = "tf32"
        assert _dot.dot_flags(torch.float32) == {"UPCAST": False, "PRECISION": "ieee"}  # interpreter: IEEE
        assert _dot.dot_flags(torch.bfloat16) == {"UPCAST": True, "PRECISION": "ieee"}  # its bf16 dot is broken
        assert _dot.dot_flags(torch.float16)["UPCAST"] is False

        monkeypatch.setattr(_dot, "triton_interpret", lambda: False)  # compiled, on a GPU
        monkeypatch.setattr(_dot, "is_rocm", lambda: False)
        assert _dot.dot_flags(torch.float32) == {"UPCAST": False, "PRECISION": "tf32"}
        assert _dot.dot_flags(torch.bfloat16) == {"UPCAST": False, "PRECISION": "ieee"}  # native bf16 dot
        matmul.fp32_precision = "ieee"
        assert _dot.dot_flags(torch.float32)["PRECISION"] == "ieee"
        torch.set_float32_matmul_precision("high")  # the other spelling of "allow TF32"
        assert _dot.dot_flags(torch.float32)["PRECISION"] == "tf32"

        monkeypatch.setattr(_dot, "is_rocm", lambda: True)  # Triton has TF32 on gfx942 only
        for arch, precision in (("gfx942", "tf32"), ("gfx90a", "ieee"), ("gfx950", "ieee")):
            monkeypatch.setattr(_dot, "device_info", lambda device=None, arch=arch: SimpleNamespace(arch=arch))
            assert _dot.fp32_precision("cuda") == precision, arch
    finally:
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision = saved
