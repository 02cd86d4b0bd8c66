"""Out-of-range and overflow inputs driven through graft's public ops, one case per run.

Run by tests/test_kernel_safety.py as ``python tests/_safety_cases.py BACKEND [CASE...]`` in a
fresh process with GRAFT_CHECK_VALUES=0 (so nothing stops the values before a kernel) and
TRITON_INTERPRET=1: a kernel that reads or writes out of bounds crashes this process (or
corrupts what it returns) instead of the test run. Each case forces BACKEND for its op
(GRAFT_STRICT=1: no silent fallback), asserts the op was served by it and checks the
result against an expectation built independently of the op's reference where one exists.
Prints ``START case`` then ``PASS case`` or ``FAIL case`` with the reason for each case;
a crash leaves a START without its outcome.
"""
from __future__ import annotations

import math
import os
import sys

import torch


def _use(op: str, backend: str, *args, **kwargs) -> None:
    """Force ``backend`` for ``op`` and check it is what serves these arguments."""
    import graft
    from graft import selection

    os.environ[f"GRAFT_{op.replace('.', '_').upper()}"] = backend
    selection.reset_caches()
    served = graft.select(op, *args, **kwargs).backend
    assert served == backend, f"{op} was served by {served}, not {backend}"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- moe


def case_align_invalid_ids(backend):
    from graft.ops import moe

    ids = torch.tensor([[0, -1], [3, 2], [-1, 7], [2, 1000000], [-5, 0], [1, 3]], dtype=torch.int32)
    num_experts, block_size = 4, 4
    _use("moe.align_block_size", backend, ids, block_size, num_experts)
    sorted_ids, expert_ids, post = moe.align_block_size(ids, block_size, num_experts)
    flat = ids.reshape(-1).tolist()
    valid = [i for i, e in enumerate(flat) if 0 <= e < num_experts]
    total = int(post[0])
    padded = sum(-(-sum(1 for e in flat if e == x) // block_size) * block_size for x in range(num_experts))
    assert total == padded, (total, padded)
    used = sorted_ids[:total].tolist()
    placed = [s for s in used if s != len(flat)]
    assert sorted(placed) == valid, f"placed slots {sorted(placed)} != valid slots {valid}"
    assert all(s == len(flat) for s in sorted_ids[total:].tolist()), "sentinel overwritten past the used part"
    for b, expert in enumerate(expert_ids[: total // block_size].tolist()):
        for s in used[b * block_size:(b + 1) * block_size]:
            assert s == len(flat) or flat[s] == expert, (b, s, expert)
    assert (expert_ids[total // block_size:] == -1).all()
    # Stable order within each expert, as with no invalid ids at all.
    for x in range(num_experts):
        mine = [s for s in placed if flat[s] == x]
        assert mine == sorted(mine)


def case_fused_experts_invalid_ids(backend):
    from graft.ops import moe

    args, _ = moe.make_moe_inputs(6, 4, 2, 32, 16, "cpu", torch.float32, _gen())
    hidden, w13, w2, weights, ids = args
    bad = ids.clone()
    bad[0, 1], bad[2, 0], bad[3, 1], bad[5, 0] = -1, 4, 1 << 30, -7
    _use("moe.fused_experts", backend, hidden, w13, w2, weights, bad)
    out = moe.fused_experts(hidden, w13, w2, weights, bad)
    # Independent expectation: an invalid slot contributes nothing = a valid id with weight 0.
    skip = (bad < 0) | (bad >= 4)
    expected = moe.fused_experts_reference(hidden, w13, w2, torch.where(skip, 0.0, weights),
                                           torch.where(skip, 0, bad).to(torch.int32))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def case_routing_nan_scores(backend):
    from graft.ops import moe

    logits = torch.randn(4, 8, generator=_gen())
    logits[1] = float("nan")  # whole row: every score NaN
    logits[2, 5] = float("nan")  # one NaN logit: softmax is NaN for the whole row
    for scoring in ("softmax", "sigmoid"):
        _use("moe.topk_routing", backend, logits, 3, True, scoring)
        weights, ids = moe.topk_routing(logits, 3, True, scoring)
        assert ((ids >= 0) & (ids < 8)).all(), f"{scoring}: ids out of range: {ids.tolist()}"
        assert ids[1].tolist() == [0, 1, 2], ids[1].tolist()  # NaN ranks first, ties to the lowest id
        assert torch.isnan(weights[1]).all()
        ref_w, ref_i = moe.topk_routing_reference(logits, 3, True, scoring)
        assert torch.equal(ids, ref_i), (ids.tolist(), ref_i.tolist())
        torch.testing.assert_close(weights, ref_w, equal_nan=True)


def case_fused_experts_fp16_overflow(backend):
    from graft.ops import moe

    gen = _gen(3)
    tokens, experts, hidden_size, inter = 5, 2, 32, 16
    # silu(gate) * up ~ 1e5 > fp16's 65504; the second GEMM scales it back to O(100).
    hidden = (torch.rand(tokens, hidden_size, generator=gen) + 0.5).half()
    w13 = (torch.rand(experts, 2 * inter, hidden_size, generator=gen) * 20 + 1).half()
    w2 = (torch.randn(experts, hidden_size, inter, generator=gen) * 1e-3).half()
    ids = torch.tensor([[0, 1]] * tokens, dtype=torch.int32)
    weights = torch.full((tokens, 2), 0.5)
    _use("moe.fused_experts", backend, hidden, w13, w2, weights, ids)
    out = moe.fused_experts(hidden, w13, w2, weights, ids)
    expected = moe.fused_experts_reference(hidden, w13, w2, weights, ids)
    assert torch.isfinite(expected).all()
    assert torch.isfinite(out).all(), f"non-finite output where the reference is finite: {out}"
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=0.5)


# ----------------------------------------------------------------------------- attention


def _decode_inputs(seq_lens, num_blocks=6, block_size=4, max_blocks=4, heads=4, kv_heads=2, dim=64):
    gen = _gen(1)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    return q, k, v, table, torch.tensor(seq_lens, dtype=torch.int32)


def _attend_valid(q, k, v, table, n, scale):
    """One sequence's expected output, built from the valid tokens only (plain softmax)."""
    num_blocks, block_size, kv_heads, dim = k.shape
    keys, values = [], []
    for t in range(n):
        b = int(table[t // block_size])
        if 0 <= b < num_blocks:
            keys.append(k[b, t % block_size])
            values.append(v[b, t % block_size])
    if not keys:
        return torch.zeros_like(q)
    kk, vv = torch.stack(keys), torch.stack(values)  # [n, kvh, d]
    group = q.shape[0] // kv_heads
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, kk) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", p, vv)


def case_decode_bad_block_ids(backend):
    from graft.ops import attention

    q, k, v, table, lens = _decode_inputs([16, 9, 13, 5, 7])
    table[0, 1] = -1
    table[1, 2] = 6  # == num_blocks
    table[2, 0] = 1_000_000
    table[3] = torch.tensor([-3, 2**31 - 1, -(2**31), 0], dtype=torch.int32)  # every used entry bad
    table[4, 3] = -1  # past seq_len 7 (2 blocks of 4): never used
    for splits in (0, 1, 3, 10000):
        _use("attention.decode_paged", backend, q, k, v, table, lens, num_splits=splits)
        out = attention.decode_paged(q, k, v, table, lens, num_splits=splits)
        for s in range(len(lens)):
            expected = _attend_valid(q[s], k, v, table[s], int(lens[s]), 1 / math.sqrt(q.shape[-1]))
            torch.testing.assert_close(out[s], expected, atol=1e-4, rtol=1e-4, msg=f"splits={splits} seq={s}")
    assert (out[3] == 0).all()


def case_decode_bad_seq_lens(backend):
    from graft.ops import attention

    q, k, v, table, lens = _decode_inputs([3, 9])
    lens = torch.tensor([-5, 1_000_000], dtype=torch.int32)  # clamped to [0, 16]
    _use("attention.decode_paged", backend, q, k, v, table, lens)
    out = attention.decode_paged(q, k, v, table, lens)
    assert (out[0] == 0).all()
    expected = _attend_valid(q[1], k, v, table[1], 16, 1 / math.sqrt(q.shape[-1]))
    torch.testing.assert_close(out[1], expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- fused


def case_rotary_bad_positions(backend):
    from graft.ops import fused

    gen = _gen(2)
    max_position, head_size = 32, 64
    cache = fused.cos_sin_cache(max_position, head_size)
    positions = torch.tensor([0, 31, 32, -1, 100_000_000, 5, -(2**62)], dtype=torch.int64)
    q = torch.randn(len(positions), 2 * head_size, generator=gen)
    k = torch.randn(len(positions), head_size, generator=gen)
    for neox in (True, False):
        _use("fused.rotary_embedding", backend, positions, q, k, head_size, cache, neox)
        q_out, k_out = fused.rotary_embedding(positions, q, k, head_size, cache, neox)
        bad = (positions < 0) | (positions >= max_position)
        torch.testing.assert_close(q_out[bad], q[bad], atol=0, rtol=0)  # unrotated, exactly
        torch.testing.assert_close(k_out[bad], k[bad], atol=0, rtol=0)
        good_q, good_k = fused.rotary_embedding(positions[~bad], q[~bad], k[~bad], head_size, cache, neox)
        torch.testing.assert_close(q_out[~bad], good_q)
        torch.testing.assert_close(k_out[~bad], good_k)


# ----------------------------------------------------------------------------- gemm


def case_w4a16_inf_scale(backend):
    from graft import quant
    from graft.ops import gemm

    gen = _gen(4)
    n, k, group = 32, 64, 32
    w = torch.randn(n, k, generator=gen)
    q, zeros, scales = quant.quantize_int4(w, group)
    scales[0, 3] = float("inf")
    scales[1, 5] = float("-inf")
    qweight, qzeros = quant.pack_gptq(q, zeros)
    x = torch.randn(3, k, generator=gen).half()
    s = scales.half()
    _use("gemm.w4a16", backend, x, qweight, s, qzeros, None, group, "gptq")
    out = gemm.w4a16(x, qweight, s, qzeros, None, group, "gptq")
    expected = gemm.w4a16_reference(x, qweight, s, qzeros, None, group, "gptq")
    torch.testing.assert_close(out, expected, equal_nan=True, atol=2e-2, rtol=2e-2)
    assert torch.isnan(expected[:, [3, 5]]).all()  # (q - zero) * inf has 0 * inf = NaN terms
    assert torch.isnan(out[:, [3, 5]]).all(), out[:, [3, 5]]


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    import traceback

    backend, wanted = sys.argv[1], sys.argv[2:] or list(CASES)
    failed = False
    for case in wanted:
        print(f"START {case}", flush=True)
        try:
            CASES[case](backend)
        except AssertionError:
            failed = True
            print(f"FAIL {case}\n{traceback.format_exc()}\nEND {case}", flush=True)
        else:
            print(f"PASS {case}", flush=True)
    sys.exit(1 if failed else 0)
