"""Value checks (OpSpec.check_values) on remembered signatures: with value checks on (the
CPU default) a call whose metadata was seen before skips the metadata checks but still
reads its values, through the C entry and the Python one alike, and rejects a bad value
with the validator's message; scalars the checks take (max_seqlen, num_experts) are matched
by type only, so a new value is checked, not trusted."""
from __future__ import annotations

import pytest
import torch

import graft
from graft import dispatch
from graft.errors import GraftInputError
from graft.ops import attention, fused, loss, moe


def _paged(num_seqs=3, block_size=4, num_blocks=9, max_blocks=3):
    q = torch.randn(num_seqs, 4, 8)
    kc, vc = torch.randn(num_blocks, block_size, 2, 8), torch.randn(num_blocks, block_size, 2, 8)
    table = torch.arange(num_seqs * max_blocks, dtype=torch.int32).reshape(num_seqs, max_blocks) % num_blocks
    return q, kc, vc, table, torch.tensor([5, 9, 12][:num_seqs], dtype=torch.int32)


def _cases():
    """(op, good call, [(bad call, message)]): every bad call has the good call's metadata."""
    q, kc, vc, table, lens = _paged()
    bad_table = table.clone()
    bad_table[1, 2] = 99  # a page sequence 1 uses (9 tokens: 3 pages of 4)
    stale = table.clone()
    stale[0, 2] = 99  # a page sequence 0 (5 tokens: 2 pages) does not use: not an error
    yield ("attention.decode_paged", lambda: attention.decode_paged(q, kc, vc, table, lens),
           [(lambda: attention.decode_paged(q, kc, vc, bad_table, lens), "block_tables entries within seq_lens"),
            (lambda: attention.decode_paged(q, kc, vc, table, torch.tensor([5, 9, 13], dtype=torch.int32)),
             "seq_lens must lie in")],
           [lambda: attention.decode_paged(q, kc, vc, stale, lens)])

    qp = torch.randn(6, 4, 8)
    cu = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    yield ("attention.prefill_paged", lambda: attention.prefill_paged(qp, kc, vc, table, cu, lens, 3, True),
           [(lambda: attention.prefill_paged(qp, kc, vc, table, cu, lens, 2, True), "max_seqlen given"),
            (lambda: attention.prefill_paged(qp, kc, vc, table, cu, torch.tensor([5, 1, 12], dtype=torch.int32), 3,
                                             True), "seq_len >= seqlen_q"),
            (lambda: attention.prefill_paged(qp, kc, vc, table, torch.tensor([0, 3, 1, 6], dtype=torch.int32), lens,
                                             3, True), "non-decreasing"),
            (lambda: attention.prefill_paged(qp, kc, vc, table, cu, lens, -1, True), "max_seqlen_q must be >= 0")],
           [lambda: attention.prefill_paged(qp, kc, vc, table, cu, lens, 5, True)])

    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    yield ("attention.prefill", lambda: attention.prefill(qp, k, v, cu, cu, 3, 3, causal=True),
           [(lambda: attention.prefill(qp, k, v, cu, cu, 2, 3, causal=True), "max_seqlen given for cu_seqlens_q"),
            (lambda: attention.prefill(qp, k, v, cu, torch.tensor([0, 1, 3, 7], dtype=torch.int32), 3, 3, causal=True),
             "exceeds the number of packed tokens"),
            (lambda: attention.prefill(qp, k, v, cu, cu, 3, -4, causal=True), "must be >= 0")],
           [lambda: attention.prefill(qp, k, v, cu, cu, 4, 9, causal=True)])

    cache = fused.cos_sin_cache(16, 8)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    yield ("fused.rotary_embedding", lambda: fused.rotary_embedding(torch.tensor([1, 2]), x, y, 8, cache),
           [(lambda: fused.rotary_embedding(torch.tensor([-1, 2]), x, y, 8, cache), "positions must lie in")], [])

    h, w13, w2 = torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    weights, ids = torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int32)
    yield ("moe.fused_experts", lambda: moe.fused_experts(h, w13, w2, weights, ids),
           [(lambda: moe.fused_experts(h, w13, w2, weights, torch.tensor([[0, 1], [2, 4], [1, 1]], dtype=torch.int32)),
             "topk_ids must lie in")], [])
    yield ("moe.align_block_size", lambda: moe.align_block_size(ids, 4, 4),
           [(lambda: moe.align_block_size(ids, 4, 3), r"must lie in \[0, 3\)"),
            (lambda: moe.align_block_size(ids, 4, 0), "num_experts must be a positive int"),
            (lambda: moe.align_block_size(ids, 2**30, 4), "at most 2\\*\\*31 - 1")],
           [lambda: moe.align_block_size(ids, 8, 5)])

    xs, wv, target = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, -100, 9, 0])
    yield ("loss.fused_linear_cross_entropy", lambda: loss.fused_linear_cross_entropy(xs, wv, target),
           [(lambda: loss.fused_linear_cross_entropy(xs, wv, torch.tensor([1, -100, 10, 0])), "targets must lie in"),
            (lambda: loss.fused_linear_cross_entropy(xs, wv, target, None, 3), "targets must lie in")],
           [lambda: loss.fused_linear_cross_entropy(xs, wv, torch.tensor([1, 5, -7, 0]), ignore_index=-7)])


CASES = list(_cases())


def test_every_op_that_reads_values_has_its_checks_apart():
    """An op whose validator reads values (can_read_values) has OpSpec.check_values: else a
    CPU call with value checks on would validate in full every time."""
    ops = graft.get_registry().ops
    readers = {name for name, spec in ops.items() if spec.check_values is not None}
    assert {c[0] for c in CASES} <= readers
    assert readers >= {"attention.decode_paged", "attention.prefill", "attention.prefill_paged",
                       "fused.rotary_embedding", "moe.align_block_size", "moe.fused_experts",
                       "moe.fused_experts_fp8", "loss.fused_linear_cross_entropy"}


@pytest.mark.parametrize("entry", ["c", "python"])
@pytest.mark.parametrize("op,good,bad_calls,good_calls", CASES, ids=[c[0] for c in CASES])
def test_remembered_signature_still_checks_values(fresh_graft, monkeypatch, op, good, bad_calls, good_calls, entry):
    # graft's torch backend alone: one unconditional implementation, which the C entry serves
    # (with Triton's interpreter, its kernels' run-time checks keep every call in Python).
    monkeypatch.setenv("GRAFT_BACKENDS", "torch")
    graft.reload_config()
    if entry == "python":  # the Python hit functions (where no C compiler built graft/_fastcall.c)
        monkeypatch.setattr(dispatch, "_fastcall", None)
        monkeypatch.setattr(dispatch, "call", dispatch._python_call)
        monkeypatch.setattr(dispatch, "run", dispatch._python_run)
        for module in (attention, fused, loss, moe):
            if getattr(module, "call", None) is not None:
                monkeypatch.setattr(module, "call", dispatch._python_call)
    expected = good()
    good()
    state = dispatch._ops[op]
    assert len(state.hits) == 1, "with value checks on the signature is remembered"
    plan = next(iter(state.plans.values()))
    assert plan.values and plan.keep
    if entry == "c" and dispatch._fastcall is not None:
        assert len(dispatch._fast_hits.get(op, ())) == 1
    # The hit skips the validator: only the value checks run.
    calls = []
    validate = state.validate
    monkeypatch.setattr(state, "validate", lambda *a, **k: (calls.append(1), validate(*a, **k))[1])
    torch.testing.assert_close(good(), expected)
    assert not calls
    for bad, message in bad_calls:
        with pytest.raises(GraftInputError, match=message):
            bad()
    for other in good_calls:
        other()
    with graft.override_config(GRAFT_CHECK_VALUES="0"):
        good()
        good()
        plan = next(iter(dispatch._ops[op].plans.values()))
        assert not plan.values and plan.keep


def test_values_and_metadata_errors_agree_with_the_validator(fresh_graft):
    """The first call (full validator) and a remembered signature (value checks only) reject
    a bad value with the same message."""
    q, kc, vc, table, lens = _paged()
    bad_table = table.clone()
    bad_table[2, 2] = -3
    with pytest.raises(GraftInputError) as first:
        attention.decode_paged(q, kc, vc, bad_table, lens)
    attention.decode_paged(q, kc, vc, table, lens)
    attention.decode_paged(q, kc, vc, table, lens)
    with pytest.raises(GraftInputError) as remembered:
        attention.decode_paged(q, kc, vc, bad_table, lens)
    assert str(first.value) == str(remembered.value)
    assert "got -3" in str(first.value)


def test_index_bounds_and_steps_read_in_c_agree_with_torch():
    from graft.ops._validate import int_steps, readable_bounds

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.int32, torch.int64):
        t = torch.randint(-50, 2**20, (7, 13), generator=gen, dtype=dtype)
        assert readable_bounds(t) == (int(t.min()), int(t.max()))
        assert readable_bounds(t.t()) == (int(t.min()), int(t.max()))  # non-contiguous: through torch
        cu = torch.tensor([0, 4, 4, 11, 30], dtype=dtype)
        assert int_steps(cu) == (0, 30, 0, 19)
    assert readable_bounds(torch.tensor([2**40, -(2**40)])) == (-(2**40), 2**40)
    assert int_steps(torch.tensor([7], dtype=torch.int32)) == (7, 7, 0, 0)
    assert readable_bounds(torch.tensor([], dtype=torch.int32)) is None  # empty: nothing to read
    assert int_steps(torch.tensor([0, 1, 2])[::2]) is None  # not contiguous: the caller reads a list
    assert int_steps(torch.tensor([0.0, 1.0])) is None
    with graft.config.override(GRAFT_CHECK_VALUES="0"):
        assert readable_bounds(torch.tensor([1, 2])) is None  # value checks off: no read at all


def test_prefill_paged_checks_each_sequence_when_a_context_is_shorter_than_the_longest_query():
    q, kc, vc, table, _ = _paged()
    qp = torch.randn(6, 4, 8)
    cu = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    # Sequence 0 has 1 query token and 1 token of context: fine, although 1 < 3 (longest query).
    out = attention.prefill_paged(qp, kc, vc, table, cu, torch.tensor([1, 9, 12], dtype=torch.int32), 3, True)
    assert out.shape == qp.shape
    with pytest.raises(GraftInputError, match=r"sequence 2 has 3 query tokens but seq_lens\[2\] = 2"):
        attention.prefill_paged(qp, kc, vc, table, cu, torch.tensor([1, 9, 2], dtype=torch.int32), 3, True)
    # Non-contiguous metadata takes the list path and gives the same errors.
    strided = torch.tensor([0, 9, 3, 0, 1, 0, 6], dtype=torch.int32)[::2]
    with pytest.raises(GraftInputError, match="non-decreasing"):
        attention.prefill_paged(qp, kc, vc, table, strided, torch.tensor([1, 9, 12], dtype=torch.int32)[::1], 3, True)
