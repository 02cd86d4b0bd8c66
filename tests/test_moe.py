"""moe.* ops: references against independent formulations, Triton kernels (interpreter on the
CPU) against the references over shape/dtype matrices incl. odd sizes, empty batches and
experts without tokens, input validation, dispatch, and the custom ops' fake impls."""
import pytest
import torch

from graft.errors import GraftInputError
from graft.ops import moe

TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2), torch.float32: (2e-5, 2e-5)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rms_close(actual, expected, dtype):
    """|a - e| <= atol * rms(e) + rtol * |e|: bf16/fp16 bounds relative to the output scale."""
    atol, rtol = TOL[dtype]
    expected = expected.float()
    scale = expected.pow(2).mean().sqrt().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected, atol=atol * max(scale, 1e-6), rtol=rtol)


@pytest.fixture(scope="module")
def kernels():
    from graft.kernels.triton import moe_align_block_size, moe_fused_experts, moe_topk_routing

    return moe_topk_routing, moe_align_block_size, moe_fused_experts


# ----------------------------------------------------------------- references, from first principles


def test_routing_reference_matches_topk_of_softmax():
    logits = moe._distinct_logits(6, 7, _gen(), "cpu", torch.float32)
    w, ids = moe.topk_routing_reference(logits, 3, False)
    probs = torch.softmax(logits.double(), -1)
    top = torch.topk(probs, 3, dim=-1)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), top.indices)
    torch.testing.assert_close(w.double(), top.values)
    w_renorm, _ = moe.topk_routing_reference(logits, 3, True)
    torch.testing.assert_close(w_renorm.sum(-1), torch.ones(6))


def test_routing_reference_ties_pick_lowest_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    _, ids = moe.topk_routing_reference(logits, 2, True)
    assert ids.tolist() == [[1, 2]]


def test_align_reference_matches_worked_example():
    # 4 tokens x 3 slots over experts 0..3, each expert receives 3 slots, block size 4.
    ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, post_pad = moe.align_block_size_reference(ids, 4, 4)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert sorted_ids.numel() == 12 + 4 * 3 and (sorted_ids[16:] == 12).all()
    assert expert_ids.tolist() == [0, 1, 2, 3, -1, -1]
    assert post_pad.tolist() == [16]


def test_fused_experts_reference_matches_per_token_loop():
    (hidden, w13, w2, weights, ids), _ = moe.make_moe_inputs(5, 4, 2, 12, 6, "cpu", torch.float32, _gen())
    out = moe.fused_experts_reference(hidden, w13, w2, weights, ids)
    hidden, w13, w2, weights = (t.double() for t in (hidden, w13, w2, weights))
    expected = torch.zeros_like(hidden)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ hidden[t]).split(6)
            expected[t] += weights[t, j] * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)  # the reference accumulates in fp32


# ----------------------------------------------------------------- routing kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("experts,top_k", [(5, 1), (5, 2), (5, 5), (7, 2), (7, 4), (8, 1), (8, 4), (8, 8)])
def test_triton_routing(kernels, device, experts, top_k, renormalize, scoring, dtype):
    logits = moe._distinct_logits(37, experts, _gen(experts * 10 + top_k), device, dtype)
    w, ids = kernels[0].topk_routing_triton(logits, top_k, renormalize, scoring)
    rw, rids = moe.topk_routing_reference(logits, top_k, renormalize, scoring)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == (37, top_k)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


def test_triton_routing_ties_and_empty(kernels, device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=device)
    _, ids = kernels[0].topk_routing_triton(logits, 3, True, "softmax")
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    w, ids = kernels[0].topk_routing_triton(logits[:0], 2, True, "softmax")
    assert w.shape == (0, 2) and ids.shape == (0, 2)


# ----------------------------------------------------------------- align kernel


def _check_align_properties(ids, block_size, num_experts, sorted_ids, expert_ids, post_pad):
    flat = ids.reshape(-1).cpu()
    num_slots = flat.numel()
    total = int(post_pad)
    assert total % block_size == 0
    assert sorted_ids.numel() == num_slots + num_experts * (block_size - 1)
    sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
    used = sorted_ids[:total]
    real = used[used < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))  # every (token, slot) exactly once
    assert ((used == num_slots) | (used < num_slots)).all() and (sorted_ids[total:] == num_slots).all()
    for b in range(total // block_size):
        block = used[b * block_size:(b + 1) * block_size]
        members = block[block < num_slots]
        assert members.numel() > 0, "no block is pure padding"
        assert (flat[members.long()] == expert_ids[b]).all(), "each block holds a single expert"
        assert torch.equal(members, members.sort().values), "stable order within an expert"
    assert (expert_ids[total // block_size:] == -1).all()
    counts = torch.bincount(flat.long(), minlength=num_experts)
    assert total == int(((counts + block_size - 1) // block_size * block_size).sum())


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "tokens,experts,top_k,skip",
    [(1, 4, 1, None), (1, 8, 2, 0), (3, 5, 2, 4), (17, 8, 2, 3), (64, 7, 4, None), (300, 8, 2, 6), (0, 4, 2, None)],
)
def test_triton_align(kernels, device, tokens, experts, top_k, skip, block_size):
    ids = moe.random_topk_ids(tokens, experts, top_k, _gen(tokens + experts), skip).to(device)
    got = kernels[1].align_block_size_triton(ids, block_size, experts)
    expected = moe.align_block_size_reference(ids, block_size, experts)
    _check_align_properties(ids, block_size, experts, *expected)
    for g, e in zip(got, expected):
        assert g.dtype == torch.int32
        assert torch.equal(g, e)


def test_triton_align_many_chunks_and_wide_router(kernels, device):
    # More slots than one chunk holds (several count/scatter programs), and 300 experts.
    for tokens, experts, top_k in [(2500, 6, 2), (40, 300, 3)]:
        ids = moe.random_topk_ids(tokens, experts, top_k, _gen(7), None).to(device)
        got = kernels[1].align_block_size_triton(ids, 16, experts)
        for g, e in zip(got, moe.align_block_size_reference(ids, 16, experts)):
            assert torch.equal(g, e)


# ----------------------------------------------------------------- fused experts kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 48, 40), (3, 96, 40), (17, 48, 96)])
def test_triton_fused_experts(kernels, device, tokens, hidden, inter, experts, top_k, dtype):
    # Expert 1 never receives a token.
    args, _ = moe.make_moe_inputs(tokens, experts, top_k, hidden, inter, device, dtype, _gen(tokens), skip_expert=1)
    out = kernels[2].fused_experts_triton(*args, "silu")
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    _rms_close(out, moe.fused_experts_reference(*args), dtype)


def test_triton_fused_experts_empty_and_strided(kernels, device):
    args, _ = moe.make_moe_inputs(0, 4, 2, 48, 40, device, torch.float16, _gen())
    assert kernels[2].fused_experts_triton(*args, "silu").shape == (0, 48)
    # Non-contiguous hidden / w13 (a transposed view) and duplicated experts within a token.
    hidden, w13, w2, weights, ids = moe.make_moe_inputs(9, 4, 2, 48, 40, device, torch.float32, _gen(3))[0]
    hidden_t = hidden.t().contiguous().t()
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    ids[0] = torch.tensor([2, 2], dtype=torch.int32)
    out = kernels[2].fused_experts_triton(hidden_t, w13_t, w2, weights, ids, "silu")
    _rms_close(out, moe.fused_experts_reference(hidden, w13, w2, weights, ids), torch.float32)


def test_triton_fused_experts_is_deterministic(kernels, device):
    args, _ = moe.make_moe_inputs(17, 4, 2, 48, 40, device, torch.bfloat16, _gen(5))
    first = kernels[2].fused_experts_triton(*args, "silu")
    assert torch.equal(first, kernels[2].fused_experts_triton(*args, "silu"))


def test_full_layer_through_dispatch(fresh_graft, device):
    hidden, w13, w2, _, _ = moe.make_moe_inputs(11, 8, 2, 48, 40, device, torch.float32, _gen(9))[0]
    logits = moe._distinct_logits(11, 8, _gen(10), device, torch.float32)
    weights, ids = moe.topk_routing(logits, 2, True)
    out = moe.fused_experts(hidden, w13, w2, weights, ids)
    rw, rids = moe.topk_routing_reference(logits, 2, True)
    _rms_close(out, moe.fused_experts_reference(hidden, w13, w2, rw, rids), torch.float32)


# ----------------------------------------------------------------- validation


def _good_moe(device="cpu"):
    return moe.make_moe_inputs(3, 4, 2, 16, 8, device, torch.float32, _gen())[0]


@pytest.mark.parametrize(
    "call",
    [
        lambda: moe.topk_routing(torch.randn(3, 4), 5, True),
        lambda: moe.topk_routing(torch.randn(3, 4), 0, True),
        lambda: moe.topk_routing(torch.randn(3, 4), 2, True, scoring="tanh"),
        lambda: moe.topk_routing(torch.randn(3, 4).to(torch.int32), 2, True),
        lambda: moe.topk_routing(torch.randn(3, 4, 2), 2, True),
        lambda: moe.align_block_size(torch.tensor([[0, 4]], dtype=torch.int32), 4, 4),
        lambda: moe.align_block_size(torch.tensor([[0, -2]], dtype=torch.int32), 4, 4),  # -1 = another rank's expert
        lambda: moe.align_block_size(torch.tensor([[0, 1]], dtype=torch.int64), 4, 4),
        lambda: moe.align_block_size(torch.tensor([[0, 1]], dtype=torch.int32), 0, 4),
    ],
    ids=["k>E", "k=0", "scoring", "int-logits", "3d-logits", "id>=E", "id<-1", "int64-ids", "block0"],
)
def test_bad_routing_and_align_input(fresh_graft, call):
    with pytest.raises(GraftInputError):
        call()


def _bad(index, value):
    args = list(_good_moe())
    args[index] = value(args[index]) if callable(value) else value
    return args


@pytest.mark.parametrize(
    "args",
    [
        _bad(1, lambda w: w.half()),  # w13 dtype != hidden
        _bad(2, lambda w: w.double()),  # w2 dtype
        _bad(0, lambda h: h[:, :15]),  # H mismatch
        _bad(2, lambda w: w[:, :, :7]),  # I mismatch
        _bad(2, lambda w: w[:3]),  # E mismatch
        _bad(1, lambda w: w[:, :15]),  # odd 2I
        _bad(4, lambda i: i.long()),  # id dtype
        _bad(4, lambda i: i + 4),  # id out of range
        _bad(4, lambda i: i[:2]),  # rows != T
        _bad(3, lambda w: w[:, :1]),  # weights vs ids shape
        _bad(3, lambda w: w.to("meta")),  # device mismatch
    ],
    ids=["w13-dtype", "w2-dtype", "H", "I", "E", "odd-2I", "id-dtype", "id-range", "id-rows", "k-shape", "device"],
)
def test_bad_fused_experts_input(fresh_graft, args):
    with pytest.raises(GraftInputError):
        moe.fused_experts(*args)


def test_bad_activation(fresh_graft):
    with pytest.raises(GraftInputError, match="activation"):
        moe.fused_experts(*_good_moe(), activation="gelu")


# ----------------------------------------------------------------- dispatch


def _selected(op, *args):
    from graft.dispatch import select

    return select(op, *args).backend


def test_dispatch_selects_triton_and_honours_graft_moe(fresh_graft, monkeypatch, device):
    from graft import plugins, selection

    logits = torch.randn(4, 6, device=device)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    args = _good_moe(device)
    assert _selected("moe.topk_routing", logits, 2, True, "softmax") == "triton"
    assert _selected("moe.align_block_size", ids, 4, 6) == "triton"
    assert _selected("moe.fused_experts", *args) == "triton"
    monkeypatch.setenv("GRAFT_MOE", "torch")
    plugins.reset()
    selection.reset_caches()
    assert _selected("moe.topk_routing", logits, 2, True, "softmax") == "torch"
    assert _selected("moe.align_block_size", ids, 4, 6) == "torch"
    assert _selected("moe.fused_experts", *args) == "torch"
    _rms_close(moe.fused_experts(*args), moe.fused_experts_reference(*args), torch.float32)


# ----------------------------------------------------------------- custom ops: opcheck and tracing


def test_opcheck_routing(kernels, device):
    logits = moe._distinct_logits(5, 6, _gen(), device, torch.float32)
    torch.library.opcheck(kernels[0].topk_routing_triton, (logits, 2, True, "softmax"))


def test_opcheck_align(kernels, device):
    ids = moe.random_topk_ids(5, 6, 2, _gen(), None).to(device)
    torch.library.opcheck(kernels[1].align_block_size_triton, (ids, 4, 6))


def test_opcheck_fused_experts(kernels, device):
    args, _ = moe.make_moe_inputs(3, 4, 2, 16, 8, device, torch.float32, _gen())
    torch.library.opcheck(kernels[2].fused_experts_triton, (*args, "silu"))


def test_moe_layer_traces_with_fake_tensors(kernels, device):
    from torch.fx.experimental.proxy_tensor import make_fx

    routing, align, fused = kernels

    def layer(logits, hidden, w13, w2):
        weights, ids = routing.topk_routing_triton(logits, 2, True, "softmax")
        sorted_ids, expert_ids, post_pad = align.align_block_size_triton(ids, 16, 4)
        return fused.fused_experts_triton(hidden, w13, w2, weights, ids, "silu"), sorted_ids, expert_ids

    hidden, w13, w2, _, _ = moe.make_moe_inputs(3, 4, 2, 16, 8, device, torch.float32, _gen())[0]
    logits = torch.randn(3, 4, device=device)
    graph = make_fx(layer, tracing_mode="fake")(logits, hidden, w13, w2)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"graft.moe_topk_routing_triton.default", "graft.moe_fused_experts_triton.default"} <= targets
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    out, sorted_ids, expert_ids = compiled(logits, hidden, w13, w2)
    assert sorted_ids.shape == (6 + 4 * 15,) and expert_ids.shape == (-(-66 // 16),)
    eager = layer(logits, hidden, w13, w2)[0]
    assert torch.equal(out, eager)


# ----------------------------------------------------------------- cases


def test_cases_cover_quick_and_gpu_and_run_on_the_reference():
    ops = {spec.name: spec for spec in moe.OPS}
    assert {c.op for c in moe.CASES} == set(ops)
    assert any("gpu" in c.tags and c.op == "moe.fused_experts" for c in moe.CASES)
    for case in moe.CASES:
        assert case.flops is not None
        if "quick" not in case.tags:
            continue
        args, kwargs = case.inputs("cpu", case.dtypes[-1])
        ops[case.op].validate(*args, **kwargs)
        ops[case.op].reference(*args, **kwargs)
        assert case.flops(args, kwargs) >= 0


def test_tile_tables_cover_every_arch_generation(kernels):
    routing, align, fused = kernels
    for table in (routing.TILES, align.TILES, fused.TILES):
        assert {"hopper", "cdna3", "default", "interpreter"} <= set(table)
    for entry in fused.TILES.values():
        for cfg in entry.values():
            assert cfg["BLOCK_N"] % 32 == 0 and cfg["BLOCK_M"] >= 16 and cfg["BLOCK_K"] >= 16  # tl.dot minimums
    cpu = fused.launch_config(64, 8, 40, "cpu", torch.float32)  # (8 experts, 40): no shape row
    assert cpu == fused.TILES["interpreter"]["large"]
