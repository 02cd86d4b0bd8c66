"""attention.decode_paged's torch backend (``decode_paged_torch``: every sequence in one batched
pass, no Python loop over them) against the reference over a shape/dtype matrix (odd sizes,
zero lengths, an empty batch, vLLM's strided cache views, fp8 caches, out-of-range values
with the checks off, non-finite inputs), and the fp8 path reading only the pages a request
uses: a 1 GiB cache and a 16-token context take seconds and no cache-sized memory."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from graft.ops import attention
from graft.kernels.torch import attention as torch_attention
from graft.kernels.torch.attention import decode_paged_torch
from graft.ops.attention import decode_paged_reference, make_decode_inputs

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype, kv_dtype=None, seed=0, spare_blocks=3):
    gen = torch.Generator().manual_seed(seed)
    return make_decode_inputs(seq_lens, heads, kv_heads, head_dim, block_size, "cpu", dtype, gen,
                              kv_dtype=kv_dtype, spare_blocks=spare_blocks)


# (seq_lens, heads, kv_heads, head_dim, block_size): odd lengths, block edges, zero lengths,
# MQA/GQA/MHA, an odd head size and block size.
MATRIX = [
    pytest.param([1, 17, 32, 45], 4, 2, 64, 16, id="gqa2_d64_bs16"),
    pytest.param([0, 9, 64, 70], 4, 1, 128, 8, id="mqa4_d128_bs8_zero_len"),
    pytest.param([16, 48, 5], 2, 2, 64, 16, id="mha_block_edges"),
    pytest.param([3, 20, 0, 1, 11], 6, 3, 80, 5, id="gqa2_d80_bs5_odd"),
    pytest.param([0, 0], 2, 1, 32, 16, id="all_empty"),
    pytest.param([], 2, 1, 32, 16, id="no_sequences"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim, block_size", MATRIX)
def test_matches_reference(seq_lens, heads, kv_heads, head_dim, block_size, dtype):
    args, kw = _inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    for splits in (0, 3):  # changes nothing in one pass
        _close(decode_paged_torch(*args, num_splits=splits), decode_paged_reference(*args, **kw), dtype)
    if not any(seq_lens):
        assert torch.equal(decode_paged_torch(*args), torch.zeros_like(args[0]))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fp8_cache_matches_reference_and_dequantised_attention(dtype, kv_dtype):
    args, kw = _inputs([5, 40, 0, 17, 1], 8, 2, 64, 16, dtype, kv_dtype=kv_dtype, seed=3)
    query, kq, vq, bt, lens = args
    expected = decode_paged_reference(*args, **kw)
    _close(decode_paged_torch(*args, **kw), expected, dtype)
    floats = {name: float(kw[name]) for name in ("k_scale", "v_scale")}
    _close(decode_paged_torch(*args, **floats), expected, dtype)
    # The same as attention over the dequantised caches in the query's dtype's tolerance.
    deq_k = (kq.float() * kw["k_scale"]).to(dtype)
    deq_v = (vq.float() * kw["v_scale"]).to(dtype)
    _close(decode_paged_torch(query, deq_k, deq_v, bt, lens), expected, dtype)
    # The value scale scales the output.
    twice = decode_paged_torch(*args, k_scale=kw["k_scale"], v_scale=kw["v_scale"] * 2)
    _close(twice.float(), 2 * expected.float(), dtype if dtype != torch.float32 else torch.float16)


def test_vllm_strided_cache_views_fp32_and_fp8():
    """vLLM's per-layer [num_blocks, kv_heads, block_size, 2 * head_dim] tensor read as
    kv_cache.transpose(1, 2).split(head_dim, -1): non-contiguous views, and as bytes for fp8."""
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, kv_heads, d = 12, 16, 2, 64
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * d, generator=gen)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    assert not key_cache.is_contiguous()
    query = torch.randn(4, 3, d, generator=gen).transpose(0, 1)  # a non-contiguous query too
    block_tables = torch.tensor([[7, 2, 11], [0, 5, 3], [9, 9, 9]], dtype=torch.int32)
    # This layout takes the one-gather path (each token's key and value side by side); two
    # separate caches, or the halves swapped, do not.
    blocks, slots = block_tables[:, :1].long(), torch.arange(1)
    assert torch_attention._kv_tokens_of(key_cache, value_cache, blocks, slots, None, None) is not None
    assert torch_attention._kv_tokens_of(value_cache, key_cache, blocks, slots, None, None) is None
    assert torch_attention._kv_tokens_of(key_cache.contiguous(), value_cache, blocks, slots, None, None) is None
    seq_lens = torch.tensor([40, 17, 1], dtype=torch.int32)
    _close(decode_paged_torch(query, key_cache, value_cache, block_tables, seq_lens),
           decode_paged_reference(query, key_cache.contiguous(), value_cache.contiguous(), block_tables, seq_lens),
           torch.float32)
    fp8 = (kv_cache / 4).to(torch.float8_e4m3fn).view(torch.uint8)
    kb, vb = fp8.transpose(1, 2).split(d, dim=-1)
    kf, vf = kb.view(torch.float8_e4m3fn), vb.view(torch.float8_e4m3fn)
    scale = torch.tensor([4.0])
    _close(decode_paged_torch(query, kf, vf, block_tables, seq_lens, k_scale=scale, v_scale=scale),
           decode_paged_reference(query, kf.contiguous(), vf.contiguous(), block_tables, seq_lens, k_scale=scale,
                                  v_scale=scale), torch.float32)


def test_caches_whose_rows_are_not_contiguous():
    """head_dim with a stride (every other element) and a cache with a transposed head/slot
    order: the gather falls back to plain indexing, same result."""
    (query, kc, vc, bt, lens), _ = _inputs([7, 30, 1], 4, 2, 32, 8, torch.float32)
    wide_k = torch.stack([kc, -kc], dim=-1).flatten(-2)[..., ::2]
    wide_v = torch.stack([vc, -vc], dim=-1).flatten(-2)[..., ::2]
    assert wide_k.stride(-1) == 2 and torch.equal(wide_k, kc)
    expected = decode_paged_reference(query, kc, vc, bt, lens)
    _close(decode_paged_torch(query, wide_k, wide_v, bt, lens), expected, torch.float32)
    swapped_k = kc.transpose(1, 2).contiguous().transpose(1, 2)
    swapped_v = vc.transpose(1, 2).contiguous().transpose(1, 2)
    _close(decode_paged_torch(query, swapped_k, swapped_v, bt, lens), expected, torch.float32)
    # No block at all: every token is out of range, zero rows.
    none = decode_paged_torch(query, kc[:0], vc[:0], bt, lens)
    assert torch.equal(none, torch.zeros_like(query))


def test_out_of_range_values_as_the_reference_defines_them():
    """Value checks off: seq_lens clamped into [0, capacity], tokens of table entries outside
    [0, num_blocks) skipped, a row with no valid token is zero."""
    (query, kc, vc, bt, lens), _ = _inputs([20, 9, 33, 5], 4, 2, 32, 8, torch.float32)
    bt = bt.clone()
    bt[0, 1] = kc.shape[0] + 7  # a middle block of sequence 0 out of range
    bt[1, :2] = -1  # both of sequence 1's blocks: no valid token left
    lens = torch.tensor([20, 9, 10 ** 6, -4], dtype=torch.int32)  # over capacity, negative
    out = decode_paged_torch(query, kc, vc, bt, lens)
    _close(out, decode_paged_reference(query, kc, vc, bt, lens), torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))


def test_non_finite_inputs_as_the_reference():
    (query, kc, vc, bt, lens), _ = _inputs([6, 10, 3], 2, 1, 16, 4, torch.float32)
    kc, vc, query = kc.clone(), vc.clone(), query.clone()
    query[0, 0, 0] = float("nan")
    vc[bt[1, 0].long(), 2, 0, 3] = float("inf")
    kc[bt[2, 0].long(), :3] = float("-inf")  # sequence 2 sees only -inf scores (positive query)
    query[2] = query[2].abs() + 0.1
    expected = decode_paged_reference(query, kc, vc, bt, lens)
    torch.testing.assert_close(decode_paged_torch(query, kc, vc, bt, lens), expected, equal_nan=True)
    assert torch.equal(expected[2], torch.zeros_like(expected[2]))


def test_dispatch_serves_it_above_the_reference(fresh_graft, monkeypatch):
    import graft

    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    args, kw = _inputs([5, 19], 4, 2, 64, 16, torch.float32)
    impl = graft.select("attention.decode_paged", *args, **kw)
    assert impl.fn is decode_paged_torch
    _close(attention.decode_paged(*args, **kw), decode_paged_reference(*args, **kw), torch.float32)


# A 1 GiB fp8 cache (never touched: torch.empty maps no memory until written), a 16-token
# context written into two of its blocks. Before, decode converted both caches to fp32
# (8 GiB written, 42 s); now it reads two pages. Run in a fresh process so that its peak RSS
# is this call's, not the test session's.
_BIG_CACHE = textwrap.dedent("""
    import resource, sys, time, torch
    from graft.ops import attention
    from graft.kernels.torch.attention import decode_paged_torch
    from graft.ops.attention import decode_paged_reference

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    fn = {"torch": decode_paged_torch, "reference": decode_paged_reference, "dispatch": attention.decode_paged}[
        sys.argv[1]]
    block_size, kv_heads, d = 16, 4, 128
    num_blocks = (1 << 30) // (block_size * kv_heads * d)  # 1 GiB per cache
    fp8 = torch.float8_e4m3fn
    key_cache = torch.empty(num_blocks, block_size, kv_heads, d, dtype=torch.uint8)
    value_cache = torch.empty(num_blocks, block_size, kv_heads, d, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    blocks = [num_blocks - 3, 12345]
    small_k = torch.randn(2, block_size, kv_heads, d, generator=gen).to(fp8)
    small_v = torch.randn(2, block_size, kv_heads, d, generator=gen).to(fp8)
    key_cache[blocks] = small_k.view(torch.uint8)
    value_cache[blocks] = small_v.view(torch.uint8)
    query = torch.randn(1, 8, d, generator=gen)
    table = torch.tensor([blocks], dtype=torch.int32)
    lens = torch.tensor([16 + 7], dtype=torch.int32)  # 16 tokens of context + 7: two blocks
    scale = torch.tensor([0.5])
    args = (query, key_cache.view(fp8), value_cache.view(fp8), table, lens)
    fn(query, small_k, small_v, torch.tensor([[0, 1]], dtype=torch.int32), lens, k_scale=scale, v_scale=scale)
    before = max(rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # warm, and the peak so far
    start = time.perf_counter()
    out = fn(*args, k_scale=scale, v_scale=scale)
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    expected = decode_paged_reference(query, small_k, small_v, torch.tensor([[0, 1]], dtype=torch.int32), lens,
                                      k_scale=scale, v_scale=scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    print(f"{seconds:.3f} {grown}")
""")


@pytest.mark.parametrize("which", ["torch", "reference", "dispatch"])
def test_fp8_decode_reads_only_the_used_pages_of_a_1gib_cache(which):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env["GRAFT_BACKENDS"] = "torch"
    done = subprocess.run([sys.executable, "-c", _BIG_CACHE, which], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seconds, grown = done.stdout.split()
    # Converting one cache to fp32 writes 4 GiB; reading the request's two pages, kilobytes.
    assert int(grown) < 64 << 20, f"peak RSS grew by {int(grown) >> 20} MiB"
    assert float(seconds) < 5.0, f"{seconds} s"
