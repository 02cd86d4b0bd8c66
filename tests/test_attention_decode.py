"""attention.decode_paged: the torch reference against attention over contiguous K/V, the
Triton kernel (single pass and split-K, interpreted on the CPU) against the reference,
the vLLM cache layout, dispatch, validation and the custom op."""
import pytest
import torch

from graft.errors import GraftInputError
from graft.ops import attention
from graft.ops.attention import decode_paged_reference, make_decode_inputs, prefill_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}


def _close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _inputs(seq_lens, heads, kv_heads, head_dim, block_size, device, dtype, num_splits=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return make_decode_inputs(seq_lens, heads, kv_heads, head_dim, block_size, device, dtype, gen, num_splits)


def _contiguous_kv(key_cache, value_cache, block_tables, seq_lens):
    """Each sequence's K/V read back token by token (independent of the block gather)."""
    block_size = key_cache.shape[1]
    ks, vs = [], []
    for s, n in enumerate(seq_lens.tolist()):
        idx = [(int(block_tables[s, t // block_size]), t % block_size) for t in range(n)]
        ks.append(torch.stack([key_cache[b, o] for b, o in idx]) if idx else key_cache[:0, 0])
        vs.append(torch.stack([value_cache[b, o] for b, o in idx]) if idx else value_cache[:0, 0])
    return ks, vs


# ----------------------------------------------------------------- the reference itself


def test_reference_equals_prefill_of_last_token_over_gathered_context():
    (query, kc, vc, bt, lens), _ = _inputs([1, 16, 0, 21], 4, 2, 32, 8, "cpu", torch.float32)
    out = decode_paged_reference(query, kc, vc, bt, lens, softmax_scale=0.4)
    ks, vs = _contiguous_kv(kc, vc, bt, lens)
    for s, (k, v) in enumerate(zip(ks, vs)):
        n = k.shape[0]
        cu_q = torch.tensor([0, 1], dtype=torch.int32)
        cu_k = torch.tensor([0, n], dtype=torch.int32)
        # One query at the end of its context: causal bottom-right = sees every key.
        expected = prefill_reference(query[s : s + 1], k, v, cu_q, cu_k, 1, n, causal=True, softmax_scale=0.4)
        torch.testing.assert_close(out[s : s + 1], expected)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


# ----------------------------------------------------------------- Triton kernel vs reference


@pytest.fixture(scope="module")
def kernel():
    from graft.kernels.triton import attention_decode_paged

    return attention_decode_paged


# (seq_lens, heads, kv_heads, head_dim, block_size): odd lengths, exact block boundaries, 0.
MATRIX = [
    pytest.param([1, 17, 32, 45], 4, 2, 64, 16, id="gqa2_d64_bs16"),
    pytest.param([0, 9, 64, 70], 4, 1, 128, 8, id="mqa4_d128_bs8_zero_len"),
    pytest.param([16, 48, 5], 2, 2, 64, 16, id="mha_d64_bs16_block_edges"),
    pytest.param([33, 100], 8, 2, 128, 32, id="gqa4_d128_bs32"),
]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single_pass", "split3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim, block_size", MATRIX)
def test_kernel_matches_reference(kernel, device, seq_lens, heads, kv_heads, head_dim, block_size, dtype, num_splits):
    args, kw = _inputs(seq_lens, heads, kv_heads, head_dim, block_size, device, dtype, num_splits)
    out = kernel.decode_paged(*args, **kw)
    assert out.shape == args[0].shape and out.dtype == dtype
    _close(out, decode_paged_reference(*args, **kw), dtype)


def test_more_splits_than_tiles_and_odd_head_dim(kernel, device):
    # 8 splits over contexts of 3..20 tokens: most splits are empty and must weigh nothing.
    args, kw = _inputs([3, 20, 0], 4, 2, 80, 16, device, torch.float16, num_splits=8)
    _close(kernel.decode_paged(*args, **kw, softmax_scale=0.3),
           decode_paged_reference(*args, **kw, softmax_scale=0.3), torch.float16)


def test_all_empty_and_no_sequences(kernel, device):
    args, kw = _inputs([0, 0], 2, 1, 64, 16, device, torch.float32, num_splits=2)
    assert torch.equal(kernel.decode_paged(*args, **kw), torch.zeros_like(args[0]))
    query, kc, vc, bt, lens = args
    empty = kernel.decode_paged(query[:0], kc, vc, bt[:0], lens[:0])
    assert empty.shape == (0, 2, 64)


def test_shuffling_physical_blocks_does_not_change_the_output(kernel, device):
    (query, kc, vc, bt, lens), _ = _inputs([30, 7, 50], 4, 2, 64, 16, device, torch.float32)
    perm = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(9)).to(device)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    # Block b moves to position inverse[b]; the table follows it.
    kc2, vc2 = kc[perm], vc[perm]
    bt2 = inverse[bt.long()].to(torch.int32)
    for splits in (1, 2):
        a = kernel.decode_paged(query, kc, vc, bt, lens, num_splits=splits)
        b = kernel.decode_paged(query, kc2, vc2, bt2, lens, num_splits=splits)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        _close(a, decode_paged_reference(query, kc, vc, bt, lens), torch.float32)


def test_vllm_v1_cache_views(kernel, device):
    """vLLM 0.33's FlashAttention backend: one [num_blocks, num_kv_heads, block_size, 2*head_dim]
    tensor per layer, read as kv_cache.transpose(1, 2).split(head_dim, -1): strided views."""
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, kv_heads, d = 12, 16, 2, 64
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * d, generator=gen).half().to(device)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    assert key_cache.shape == (num_blocks, block_size, kv_heads, d) and not key_cache.is_contiguous()
    query = torch.randn(2, 4, d, generator=gen).half().to(device)
    block_tables = torch.tensor([[7, 2, 11], [0, 5, 3]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([40, 17], dtype=torch.int32, device=device)
    for splits in (1, 2):
        out = kernel.decode_paged(query, key_cache, value_cache, block_tables, seq_lens, num_splits=splits)
        _close(out, decode_paged_reference(query, key_cache.contiguous(), value_cache.contiguous(), block_tables,
                                           seq_lens), torch.float16)


FP8_KV = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("kv_dtype", FP8_KV, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_kv_cache_matches_dequantised_reference(kernel, device, dtype, kv_dtype):
    """fp8 caches with per-tensor scales (tensor or float): equal to attention over the
    dequantised caches, single pass and split, within the query dtype's tolerance."""
    gen = torch.Generator().manual_seed(7)
    args, kw = make_decode_inputs([5, 40, 0, 17], 4, 2, 64, 16, device, dtype, gen, kv_dtype=kv_dtype)
    query, kq, vq, bt, lens = args
    assert kq.dtype == kv_dtype and kw["k_scale"].shape == (1,)
    deq_k = (kq.float() * kw["k_scale"]).to(dtype)
    deq_v = (vq.float() * kw["v_scale"]).to(dtype)
    expected = decode_paged_reference(query, deq_k, deq_v, bt, lens)
    _close(decode_paged_reference(*args, **kw), expected, dtype)
    for splits in (1, 3):
        out = kernel.decode_paged(*args, num_splits=splits, k_scale=kw["k_scale"], v_scale=kw["v_scale"])
        _close(out, expected, dtype)
        floats = kernel.decode_paged(*args, num_splits=splits, k_scale=float(kw["k_scale"]),
                                     v_scale=float(kw["v_scale"]))
        assert torch.equal(out, floats)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # The scales are applied: doubling k_scale sharpens the softmax, doubling v_scale doubles the output.
    twice_v = kernel.decode_paged(*args, k_scale=kw["k_scale"], v_scale=kw["v_scale"] * 2)
    _close(twice_v, 2 * decode_paged_reference(*args, **kw).float(), dtype)


def test_fp8_kv_cache_dispatch_and_opcheck(fresh_graft, kernel, device):
    import graft

    gen = torch.Generator().manual_seed(8)
    args, kw = make_decode_inputs([9, 20], 4, 1, 32, 8, device, torch.float16, gen, kv_dtype=torch.float8_e4m3fn)
    assert graft.select("attention.decode_paged", *args, **kw).backend == "triton"
    _close(attention.decode_paged(*args, **kw), decode_paged_reference(*args, **kw), torch.float16)
    # test_faketensor only: opcheck's schema check compares inputs with a multiply that torch
    # does not implement for fp8 on the CPU (the schema itself is checked by the bf16 opcheck).
    torch.library.opcheck(kernel.decode_op, args + (0.25, 2, kw["k_scale"], kw["v_scale"]),
                          test_utils=("test_faketensor",))


def _fp8_bad(**changes):
    gen = torch.Generator().manual_seed(9)
    (query, kc, vc, bt, lens), kw = make_decode_inputs([5, 19], 4, 2, 16, 8, "cpu", torch.float16, gen,
                                                       kv_dtype=torch.float8_e4m3fn)
    values = dict(query=query, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=lens, **kw)
    values.update({name: fn(values) for name, fn in changes.items()})
    return lambda: attention.decode_paged(**values)


@pytest.mark.parametrize("checks", ["1", "0"])
@pytest.mark.parametrize(
    "call, message",
    [
        (_fp8_bad(k_scale=lambda a: None), "k_scale is required with an fp8 KV cache"),
        (_fp8_bad(v_scale=lambda a: None), "v_scale is required with an fp8 KV cache"),
        (_fp8_bad(k_scale=lambda a: a["k_scale"].half()), "k_scale must be a float or a one-element float32"),
        (_fp8_bad(v_scale=lambda a: a["v_scale"].repeat(2)), "v_scale must be a float or a one-element float32"),
        (_fp8_bad(k_scale=lambda a: "1.0"), "k_scale must be a float or a one-element float32 tensor, got str"),
        (_fp8_bad(value_cache=lambda a: a["value_cache"].to(torch.float8_e5m2)), "needs one dtype for both"),
        (_fp8_bad(value_cache=lambda a: a["value_cache"].half()), "needs one dtype for both"),
        (_fp8_bad(key_cache=lambda a: a["key_cache"].half(), value_cache=lambda a: a["value_cache"].half()),
         "k_scale is given but the caches are torch.float16"),
        (_fp8_bad(key_cache=lambda a: a["key_cache"].view(torch.int8), value_cache=lambda a: a["value_cache"]
                  .view(torch.int8)), "key_cache has dtype int8"),
    ],
)
def test_fp8_kv_validation_errors(fresh_graft, monkeypatch, checks, call, message):
    """Bad combinations are named whatever the value-check setting (metadata only)."""
    monkeypatch.setenv("GRAFT_CHECK_VALUES", checks)
    with pytest.raises(GraftInputError, match=message):
        call()


def test_split_heuristic(kernel, monkeypatch):
    cpu = torch.device("cpu")
    assert kernel.choose_num_splits(64, 8, 4096, cpu) == 1  # nothing to fill on the interpreter
    monkeypatch.setattr(kernel, "_sm_count", lambda device: 132)
    assert kernel.choose_num_splits(1, 8, 32768, cpu) == 33  # 264 programs wanted / 8
    assert kernel.choose_num_splits(1, 8, 300, cpu) == 2  # >= 256 tokens per split
    assert kernel.choose_num_splits(64, 8, 4096, cpu) == 1  # 512 programs already
    assert kernel.choose_num_splits(1, 1, 10 ** 6, cpu) == kernel.MAX_SPLITS


# ----------------------------------------------------------------- dispatch, validation, custom op


def test_dispatch_selects_triton_and_env_forces_torch(fresh_graft, device, monkeypatch):
    import graft

    args, kw = _inputs([5, 19], 4, 2, 64, 16, device, torch.float16)
    assert graft.select("attention.decode_paged", *args, **kw).backend == "triton"
    _close(attention.decode_paged(*args, **kw), decode_paged_reference(*args, **kw), torch.float16)
    monkeypatch.setenv("GRAFT_ATTENTION", "torch")
    assert graft.select("attention.decode_paged", *args, **kw).backend == "torch"
    monkeypatch.delenv("GRAFT_ATTENTION")
    monkeypatch.setenv("GRAFT_ATTENTION_DECODE_PAGED", "torch")
    assert graft.select("attention.decode_paged", *args, **kw).backend == "torch"
    _close(attention.decode_paged(*args, **kw), decode_paged_reference(*args, **kw), torch.float16)


def _bad(**changes):
    (query, kc, vc, bt, lens), _ = _inputs([5, 19], 4, 2, 16, 8, "cpu", torch.float16)
    values = dict(query=query, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=lens)
    values.update({name: fn(values) for name, fn in changes.items()})
    return lambda: attention.decode_paged(**values)


@pytest.mark.parametrize(
    "call, message",
    [
        (_bad(value_cache=lambda a: a["value_cache"].float()), "inputs must share a dtype"),
        (_bad(query=lambda a: a["query"][:, None]), "query must be 3-D"),
        (_bad(key_cache=lambda a: a["key_cache"][0]), "key_cache must be 4-D"),
        (_bad(value_cache=lambda a: a["value_cache"][:-1]), "key_cache and value_cache must have the same shape"),
        (_bad(query=lambda a: a["query"][..., :8]), "head_dim of query \\(8\\) and the caches \\(16\\)"),
        (_bad(query=lambda a: a["query"][:, :3]), "3 heads, not a multiple of num_kv_heads=2"),
        (_bad(block_tables=lambda a: a["block_tables"].long()), "block_tables has dtype int64"),
        (_bad(seq_lens=lambda a: a["seq_lens"].long()), "seq_lens has dtype int64"),
        (_bad(block_tables=lambda a: a["block_tables"][:1]), "both must equal num_seqs=2"),
        (_bad(seq_lens=lambda a: a["seq_lens"] + 100), "seq_lens must lie in \\[0, max_blocks_per_seq"),
        (_bad(seq_lens=lambda a: a["seq_lens"] - 10), "got min -5"),
        (_bad(seq_lens=lambda a: a["seq_lens"].to("meta")), "must be on one device"),
    ],
)
def test_validation_errors(fresh_graft, call, message):
    with pytest.raises(GraftInputError, match=message):
        call()


def test_negative_num_splits_rejected(fresh_graft):
    (query, kc, vc, bt, lens), _ = _inputs([5], 2, 1, 16, 8, "cpu", torch.float32)
    with pytest.raises(GraftInputError, match="num_splits must be >= 0"):
        attention.decode_paged(query, kc, vc, bt, lens, num_splits=-1)


def test_custom_op_opcheck_fake_and_compile(kernel, device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    (query, kc, vc, bt, lens), _ = _inputs([5, 19], 2, 1, 16, 8, device, torch.float32)
    torch.library.opcheck(kernel.decode_op, (query, kc, vc, bt, lens, 0.25, 2),
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(torch.empty(3, 8, 128, dtype=torch.bfloat16))
        fc = mode.from_tensor(torch.empty(10, 16, 2, 128, dtype=torch.bfloat16))
        fbt = mode.from_tensor(torch.zeros(3, 4, dtype=torch.int32))
        out = kernel.decode_op(fq, fc, fc, fbt, mode.from_tensor(torch.zeros(3, dtype=torch.int32)), 0.1, 0)
        assert out.shape == (3, 8, 128) and out.dtype == torch.bfloat16
    fn = torch.compile(lambda *a: kernel.decode_paged(*a, num_splits=2) + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(query, kc, vc, bt, lens), decode_paged_reference(query, kc, vc, bt, lens) + 1,
                               atol=2e-5, rtol=2e-5)
