"""gemm.linear's persistent TMA kernel (Hopper at prefill M): exact against the pointer kernel
and the reference (interpreted here: Triton's interpreter runs tensor descriptors), which
layouts it takes, which plans pick it, and the fallback when it cannot be launched."""
import contextlib
import logging
import math

import pytest
import torch

from graft.kernels.triton import _gemm_common as C
from graft.kernels.triton import gemm_linear as L
from graft.ops import gemm as G

pytestmark = pytest.mark.usefixtures("fresh_graft")

TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _operands(m, n, k, dtype, device, seed=0, k_storage=None):
    """x [m, k], weight [n, k] (rows ``k_storage`` apart: a K the descriptor reads past) and a bias."""
    gen = torch.Generator().manual_seed(seed)
    ks = k_storage or k
    x = torch.randn(m, ks, generator=gen).to(device, dtype)[:, :k]
    w = (torch.randn(n, ks, generator=gen) / math.sqrt(k)).to(device, dtype)[:, :k]
    b = torch.randn(n, generator=gen).to(device, dtype)
    return x, w, b


@pytest.fixture
def three_sms(monkeypatch):
    """Three persistent programs, so tiles are shared out unevenly (the interpreter has one SM)."""
    monkeypatch.setattr(C, "sm_count", lambda device: 3)
    C._plan.cache_clear()
    yield
    C._plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mnk, k_storage", [((70, 56, 48), None), ((129, 264, 40), None), ((33, 64, 45), 48),
                                            ((1, 8, 8), None), ((97, 40, 200), None)],
                         ids=["ragged_m", "ragged_n_tiles", "k_past_the_end", "one_row", "long_k"])
@pytest.mark.parametrize("activation", ["none", "silu", "gelu"])
def test_tma_kernel_matches_pointer_kernel_and_reference(mnk, k_storage, dtype, activation, device, three_sms):
    m, n, k = mnk
    x, w, b = _operands(m, n, k, dtype, device, seed=m + n + k, k_storage=k_storage)
    bias = b if activation != "none" else None
    y = L.matmul(x, w.t(), bias, activation, tma=True)
    pointer = L.matmul(x, w.t(), bias, activation, tma=False)
    # same tiles of K in the same order, fp32 accumulation: the kernels agree to the last bit
    torch.testing.assert_close(y, pointer, atol=0, rtol=0)
    ref = G.linear_reference(x, w, bias, activation)
    torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])


def test_tma_kernel_every_tile_written_once(device, three_sms):
    """Tiles past what an even share covers (7 tiles on 3 programs) are all computed: the
    output starts as NaN and every element must be overwritten."""
    x, w, _ = _operands(7 * 32, 32, 64, torch.float16, device)
    y = torch.full((7 * 32, 32), float("nan"), dtype=torch.float16, device=device)
    L.matmul(x, w.t(), out=y, tma=True)
    assert not y.isnan().any()
    torch.testing.assert_close(y.float(), (x.float() @ w.float().t()), **TOL[torch.float16])


@pytest.mark.parametrize("case, match", [
    (dict(n=50), r"out has strides \(50, 1\).*multiple of 8"),  # a row of 100 bytes
    (dict(x_t=True), r"a has strides \(1, 24\)"),
    (dict(dtype=torch.float32), "fp16/bf16"),
    (dict(accumulate=True), "cannot accumulate"),
    (dict(split_k=2), "does not split K"),
])
def test_tma_forced_on_a_layout_it_cannot_take_raises(case, match):
    n, dtype = case.get("n", 16), case.get("dtype", torch.float16)
    x, w, _ = _operands(24, n, 32, dtype, "cpu")
    if case.get("x_t"):
        x = x.t().contiguous().t()
    out = torch.zeros(24, n, dtype=dtype) if case.get("accumulate") else None
    with pytest.raises(ValueError, match=match):
        L.matmul(x, w.t(), out=out, accumulate=case.get("accumulate", False), split_k=case.get("split_k"), tma=True)


def test_layouts_descriptors_cannot_take_use_the_pointer_kernel(monkeypatch):
    """With the TMA plan chosen (as on Hopper), a column-major x or an odd N still gets the
    right answer, from the pointer kernel; a fitting layout gets the TMA kernel."""
    monkeypatch.setattr(L, "tma_plan", lambda m, n, k, device, size, **kw: C.tma_plan(m, n, k, device, size, force=True))
    launched = []
    real = L._launch_tma
    monkeypatch.setattr(L, "_launch_tma", lambda *a, **kw: (launched.append(1), real(*a, **kw)))
    x, w, b = _operands(40, 24, 32, torch.float16, "cpu")
    L.matmul(x, w.t(), b, "relu")
    assert launched == [1]
    xt = x.t().contiguous().t()
    torch.testing.assert_close(L.matmul(xt, w.t(), b, "relu").float(), G.linear_reference(x, w, b, "relu").float(),
                               **TOL[torch.float16])
    x, w, b = _operands(40, 21, 32, torch.float16, "cpu")
    torch.testing.assert_close(L.matmul(x, w.t(), b).float(), G.linear_reference(x, w, b).float(), **TOL[torch.float16])
    assert launched == [1]


def test_a_failing_tma_launch_falls_back_once_with_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(L, "tma_plan", lambda m, n, k, device, size, **kw: C.tma_plan(m, n, k, device, size, force=True))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no TMA on this device")

    monkeypatch.setattr(L, "_launch_tma", broken)
    monkeypatch.setattr(L, "_tma_failed", {})
    x, w, b = _operands(40, 24, 32, torch.float16, "cpu")
    with caplog.at_level(logging.WARNING, logger=L.__name__):
        for _ in range(2):
            y = L.matmul(x, w.t(), b, "gelu")
            torch.testing.assert_close(y.float(), G.linear_reference(x, w, b, "gelu").float(), **TOL[torch.float16])
    assert calls == [1]  # tried once, then the pointer kernel serves without trying again
    assert "no TMA on this device" in L._tma_failed[(torch.float16, "cpu")]
    assert sum("TMA GEMM kernel failed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="no TMA"):  # forced: the failure is the caller's to see
        L.matmul(x, w.t(), b, tma=True)


def test_plans_pick_tma_on_hopper_at_prefill_only():
    hopper = dict(generation="hopper", sms=132)
    cfg = L.plan(4096, 4096, 4096, torch.bfloat16, "cuda", **hopper)
    assert cfg["TMA"] and cfg["NUM_PROGRAMS"] == 132 and cfg["SPLIT_K"] == 1
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (128, 256, 64)
    # the staged tiles and the output tile the TMA store reads from fit Hopper's shared memory
    staged = cfg["num_stages"] * C.stage_bytes(cfg, 2, 2) + cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2
    assert staged <= C.SHARED_LIMIT["hopper"]
    assert not L.plan(4096, 4096, 4096, torch.float16, "cuda", tma=False, **hopper).get("TMA")
    assert not L.plan(128, 4096, 4096, torch.bfloat16, "cuda", **hopper).get("TMA")  # decode/small M: pointer rows
    assert not L.plan(256, 4096, 4096, torch.bfloat16, "cuda", **hopper).get("TMA")  # 32 tiles: split-K fills 132 SMs
    assert not L.plan(4096, 4096, 4096, torch.float32, "cuda", **hopper).get("TMA")  # fp32: pointer kernel
    assert not L.plan(4096, 4096, 4096, torch.bfloat16, "cuda", split_k=2, **hopper).get("TMA")
    assert not L.plan(4096, 4096, 4096, torch.bfloat16, "cuda", generation="cdna3", sms=304).get("TMA")
    assert not L.plan(4096, 4096, 4096, torch.bfloat16, "cpu").get("TMA")  # the interpreter: only when forced
    small = L.plan(300, 300, 64, torch.bfloat16, "cuda", generation="hopper", sms=4)
    assert small["TMA"] and small["NUM_PROGRAMS"] == 4  # at most one program per SM


def test_aot_variants_compile_the_tma_plans():
    """The AOT check compiles the TMA kernel with the plan's tiles and descriptors of those blocks."""
    tma = [v for v in L.aot_variants() if v.kernel is L._linear_tma_kernel]
    assert tma and all(v.targets == ("sm_90",) for v in tma)
    cfg = L.plan(4096, 4096, 4096, torch.bfloat16, "cuda", generation="hopper", sms=132)
    v = tma[0]
    assert v.descriptors == {"x_desc": (cfg["BLOCK_M"], cfg["BLOCK_K"]), "w_desc": (cfg["BLOCK_N"], cfg["BLOCK_K"]),
                             "y": (cfg["BLOCK_M"], cfg["BLOCK_N"])}
    assert v.options == {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    pointer_rows = {(v.constexprs["BLOCK_M"], v.constexprs["BLOCK_N"]) for v in L.aot_variants()
                    if v.kernel is L._linear_kernel and "sm_90" in v.targets}
    assert (256, 128) in pointer_rows  # the pointer kernel's prefill row stays checked (layouts TMA cannot take)


def test_tma_kernel_propagates_nan_and_inf_as_the_pointer_kernel(device, three_sms):
    """Hostile values: NaN and inf in x and the bias come out where the pointer kernel (and the
    reference) put them; the zero fill past K adds nothing to them."""
    x, w, b = _operands(40, 24, 45, torch.float16, device, k_storage=48)
    x[3, 7], x[11, 0], b[5] = float("nan"), float("inf"), float("-inf")
    y = L.matmul(x, w.t(), b, "silu", tma=True)
    torch.testing.assert_close(y, L.matmul(x, w.t(), b, "silu", tma=False), atol=0, rtol=0, equal_nan=True)
    assert y[3].isnan().all() and y[:, 5].isneginf().sum() + y[:, 5].isnan().sum() == 40


@contextlib.contextmanager
def _warp_specialized(m, n, k, dtype, device):
    """gemm.linear's TMA row replaced by the warp-specialised one, with the interpreter's tile
    (that of the pointer plan: the same K steps in the same order, so the two agree to the
    last bit); yields the configurations the TMA kernel was launched with."""
    from graft.tools.bench.tile_sweep import tile_row

    tile = {key: L.plan(m, n, k, dtype, device, tma=False)[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    row = {key: v for key, v in C.WARP_SPECIALIZED_TMA_ROW.items() if key != "K_BYTES"}
    row.update(tile, TMA=True)
    launched: list = []
    real = L._launch_tma
    with tile_row("interpreter", m, row), pytest.MonkeyPatch.context() as patch:
        patch.setattr(L, "_launch_tma", lambda cfg, *a: (launched.append(cfg), real(cfg, *a)))
        yield launched
    assert launched and all(cfg["WARP_SPECIALIZE"] and cfg["num_warps"] == 4 for cfg in launched)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mnk", [(70, 56, 48), (1, 8, 8), (97, 40, 200)], ids=["ragged", "one_row", "long_k"])
def test_warp_specialized_tma_kernel_matches_pointer_kernel(mnk, dtype, device, three_sms):
    """The warp-specialised form (the tile sweep's candidate: a pointer store, a masked
    epilogue) writes exactly what the pointer kernel writes, into an output of any row
    stride, and nothing outside it."""
    m, n, k = mnk
    x, w, b = _operands(m, n, k, dtype, device, seed=m * n + k)
    wide = torch.full((m, n + 8), float("nan"), dtype=dtype, device=device)
    with _warp_specialized(m, n, k, dtype, device):
        y = L.matmul(x, w.t(), b, "silu", out=wide[:, :n], tma=None if m >= 2 else True)
    pointer = L.matmul(x, w.t(), b, "silu", tma=False)
    torch.testing.assert_close(y, pointer, atol=0, rtol=0)
    assert wide[:, n:].isnan().all()  # past N: untouched


def test_warp_specialized_tma_kernel_propagates_nan_and_inf(device, three_sms):
    """Hostile values through the warp-specialised form (a K read past its end too): NaN and
    inf come out where the pointer kernel puts them."""
    x, w, b = _operands(40, 24, 45, torch.float16, device, k_storage=48)
    x[3, 7], x[11, 0], b[5] = float("nan"), float("inf"), float("-inf")
    with _warp_specialized(40, 24, 45, torch.float16, device):
        y = L.matmul(x, w.t(), b, "silu", tma=True)
    torch.testing.assert_close(y, L.matmul(x, w.t(), b, "silu", tma=False), atol=0, rtol=0, equal_nan=True)
    assert y[3].isnan().all() and y[:, 5].isneginf().sum() + y[:, 5].isnan().sum() == 40
