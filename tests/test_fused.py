"""fused.* ops: references against independent formulations, Triton kernels against the
references over shapes (odd H, empty, 3-D), dtypes, residual on/off, neox/GPT-J and
partial rotary, input validation, and the custom ops' fake impls."""
import math

import pytest
import torch

from graft.errors import GraftInputError
from graft.ops import fused

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# bf16 has an 8-bit mantissa: allow a couple of output ulps (rounding of the fp32 result).
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-5, 1e-5)}


def _close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# ----------------------------------------------------------------- references, from first principles


def test_rms_norm_reference_matches_formula():
    x = torch.randn(4, 33, dtype=torch.float64)
    w = torch.randn(33, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 33 + 1e-5) * w
    torch.testing.assert_close(fused.rms_norm_reference(x.float(), w.float(), 1e-5), expected.float())
    r = torch.randn(4, 33)
    out, res = fused.rms_norm_reference(x.float(), w.float(), 1e-5, r)
    torch.testing.assert_close(res, x.float() + r)
    torch.testing.assert_close(out, fused.rms_norm_reference(x.float() + r, w.float(), 1e-5))


def test_silu_and_mul_reference_matches_formula():
    x = torch.randn(3, 10)
    a, b = x[:, :5], x[:, 5:]
    torch.testing.assert_close(fused.silu_and_mul_reference(x), a / (1 + torch.exp(-a)) * b)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_reference_is_a_complex_rotation(is_neox):
    # Each rotated pair (x1, x2) is multiplied by e^{i * pos * theta_j}; the tail passes through.
    head, rot, tokens = 12, 8, 3
    cache = fused.cos_sin_cache(16, rot)
    pos = torch.tensor([0, 5, 15])
    q = torch.randn(tokens, 2 * head)
    q_out, k_out = fused.rotary_embedding_reference(pos, q, None, head, cache, is_neox)
    assert k_out is None
    qh, oh = q.view(tokens, 2, head), q_out.view(tokens, 2, head)
    half = rot // 2
    idx1 = list(range(half)) if is_neox else list(range(0, rot, 2))
    idx2 = list(range(half, rot)) if is_neox else list(range(1, rot, 2))
    for t in range(tokens):
        for j in range(half):
            theta = pos[t].item() * 10000.0 ** (-2 * j / rot)
            z = torch.complex(qh[t, :, idx1[j]], qh[t, :, idx2[j]]) * complex(math.cos(theta), math.sin(theta))
            torch.testing.assert_close(oh[t, :, idx1[j]], z.real, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(oh[t, :, idx2[j]], z.imag, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(oh[..., rot:], qh[..., rot:])
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity


# ----------------------------------------------------------------- Triton kernels vs reference


@pytest.fixture(scope="module")
def triton_fused():
    from graft.kernels.triton import fused_silu_and_mul, fused_rms_norm, fused_rotary_embedding

    return fused_rms_norm, fused_silu_and_mul, fused_rotary_embedding


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (1, 33), (5, 64), (2, 3, 127), (3, 4097), (0, 16)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_triton_rms_norm(triton_fused, device, shape, dtype, residual):
    norm = triton_fused[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    w = torch.randn(shape[-1], generator=gen).to(device, dtype)
    r = torch.randn(shape, generator=gen).to(device, dtype) if residual else None
    out = norm.rms_norm(x, w, 1e-5, r)
    ref = fused.rms_norm_reference(x, w, 1e-5, r)
    if residual:
        _close(out[0], ref[0], dtype)
        _close(out[1], ref[1], dtype)
        assert out[1].shape == x.shape and out[1].dtype == dtype
    else:
        _close(out, ref, dtype)
        assert out.shape == x.shape and out.dtype == dtype


def test_triton_rms_norm_strided_rows_and_long_row_two_pass(triton_fused, device, monkeypatch):
    norm = triton_fused[0]
    # Rows of a wider buffer (a view, not contiguous) and a tile narrower than H force the streaming path.
    monkeypatch.setitem(norm.TILES, "interpreter", {"max_block": 32, "num_warps": 1})
    monkeypatch.setitem(norm.TILES, "default", {"max_block": 32, "num_warps": 4})
    base = torch.randn(6, 200, device=device)
    x = base[:, :101]
    r = torch.randn(6, 101, device=device)
    w = torch.randn(101, device=device)
    out, res = norm.rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = fused.rms_norm_reference(x, w, 1e-6, r)
    _close(out, ref_out, torch.float32)
    _close(res, ref_res, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (1, 66), (4, 256), (2, 3, 34), (2, 4098), (0, 8)], ids=str)
def test_triton_silu_and_mul(triton_fused, device, shape, dtype):
    act = triton_fused[1]
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3).to(device, dtype)
    out = act.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    _close(out, fused.silu_and_mul_reference(x), dtype)


ROPE = [
    # tokens, q_heads, k_heads, head_size, rot_dim, 3-D layout
    (5, 4, 2, 64, 64, False),
    (3, 3, 1, 80, 32, False),  # partial rotary
    (4, 2, 2, 72, 40, True),  # partial rotary, [T, H, D] layout
    (1, 1, 1, 6, 2, False),  # tiny
    (7, 2, 1, 33, 20, False),  # odd head size, rotary part even
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("tokens,hq,hk,head,rot,three_d", ROPE, ids=[str(c) for c in ROPE])
def test_triton_rotary(triton_fused, device, tokens, hq, hk, head, rot, three_d, is_neox, dtype):
    rope = triton_fused[2]
    gen = torch.Generator().manual_seed(3)
    cache = fused.cos_sin_cache(64, rot, device=device)
    pos = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    qs = (tokens, hq, head) if three_d else (tokens, hq * head)
    ks = (tokens, hk, head) if three_d else (tokens, hk * head)
    q = torch.randn(qs, generator=gen).to(device, dtype)
    k = torch.randn(ks, generator=gen).to(device, dtype)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = rope.rotary_embedding(pos, q, k, head, cache, is_neox)
    q_ref, k_ref = fused.rotary_embedding_reference(pos, q, k, head, cache, is_neox)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)
    # Functional: inputs untouched.
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_triton_rotary_heads_in_chunks(triton_fused, device, monkeypatch, is_neox):
    """A small tile budget splits a token's heads into chunks (the last one partial, q and
    k counts unequal): every head rotated, the tail copied, nothing written past a row."""
    rope = triton_fused[2]
    monkeypatch.setattr(rope, "TILE_ELEMS", 16)
    head, rot, hq, hk, tokens = 12, 8, 7, 3, 3
    cfg = rope.launch_config(hq, hk, rot // 2, head - rot)
    assert cfg["HEAD_BLOCK"] == 4 and hq % cfg["HEAD_BLOCK"] and hk < cfg["HEAD_BLOCK"]
    gen = torch.Generator().manual_seed(5)
    cache = fused.cos_sin_cache(16, rot, device=device)
    pos = torch.tensor([3, 15, 0], device=device)
    q = torch.randn(tokens, hq * head, generator=gen).to(device)
    k = torch.randn(tokens, hk * head, generator=gen).to(device)
    for backward in (False, True):
        q_out, k_out = rope._rotate(pos, q, k, head, cache, is_neox, backward)
        c = cache if not backward else torch.cat([cache[:, : rot // 2], -cache[:, rot // 2 :]], 1)
        q_ref, k_ref = fused.rotary_embedding_reference(pos, q, k, head, c, is_neox)
        _close(q_out, q_ref, torch.float32)
        _close(k_out, k_ref, torch.float32)


def test_rotary_launch_config_bounds_the_tile(triton_fused):
    rope = triton_fused[2]
    for hq, hk, half, rest in ((64, 8, 64, 0), (128, 16, 64, 0), (32, 8, 64, 0), (1, 1, 3, 1), (40, 40, 32, 0),
                               (16, 16, 128, 0), (16, 16, 32, 192)):
        cfg = rope.launch_config(hq, hk, half, rest)
        width = max(cfg["BLOCK_HALF"], cfg["BLOCK_PASS"])
        assert cfg["HEAD_BLOCK"] * width <= rope.TILE_ELEMS and cfg["BLOCK_HALF"] >= half and cfg["BLOCK_PASS"] >= rest
        assert cfg["HEAD_BLOCK"] >= min(triton_next_pow2(max(hq, hk)), rope.TILE_ELEMS // width)


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def test_triton_rotary_views_int32_positions_and_no_k(triton_fused, device):
    rope = triton_fused[2]
    head, tokens = 16, 4
    qkv = torch.randn(tokens, 6 * head, device=device)
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 5 * head]  # strided views of a fused qkv buffer
    q_before = q.clone()
    cache = fused.cos_sin_cache(10, head, device=device).half()  # cache in another dtype
    pos = torch.tensor([9, 0, 3, 3], dtype=torch.int32, device=device)
    q_out, k_out = rope.rotary_embedding(pos, q, k, head, cache, True)
    q_ref, k_ref = fused.rotary_embedding_reference(pos.long(), q, k, head, cache, True)
    _close(q_out, q_ref, torch.float32)
    _close(k_out, k_ref, torch.float32)
    assert torch.equal(q, q_before)
    q_only, none = rope.rotary_embedding(pos, q, None, head, cache, False)
    assert none is None
    _close(q_only, fused.rotary_embedding_reference(pos.long(), q, None, head, cache, False)[0], torch.float32)


# ----------------------------------------------------------------- dispatch, validation, custom ops


def test_entry_points_dispatch_and_match(fresh_graft, device):
    import graft

    x = torch.randn(3, 40, device=device)
    w = torch.randn(40, device=device)
    # On the CPU only the Triton interpreter competes with the reference; a GPU may pick hip first.
    expected = ("triton",) if device.type == "cpu" else ("hip", "triton")
    for op, args in (("fused.rms_norm", (x, w, 1e-6, None)), ("fused.silu_and_mul", (x,))):
        assert graft.select(op, *args).backend in expected
    _close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6), torch.float32)
    out, res = fused.rms_norm(x, w, 1e-6, residual=x)
    _close(res, 2 * x, torch.float32)
    _close(fused.silu_and_mul(x), fused.silu_and_mul_reference(x), torch.float32)
    pos = torch.arange(3, device=device)
    cache = fused.cos_sin_cache(4, 8, device=device)
    q_out, k_out = fused.rotary_embedding(pos, x, x[:, :20], 20, cache, is_neox=False)
    q_ref, k_ref = fused.rotary_embedding_reference(pos, x, x[:, :20], 20, cache, False)
    _close(q_out, q_ref, torch.float32)
    _close(k_out, k_ref, torch.float32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fused.rms_norm(torch.randn(2, 8), torch.randn(7)), "weight must be 1-D of size hidden=8"),
        (lambda: fused.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(2, 7)), "residual must have"),
        (lambda: fused.rms_norm(torch.randn(2, 8).long(), torch.randn(8)), "x has dtype int64"),
        (lambda: fused.rms_norm(torch.randn(2, 8), torch.randn(8), -1.0), "eps must be"),
        (lambda: fused.silu_and_mul(torch.randn(2, 7)), "even last dim"),
        (lambda: fused.rotary_embedding(torch.arange(3), torch.randn(3, 30), None, 16, torch.randn(8, 16)),
         "multiple of 16"),
        (lambda: fused.rotary_embedding(torch.arange(3), torch.randn(3, 32), None, 16, torch.randn(8, 18)),
         "rot_dim <= head_size"),
        (lambda: fused.rotary_embedding(torch.arange(2), torch.randn(3, 32), None, 16, torch.randn(8, 16)),
         "num_tokens=2"),
        (lambda: fused.rotary_embedding(torch.arange(3.0), torch.randn(3, 32), None, 16, torch.randn(8, 16)),
         "positions has dtype float32"),
        (lambda: fused.rotary_embedding(torch.arange(3), torch.randn(3, 32), torch.randn(3, 32).half(), 16,
                                        torch.randn(8, 16)), "must match"),
    ],
)
def test_validation_errors(fresh_graft, call, message):
    with pytest.raises(GraftInputError, match=message):
        call()


def test_triton_custom_ops_opcheck_and_fake_tracing(triton_fused, device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    norm, act, rope = triton_fused
    x, w, r = (torch.randn(3, 20, device=device), torch.randn(20, device=device), torch.randn(3, 20, device=device))
    pos, cache = torch.tensor([1, 0, 2], device=device), fused.cos_sin_cache(4, 8, device=device)
    q, k = torch.randn(3, 40, device=device), torch.randn(3, 20, device=device)
    checks = [
        (norm.rms_norm_op, (x, w, 1e-6)),
        (norm.add_rms_norm_op, (x, r, w, 1e-6)),
        (act.silu_and_mul_op, (x,)),
        (rope.rotary_op, (pos, q, k, 20, cache, True)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.empty(5, 2, 64, dtype=torch.bfloat16))
        assert act.silu_and_mul_op(fx).shape == (5, 2, 32)
        out, res = norm.add_rms_norm_op(fx, fx, mode.from_tensor(torch.empty(64, dtype=torch.bfloat16)), 1e-6)
        assert out.shape == res.shape == (5, 2, 64) and out.dtype == torch.bfloat16


def test_triton_rms_norm_under_torch_compile(triton_fused, device):
    norm = triton_fused[0]
    fn = torch.compile(lambda x, w: norm.rms_norm(x, w, 1e-6) * 2, backend="eager", fullgraph=True)
    x, w = torch.randn(2, 24, device=device), torch.randn(24, device=device)
    _close(fn(x, w), fused.rms_norm_reference(x, w, 1e-6) * 2, torch.float32)
