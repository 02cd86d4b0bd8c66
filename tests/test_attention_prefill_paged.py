"""attention.prefill_paged: the torch reference against attention.prefill over the context
read back token by token, the Triton kernel (interpreted) against the reference (odd block
sizes, zero context, empty queries and batch, vLLM's strided cache views, hostile block
tables and lengths with the value checks off; its 64-bit offsets are checked in
tests/test_kernel_safety.py), dispatch, validation and the custom op."""
import pytest
import torch

import graft
from graft.errors import GraftInputError
from graft.ops import attention
from graft.ops.attention import make_prefill_paged_inputs, prefill_paged_reference, prefill_reference

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}


def _close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _inputs(seqlens_q, context, heads, kv_heads, head_dim, block_size, dtype, causal=True, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return make_prefill_paged_inputs(seqlens_q, context, heads, kv_heads, head_dim, block_size, causal, device, dtype,
                                     gen)


def _gathered(key_cache, value_cache, block_tables, seq_lens):
    """The contexts read token by token into packed K/V with their cu_seqlens (the gather vLLM did)."""
    bs = key_cache.shape[1]
    ks, vs, cu = [], [], [0]
    for s, n in enumerate(seq_lens.tolist()):
        for t in range(n):
            b = int(block_tables[s, t // bs])
            ks.append(key_cache[b, t % bs])
            vs.append(value_cache[b, t % bs])
        cu.append(cu[-1] + n)
    empty = key_cache[:0, 0]
    k = torch.stack(ks) if ks else empty
    v = torch.stack(vs) if vs else empty
    return k, v, torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_equals_prefill_over_the_gathered_context(causal):
    (q, kc, vc, bt, cu_q, lens, max_q), _ = _inputs([3, 0, 11, 1], [17, 4, 0, 60], 4, 2, 32, 5, torch.float32,
                                                    causal)
    out = prefill_paged_reference(q, kc, vc, bt, cu_q, lens, max_q, causal=causal, softmax_scale=0.3)
    k, v, cu_k = _gathered(kc, vc, bt, lens)
    want = prefill_reference(q, k, v, cu_q, cu_k, max_q, int(lens.max()), causal=causal, softmax_scale=0.3)
    torch.testing.assert_close(out, want)


def test_reference_skips_tokens_of_invalid_table_entries():
    (q, kc, vc, bt, cu_q, lens, max_q), kw = _inputs([4], [8], 2, 1, 16, 4, torch.float32)
    bad = bt.clone()
    bad[0, 1] = -1  # tokens 4..7 of the context: skipped
    out = prefill_paged_reference(q, kc, vc, bad, cu_q, lens, max_q, **kw)
    keep = torch.tensor([t // 4 != 1 for t in range(12)])
    k, v, _ = _gathered(kc, vc, bt, lens)
    k, v = k[keep], v[keep]
    # Query i (position 8 + i) sees the kept keys at positions <= 8 + i.
    pos = torch.arange(12)[keep]
    for i in range(4):
        visible = pos <= 8 + i
        n = int(visible.sum())
        row = prefill_reference(q[i : i + 1], k[:n], v[:n], torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([0, n], dtype=torch.int32), 1, n, causal=False)
        torch.testing.assert_close(out[i : i + 1], row)


# ----------------------------------------------------------------- Triton kernel vs reference


@pytest.fixture(scope="module")
def kernel():
    from graft.kernels.triton import attention_prefill_paged

    return attention_prefill_paged


# (query lens, context lens, heads, kv heads, head dim, block size): block sizes that do not
# divide the lengths, zero context, an empty query, MQA, a head dim that is not a power of two.
MATRIX = [
    pytest.param([1, 7, 20], [0, 33, 5], 4, 2, 64, 16, id="gqa2_d64_bs16"),
    pytest.param([3, 0, 11, 1], [17, 4, 2, 60], 4, 1, 128, 8, id="mqa4_d128_bs8_empty_q"),
    pytest.param([9, 17], [0, 0], 2, 2, 64, 5, id="mha_zero_context_bs5"),
    pytest.param([40], [3], 2, 1, 80, 7, id="d80_bs7"),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlens_q, context, heads, kv_heads, head_dim, block_size", MATRIX)
def test_kernel_matches_reference(kernel, device, seqlens_q, context, heads, kv_heads, head_dim, block_size, causal):
    for dtype in (torch.float32, torch.float16):
        args, kw = _inputs(seqlens_q, context, heads, kv_heads, head_dim, block_size, dtype, causal, device=device)
        _close(kernel.prefill_paged(*args, **kw), prefill_paged_reference(*args, **kw), dtype)


def test_kernel_bf16(kernel, device):
    args, kw = _inputs([5, 12], [30, 3], 4, 2, 64, 16, torch.bfloat16, device=device)
    _close(kernel.prefill_paged(*args, **kw), prefill_paged_reference(*args, **kw), torch.bfloat16)


def test_kernel_empty_batch_and_zero_queries(kernel, device):
    args, kw = _inputs([], [], 2, 1, 64, 16, torch.float32, device=device)
    out = kernel.prefill_paged(*args, **kw)
    assert out.shape == (0, 2, 64)
    args, kw = _inputs([0, 0], [5, 9], 2, 1, 64, 16, torch.float32, device=device)
    assert kernel.prefill_paged(*args, **kw).shape == (0, 2, 64)


def test_kernel_reads_vllm_strided_cache_views(kernel, device):
    """vLLM 0.33's per-layer [num_blocks, kv_heads, block_size, 2 * head] cache, split into views."""
    (q, kc, vc, bt, cu_q, lens, max_q), kw = _inputs([6, 13], [10, 21], 4, 2, 32, 8, torch.float32, device=device)
    kv = torch.cat([kc, vc], dim=-1).transpose(1, 2).contiguous()  # [NB, KVH, BS, 2D]
    key_view, value_view = kv.transpose(1, 2).split(32, dim=-1)
    assert not key_view.is_contiguous()
    q_view = torch.randn(q.shape[0], 3 * 4, 32, device=device)[:, 4:8]  # q sliced out of a wider projection
    q_view.copy_(q)
    out = kernel.prefill_paged(q_view, key_view, value_view, bt, cu_q, lens, max_q, **kw)
    _close(out, prefill_paged_reference(q, kc, vc, bt, cu_q, lens, max_q, **kw), torch.float32)


def test_kernel_hostile_tables_and_lengths_match_reference(kernel, device):
    """With the value checks off nothing is read out of bounds and the reference's result comes out:
    table entries -1 / past num_blocks skipped, seq_lens past the capacity or negative clamped."""
    (q, kc, vc, bt, cu_q, lens, max_q), kw = _inputs([4, 9, 3], [12, 0, 30], 4, 2, 16, 4, torch.float32,
                                                     device=device)
    num_blocks = kc.shape[0]
    cases = []
    table = bt.clone()
    table[0, 1], table[2, 0], table[2, 5] = -1, num_blocks, 2**31 - 1
    cases.append((table, lens))
    cases.append((torch.full_like(bt, -7), lens))  # no valid block: zero rows
    cases.append((bt, torch.tensor([1000, -5, 33], dtype=torch.int32, device=device)))  # clamped into [0, capacity]
    cases.append((bt, torch.tensor([2, 9, 1], dtype=torch.int32, device=device)))  # fewer keys than queries
    with graft.override_config(GRAFT_CHECK_VALUES="0"):
        for table, seq_lens in cases:
            got = kernel.prefill_paged(q, kc, vc, table, cu_q, seq_lens, max_q, **kw)
            want = prefill_paged_reference(q, kc, vc, table, cu_q, seq_lens, max_q, **kw)
            _close(got, want, torch.float32)
            assert torch.isfinite(got).all()


# ----------------------------------------------------------------- dispatch, validation, custom op


def test_dispatch_selects_triton_then_reference(fresh_graft, device):
    args, kw = _inputs([5, 12], [30, 3], 4, 2, 64, 16, torch.float16, device=device)
    with graft.override_config(GRAFT_ATTENTION_PREFILL_PAGED="triton"):
        assert graft.select("attention.prefill_paged", *args, **kw).backend == "triton"
        _close(attention.prefill_paged(*args, **kw), prefill_paged_reference(*args, **kw), torch.float16)
    with graft.override_config(GRAFT_ATTENTION_PREFILL_PAGED="torch"):
        assert graft.select("attention.prefill_paged", *args, **kw).backend == "torch"


def _bad(**changes):
    (q, kc, vc, bt, cu_q, lens, max_q), _ = _inputs([3, 6], [7, 0], 4, 2, 16, 8, torch.float16)
    values = dict(q=q, key_cache=kc, value_cache=vc, block_tables=bt, cu_seqlens_q=cu_q, seq_lens=lens,
                  max_seqlen_q=max_q)
    values.update({name: fn(values) for name, fn in changes.items()})
    return lambda: attention.prefill_paged(**values, causal=True)


@pytest.mark.parametrize(
    "call, message",
    [
        (_bad(value_cache=lambda a: a["value_cache"].float()), "inputs must share a dtype"),
        (_bad(q=lambda a: a["q"][:, None]), "q must be 3-D"),
        (_bad(key_cache=lambda a: a["key_cache"][0]), "key_cache must be 4-D"),
        (_bad(value_cache=lambda a: a["value_cache"][:-1]), "key_cache and value_cache must have the same shape"),
        (_bad(q=lambda a: a["q"][..., :8]), "head_dim of q \\(8\\) and the caches \\(16\\)"),
        (_bad(q=lambda a: a["q"][:, :3]), "3 heads, not a multiple of num_kv_heads=2"),
        (_bad(block_tables=lambda a: a["block_tables"].long()), "block_tables has dtype int64"),
        (_bad(cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()), "cu_seqlens_q has dtype int64"),
        (_bad(block_tables=lambda a: a["block_tables"][:1]), "both must equal num_seqs=2"),
        (_bad(seq_lens=lambda a: a["seq_lens"][:1]), "both must equal num_seqs=2"),
        (_bad(seq_lens=lambda a: a["seq_lens"] + 100), "seq_lens must lie in \\[0, max_blocks_per_seq"),
        (_bad(seq_lens=lambda a: torch.tensor([2, 6], dtype=torch.int32)), "sequence 0 has 3 query tokens but"),
        (_bad(block_tables=lambda a: a["block_tables"] - 100), "block_tables entries within seq_lens must lie in"),
        (_bad(cu_seqlens_q=lambda a: torch.tensor([0, 3, 8], dtype=torch.int32)), "must equal the number of packed"),
        (_bad(max_seqlen_q=lambda a: 4), "a sequence has 6 tokens but the max_seqlen given"),
        (_bad(max_seqlen_q=lambda a: -1), "max_seqlen_q must be >= 0"),
        (_bad(seq_lens=lambda a: a["seq_lens"].to("meta")), "must be on one device"),
    ],
)
def test_validation_errors(fresh_graft, call, message):
    with pytest.raises(GraftInputError, match=message):
        call()


def test_no_backward_registered(kernel):
    from graft.custom_ops import _WITH_BACKWARD, _qualname

    assert _qualname(kernel.prefill_paged_op) not in _WITH_BACKWARD  # forward only: an inference path


def test_custom_op_opcheck_fake_and_compile(kernel, device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    (q, kc, vc, bt, cu_q, lens, max_q), _ = _inputs([3, 6], [7, 0], 2, 1, 16, 8, torch.float32, device=device)
    torch.library.opcheck(kernel.prefill_paged_op, (q, kc, vc, bt, cu_q, lens, max_q, True, 0.25),
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(torch.empty(9, 8, 128, dtype=torch.bfloat16))
        fc = mode.from_tensor(torch.empty(10, 16, 2, 128, dtype=torch.bfloat16))
        out = kernel.prefill_paged_op(fq, fc, fc, mode.from_tensor(torch.zeros(2, 4, dtype=torch.int32)),
                                      mode.from_tensor(torch.zeros(3, dtype=torch.int32)),
                                      mode.from_tensor(torch.zeros(2, dtype=torch.int32)), 6, True, 0.1)
        assert out.shape == (9, 8, 128) and out.dtype == torch.bfloat16
    fn = torch.compile(lambda *a: kernel.prefill_paged(*a, causal=True) + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(q, kc, vc, bt, cu_q, lens, max_q),
                               prefill_paged_reference(q, kc, vc, bt, cu_q, lens, max_q, causal=True) + 1,
                               atol=2e-5, rtol=2e-5)


def test_torch_backend_gathers_then_runs_sdpa_and_matches_the_reference():
    """The torch backend (gather + SDPA, as fast as the framework's own gather path) agrees
    with the reference on every case, and hostile lengths/block ids take the reference."""
    import graft
    from graft.kernels.torch import attention as TA
    from graft.ops import attention as A

    impls = {i.provider: i for i in graft.get_registry().impls["attention.prefill_paged"] if i.backend == "torch"}
    assert impls["graft"].fn is TA.prefill_paged_torch and impls["graft"].priority > impls["torch"].priority
    for case in A.CASES:
        if case.op != "attention.prefill_paged" or "quick" not in case.tags:
            continue
        for dtype in case.dtypes:
            args, kwargs = case.inputs("cpu", dtype)
            want = A.prefill_paged_reference(*args, **kwargs)
            got = TA.prefill_paged_torch(*args, **kwargs)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=f"{case.name} {dtype}")
            if args[4].numel() > 1 and args[5].numel():  # a hostile block id: the reference's answer
                tables = args[3].clone()
                tables[0, 0] = args[1].shape[0] + 7
                bad = (args[0], args[1], args[2], tables, *args[4:])
                torch.testing.assert_close(TA.prefill_paged_torch(*bad, **kwargs),
                                           A.prefill_paged_reference(*bad, **kwargs), atol=0, rtol=0)
