"""Triton GEMM planning and split-K: the tile table per M range and target, split sizing,
shared-memory fit, and the split-K kernels + deterministic reduce vs the torch reference."""
import math

import pytest
import torch

from graft.ops import gemm as G

pytestmark = pytest.mark.usefixtures("fresh_graft")

TOL = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
}
LLAMA_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
            (1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584)]


def _common():
    from graft.kernels.triton import _gemm_common

    return _gemm_common


@pytest.mark.parametrize("generation, sms", [("hopper", 132), ("cdna3", 304)])
@pytest.mark.parametrize("size", [4, 2, 1])
def test_every_plan_fits_and_fills_the_gpu(generation, sms, size):
    c = _common()
    limit = c.SHARED_LIMIT[generation]
    for m in (1, 16, 64, 128, 512, 4096, 8192):
        for n, k in LLAMA_NK:
            cfg = c.gemm_plan(m, n, k, "cuda", size, generation=generation, sms=sms)
            assert c.buffered_stages(cfg, generation) * c.stage_bytes(cfg, size, size) <= limit, (m, n, k, cfg)
            tiles = math.ceil(m / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
            splits, per = cfg["SPLIT_K"], cfg["K_PER_SPLIT"]
            assert per % cfg["BLOCK_K"] == 0 or splits == 1
            assert (splits - 1) * per < k <= splits * per  # no empty split, all of K covered
            if tiles * splits < sms:  # still under one wave: split as far as K allows
                assert splits == c.MAX_SPLIT_K or k // cfg["BLOCK_K"] < c.MIN_K_STEPS_PER_SPLIT * (splits + 1)
            if m >= 512:
                assert cfg["BLOCK_M"] >= 64


def test_small_m_splits_large_m_does_not():
    c = _common()
    decode = c.gemm_plan(1, 4096, 4096, "cuda", 2, generation="hopper", sms=132)
    assert decode["BLOCK_M"] == 16 and decode["SPLIT_K"] > 1
    tiles = math.ceil(4096 / decode["BLOCK_N"])
    assert tiles * decode["SPLIT_K"] >= 132  # one launch covers every SM
    prefill = c.gemm_plan(4096, 4096, 4096, "cuda", 2, generation="hopper", sms=132)
    assert prefill["SPLIT_K"] == 1 and prefill["BLOCK_M"] == 128
    # K step in bytes: the same shared memory per stage for every operand size
    f32 = c.gemm_plan(4096, 4096, 4096, "cuda", 4, generation="hopper", sms=132)
    i8 = c.gemm_plan(4096, 4096, 4096, "cuda", 1, generation="hopper", sms=132)
    assert (f32["BLOCK_K"], prefill["BLOCK_K"], i8["BLOCK_K"]) == (32, 64, 128)


def test_fit_shared_trims_an_over_limit_config():
    c = _common()
    big = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    assert 4 * c.stage_bytes(big, 4, 4) == 262_144  # the fp32 config that could not launch on an H200
    fitted = c.fit_shared(big, "hopper", 4, 4)
    assert fitted["num_stages"] * c.stage_bytes(fitted, 4, 4) <= c.SHARED_LIMIT["hopper"] - 8192
    assert c.fit_shared(big, "interpreter", 4, 4) == big


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m, n, k, splits", [(1, 40, 200, 3), (5, 33, 129, 2), (17, 64, 96, 4), (3, 8, 64, 8)])
def test_forced_split_k_matches_reference(m, n, k, splits, dtype, device):
    from graft.kernels.triton.gemm_linear import matmul, plan

    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    # the shapes split on the interpreter's plan; a GPU's wider BLOCK_K may leave fewer
    # splits (one where K is a single step), and matmul plans for the tensors' device
    assert plan(m, n, k, dtype, "cpu", split_k=splits)["SPLIT_K"] > 1
    act = G.ACTIVATIONS[(m + n) % len(G.ACTIVATIONS)]
    y = matmul(x, w.t(), b, act, split_k=splits)
    torch.testing.assert_close(y.float(), G.linear_reference(x, w, b, act).float(), **TOL[dtype])
    assert torch.equal(y, matmul(x, w.t(), b, act, split_k=splits))  # fixed-order reduce: bit-reproducible


def test_matmul_any_strides_and_out(device):
    """The launcher backward passes reuse: transposed operands (dW = dy.T @ x) and an fp32 out."""
    from graft.kernels.triton.gemm_linear import matmul

    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(37, 24, generator=gen, dtype=torch.float32).to(device)  # [tokens, N]
    x = torch.randn(37, 40, generator=gen, dtype=torch.float32).to(device)  # [tokens, K]
    dw = matmul(dy.t(), x, split_k=3)  # [N, K], reduction over tokens
    torch.testing.assert_close(dw, dy.t() @ x, atol=1e-4, rtol=1e-4)
    out = torch.empty(40, 24, dtype=torch.float32, device=device).t()  # non-contiguous destination
    matmul(dy.t(), x, out=out)
    torch.testing.assert_close(out, dy.t() @ x, atol=1e-4, rtol=1e-4)
    h = torch.randn(6, 40, generator=gen).to(device).half()
    wt = torch.randn(40, 72, generator=gen).to(device).half()[:, ::3]  # stride 3 along N
    torch.testing.assert_close(matmul(h, wt).float(), h.float() @ wt.float(), atol=2e-3, rtol=2e-3)


def test_split_k_edge_cases(device):
    from graft.kernels.triton.gemm_linear import matmul

    x, w = torch.randn(4, 16, device=device), torch.randn(16, 8, device=device)
    torch.testing.assert_close(matmul(x, w, split_k=50), x @ w, atol=1e-5, rtol=1e-5)  # more splits than K steps
    assert matmul(torch.randn(0, 16, device=device), w, split_k=4).shape == (0, 8)
    b = torch.randn(8, device=device)
    empty_k = matmul(torch.randn(4, 0, device=device), torch.randn(0, 8, device=device), b, "relu")
    torch.testing.assert_close(empty_k, torch.relu(b).expand(4, 8))


@pytest.mark.parametrize("fmt", ["gptq", "awq", "gptq_interleaved"])
@pytest.mark.parametrize("m, n, k, g, zeros, splits", [(1, 16, 256, 32, True, 4), (3, 24, 128, -1, False, 3),
                                                       (16, 40, 192, 64, True, 2),
                                                       (2, 16, 160, 32, True, 3)])  # last split: a step past K
def test_w4a16_split_k_matches_reference(fmt, m, n, k, g, zeros, splits, device):
    if fmt == "gptq_interleaved":  # K in blocks of 128; a split of 32-row steps starts mid-block
        k = -(-k // 128) * 128
    from graft.kernels.triton import gemm_w4a16
    from graft.quant import pack_int4

    gen = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    groups = 1 if g == -1 else k // g
    z = torch.randint(1, 16, (groups, n), generator=gen, dtype=torch.int32) if zeros else None
    qweight, qzeros = (t if t is None else t.to(device) for t in pack_int4(q, z, fmt))
    scales = ((torch.rand(groups, n, generator=gen) + 0.5) / (4 * math.sqrt(k))).half().to(device)
    x = torch.randn(m, k, generator=gen).half().to(device)
    b = torch.randn(n, generator=gen).half().to(device)
    # the interpreter's plan, launched on every device: a GPU's own plan may not split these K
    cfg = gemm_w4a16.plan(m, n, k, x.dtype, "cpu", g, split_k=splits, interleaved=fmt == "gptq_interleaved")
    assert cfg["SPLIT_K"] > 1 and (g == -1 or g % cfg["BLOCK_K"] == 0)
    orig = gemm_w4a16.plan
    try:
        gemm_w4a16.plan = lambda *a, **kw: dict(cfg)
        y = gemm_w4a16._w4a16_2d(x, qweight, scales, qzeros, b, g, fmt)
    finally:
        gemm_w4a16.plan = orig
    ref = G.w4a16_reference(x, qweight, scales, qzeros, b, g, fmt)
    torch.testing.assert_close(y.float(), ref.float(), **TOL[torch.float16])


def test_w4a16_plan_splits_at_decode_sizes():
    from graft.kernels.triton import gemm_w4a16

    cfg = gemm_w4a16.plan(1, 4096, 4096, torch.float16, "cuda", 128, generation="hopper", sms=132)
    assert cfg["SPLIT_K"] > 1 and 128 % cfg["BLOCK_K"] == 0 and cfg["K_PER_SPLIT"] % 128 == 0
    assert gemm_w4a16.plan(4096, 4096, 4096, torch.float16, "cuda", 128, generation="hopper", sms=132)["SPLIT_K"] == 1


def _tile_order_probe():
    import triton
    import triton.language as tl

    from graft.kernels.triton import _gemm_common, moe_fused_experts

    global tile_coords, _grouped_tile  # the jit function resolves its callees in module globals
    tile_coords, _grouped_tile = _gemm_common.tile_coords, moe_fused_experts._grouped_tile

    @triton.jit
    def probe(out_ptr, M, N, tm, tn, GROUP_M: tl.constexpr, MOE: tl.constexpr):
        if MOE:
            a, b = _grouped_tile(tm, tn, GROUP_M)
        else:
            a, b = tile_coords(M, N, 16, 16, GROUP_M)
        pid = tl.program_id(0)
        tl.store(out_ptr + 2 * pid, a)
        tl.store(out_ptr + 2 * pid + 1, b)

    return probe


@pytest.mark.parametrize("tiles_m, tiles_n, group", [(5, 3, 2), (7, 4, 8), (1, 6, 1), (9, 2, 4)])
def test_grouped_tile_orders_cover_every_tile_once(tiles_m, tiles_n, group, device):
    """GEMM's tile_coords and fused MoE's _grouped_tile: a permutation of the tile grid, with
    GROUP_M consecutive programs sharing a column tile."""
    probe = _tile_order_probe()
    for moe in (False, True):
        out = torch.full((tiles_m * tiles_n, 2), -1, dtype=torch.int32, device=device)
        probe[(tiles_m * tiles_n,)](out, tiles_m * 16, tiles_n * 16, tiles_m, tiles_n, GROUP_M=group, MOE=moe)
        pairs = [tuple(p) for p in out.tolist()]
        assert sorted(pairs) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]
        band = min(group, tiles_m)
        assert len({j for _, j in pairs[:band]}) == 1  # the first band's programs share a column tile


@pytest.mark.parametrize("splits", [1, 3])
def test_matmul_accumulates_into_an_fp32_out(splits, device):
    """``accumulate``: out += a @ b in one fp32 rounding (the fused loss's dW over chunks),
    split or not; the fp16 operands never round the running sum."""
    from graft.kernels.triton.gemm_linear import matmul

    gen = torch.Generator().manual_seed(3)
    dw = torch.randn(24, 40, generator=gen).to(device)
    expected = dw.clone()
    for _ in range(3):
        dy, x = (torch.randn(33, rows, generator=gen).half().to(device) for rows in (24, 40))
        expected += dy.float().t() @ x.float()
        out = matmul(dy.t(), x, out=dw, split_k=splits, accumulate=True)
        assert out is dw
    torch.testing.assert_close(dw, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="adds to `out`"):
        matmul(dy.t(), x, accumulate=True)


def test_even_k_plans_say_when_every_step_lies_inside_k():
    """EVEN_K (loads masked by M and N only) exactly when K is whole steps and the splits
    cover it exactly; the Llama plans are all EVEN_K."""
    c = _common()
    for m in (1, 16, 4096):
        for n, k in LLAMA_NK:
            cfg = c.gemm_plan(m, n, k, "cuda", 2, generation="hopper", sms=132)
            assert cfg["EVEN_K"] == (k % cfg["BLOCK_K"] == 0 and cfg["SPLIT_K"] * cfg["K_PER_SPLIT"] == k)
    assert not c.gemm_plan(16, 4096, 4100, "cuda", 2, generation="hopper", sms=132)["EVEN_K"]
    # whole steps, but 3 splits of K=4096 at BLOCK_K 64 (64 steps: splits of 22, 22, 20): the last runs past K
    cfg = c.gemm_plan(16, 4096, 4096, "cuda", 2, generation="hopper", sms=132, split_k=3)
    assert cfg["SPLIT_K"] * cfg["K_PER_SPLIT"] > 4096 and not cfg["EVEN_K"]


@pytest.mark.parametrize("k, split", [(64, 1), (96, 2), (96, 3), (70, 1), (70, 2)])
def test_even_and_ragged_k_loops_match_the_reference(k, split):
    """The same products through the EVEN_K loop (no K mask) and the masked one."""
    from graft.kernels.triton import gemm_linear

    gen = torch.Generator().manual_seed(k + split)
    a, w = torch.randn(5, k, generator=gen), torch.randn(33, k, generator=gen)
    cfg = gemm_linear.plan(5, 33, k, torch.float32, "cpu", split_k=split, tma=False)
    got = gemm_linear.matmul(a, w.t(), split_k=split)
    torch.testing.assert_close(got, a @ w.t(), **TOL[torch.float32])
    assert cfg["EVEN_K"] == (k % cfg["BLOCK_K"] == 0 and cfg["SPLIT_K"] * cfg["K_PER_SPLIT"] == k)
