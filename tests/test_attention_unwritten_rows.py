"""The Triton prefill kernels allocate their output empty: every row is written by the kernel,
by the program of the sequence that covers it or, for rows no sequence's program writes
(cu_seqlens the value checks would refuse, an understated max_seqlen_q), as zeros by the
grid's extra sequence (``zero_unwritten_rows``). The allocation is filled with NaN here, so a
row the kernel forgot shows up, instead of passing on memory that happened to be zero."""
import pytest
import torch

import graft
from graft.ops.attention import make_prefill_inputs, make_prefill_paged_inputs, prefill_paged_reference, prefill_reference

# Interpreter tiles are 16 rows (attention_prefill.TILES["interpreter"]).
BLOCK_M = 16


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty hands out NaN-filled floating tensors during the test."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", empty)


def _expected(reference, cu_q, max_q, total_q):
    """The reference, with the rows past the grid's reach (an understated max_seqlen_q) zero:
    the kernel's grid is sized by max_seqlen_q, as FlashAttention's is, so those rows are its
    defined zeros, not computed."""
    out = reference.clone()
    span = -(-min(max_q, total_q) // BLOCK_M) * BLOCK_M
    bounds = cu_q.tolist()
    for b in range(len(bounds) - 1):
        start = min(max(bounds[b], 0), total_q)
        end = min(max(bounds[b + 1], start), total_q)
        out[start + min(end - start, span):end] = 0
    return out


# (cu_seqlens_q over 24 packed rows, max_seqlen_q, what it exercises)
HOSTILE = [
    pytest.param([0, 7, 24], 17, id="valid"),
    pytest.param([3, 9, 20], 11, id="rows_before_first_and_after_last"),
    pytest.param([0, 15, 6, 24], 18, id="decreasing"),
    pytest.param([0, 5, 400], 400, id="past_the_end"),
    pytest.param([-4, 10, 24], 14, id="negative_start"),
    pytest.param([0, 24, 24], 5, id="understated_max_seqlen"),
    pytest.param([0, 0, 0], 0, id="no_rows_at_all"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cu, max_q", HOSTILE)
def test_prefill_writes_every_row(nan_empty, cu, max_q, causal):
    from graft.kernels.triton import attention_prefill

    (q, k, v, _, cu_k, _, max_k), _ = make_prefill_inputs([12, 12], [12, 12], 2, 1, 16, causal, "cpu",
                                                          torch.float32, torch.Generator().manual_seed(1))
    cu_q = torch.tensor(cu, dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 24, 24][:len(cu)], dtype=torch.int32)
    with graft.override_config(GRAFT_CHECK_VALUES="0"):
        got = attention_prefill.prefill(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    want = _expected(prefill_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal), cu_q, max_q, 24)
    assert not got.isnan().any(), "rows the kernel left unwritten"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cu, max_q", HOSTILE)
def test_prefill_paged_writes_every_row(nan_empty, cu, max_q):
    from graft.kernels.triton import attention_prefill_paged

    (q, kc, vc, bt, _, _, _), kw = make_prefill_paged_inputs([12, 12, 0], [5, 9, 3], 2, 1, 16, 8, True, "cpu",
                                                             torch.float32, torch.Generator().manual_seed(2))
    cu_q = torch.tensor(cu, dtype=torch.int32)
    bt, seq_lens = bt[:len(cu) - 1], torch.tensor([17, 21, 3][:len(cu) - 1], dtype=torch.int32)
    with graft.override_config(GRAFT_CHECK_VALUES="0"):
        got = attention_prefill_paged.prefill_paged(q, kc, vc, bt, cu_q, seq_lens, max_q, **kw)
    want = _expected(prefill_paged_reference(q, kc, vc, bt, cu_q, seq_lens, max_q, **kw), cu_q, max_q, 24)
    assert not got.isnan().any(), "rows the kernel left unwritten"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_many_sequences_span_several_cu_seqlens_chunks(nan_empty):
    """More sequences than one 64-wide chunk of cu_seqlens: the well-formedness pass and the
    zeroing pass both walk every chunk (a gap in the second chunk is found and zeroed)."""
    from graft.kernels.triton import attention_prefill

    lens = [1] * 150
    (q, k, v, cu_q, cu_k, max_q, max_k), _ = make_prefill_inputs(lens, lens, 2, 2, 16, False, "cpu", torch.float32,
                                                                 torch.Generator().manual_seed(3))
    for hole in (None, 100):
        cu = cu_q.clone()
        if hole is not None:
            cu[hole + 1:] -= 1  # sequence `hole` is empty, and row 149 is no sequence's
        got = attention_prefill.prefill(q, k, v, cu, cu_k, max_q, max_k)
        want = prefill_reference(q, k, v, cu, cu_k, max_q, max_k)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        if hole is not None:
            assert torch.equal(got[149], torch.zeros_like(got[149]))
