"""attention.prefill: the torch reference against SDPA, the Triton kernel (interpreted on
the CPU) against the reference, dispatch, validation and the custom op."""
import math

import pytest
import torch

from graft.errors import GraftInputError
from graft.ops import attention
from graft.ops.attention import make_prefill_inputs, prefill_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp16/fp32 are close to exact; bf16 outputs are one bf16 ulp (~0.016 at |x| ~ 2-4) apart.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}


def _close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _inputs(seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return make_prefill_inputs(seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, device, dtype, gen)


# ----------------------------------------------------------------- the reference itself


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_matches_sdpa_with_bottom_right_mask(causal):
    seqlens_q, seqlens_k = [3, 6, 1], [8, 6, 4]
    (q, k, v, cu_q, cu_k, mq, mk), kw = _inputs(seqlens_q, seqlens_k, 4, 2, 32, causal, "cpu", torch.float64)
    out = prefill_reference(q, k, v, cu_q, cu_k, mq, mk, causal=causal, softmax_scale=0.3)
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        mask = None
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
        expected = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.repeat_interleave(2, 1).transpose(0, 1), vs.repeat_interleave(2, 1).transpose(0, 1),
            attn_mask=mask, scale=0.3,
        ).transpose(0, 1)
        torch.testing.assert_close(out[cu_q[b] : cu_q[b + 1]], expected, atol=1e-5, rtol=1e-5)  # fp32 math


def test_reference_rows_without_visible_keys_are_zero():
    # 6 queries over 2 keys, causal bottom-right: query i sees keys j <= i - 4.
    (q, k, v, cu_q, cu_k, mq, mk), _ = _inputs([6], [2], 2, 1, 16, True, "cpu", torch.float32)
    out = prefill_reference(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    torch.testing.assert_close(out[4], v[0].expand(2, 16))  # exactly one visible key


def test_padded_layout_matches_sdpa(fresh_graft, device):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, h, 32, generator=gen).to(device) for h in (4, 2, 2))
    out = attention.prefill_padded(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------- Triton kernel vs reference


@pytest.fixture(scope="module")
def kernel():
    from graft.kernels.triton import attention_prefill

    return attention_prefill


# (seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal)
MATRIX = [
    pytest.param([1, 7, 33, 65], [1, 7, 33, 65], 2, 2, 64, True, id="ragged_mha_d64_causal"),
    pytest.param([7, 33], [7, 33], 4, 2, 128, False, id="gqa2_d128_full"),
    pytest.param([33, 18], [33, 18], 4, 1, 64, True, id="gqa4_d64_causal"),
    pytest.param([5, 1, 16], [37, 20, 16], 4, 2, 128, True, id="q_lt_k_gqa2_d128_causal"),
    pytest.param([3, 17], [30, 2], 3, 1, 64, False, id="q_ne_k_mqa3_d64_full"),
    pytest.param([20, 1], [7, 1], 2, 1, 64, True, id="q_gt_k_causal_zero_rows"),
    pytest.param([9, 0, 4], [9, 0, 4], 2, 2, 64, True, id="empty_seq_causal"),
    pytest.param([0, 3], [5, 3], 2, 1, 128, False, id="empty_q_nonempty_k"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal", MATRIX)
def test_kernel_matches_reference(kernel, device, seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, dtype):
    args, kw = _inputs(seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, device, dtype)
    out = kernel.prefill(*args, **kw)
    assert out.shape == args[0].shape and out.dtype == dtype
    _close(out, prefill_reference(*args, **kw), dtype)


@pytest.mark.parametrize("head_dim", [80, 24])
def test_kernel_pads_odd_head_dims(kernel, device, head_dim):
    args, kw = _inputs([13, 6], [13, 6], 2, 1, head_dim, True, device, torch.float16)
    _close(kernel.prefill(*args, **kw, softmax_scale=0.2), prefill_reference(*args, **kw, softmax_scale=0.2),
           torch.float16)


def test_kernel_reads_strided_views_of_fused_qkv(kernel, device):
    """vLLM slices q/k/v out of one qkv projection: non-contiguous token strides."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, seqlens = 4, 2, 64, [11, 20]
    total = sum(seqlens)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * d, generator=gen).half().to(device)
    q = qkv[:, : heads * d].view(total, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(total, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(total, kv_heads, d)
    assert not q.is_contiguous()
    cu = torch.tensor([0, 11, 31], dtype=torch.int32, device=device)
    out = kernel.prefill(q, k, v, cu, cu, 20, 20, causal=True)
    _close(out, prefill_reference(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 20, 20, causal=True),
           torch.float16)


# ----------------------------------------------------------------- dispatch, validation, custom op


def test_dispatch_selects_triton_and_env_forces_torch(fresh_graft, device, monkeypatch):
    import graft

    args, kw = _inputs([9, 4], [9, 4], 2, 1, 64, True, device, torch.float16)
    assert graft.select("attention.prefill", *args, **kw).backend == "triton"
    _close(attention.prefill(*args, **kw), prefill_reference(*args, **kw), torch.float16)
    monkeypatch.setenv("GRAFT_ATTENTION", "torch")
    assert graft.select("attention.prefill", *args, **kw).backend == "torch"
    _close(attention.prefill(*args, **kw), prefill_reference(*args, **kw), torch.float16)


def test_unsupported_head_dim_falls_back_to_reference(fresh_graft, device):
    import graft
    from graft.plugins import get_registry
    from graft.selection import decide

    args, kw = _inputs([2], [2], 1, 1, 320, False, device, torch.float32)
    decision = decide(get_registry(), "attention.prefill", device.type, torch.float32, device.type, args, kw)
    assert decision.selected.backend == "torch"
    reasons = [c.reason for c in decision.candidates if c.impl.backend == "triton"]
    assert reasons and "head_dim 320 not supported" in reasons[0]
    torch.testing.assert_close(graft.call("attention.prefill", *args, **kw), prefill_reference(*args, **kw))


def _bad(**changes):
    (q, k, v, cu_q, cu_k, mq, mk), _ = _inputs([3, 5], [3, 5], 4, 2, 16, True, "cpu", torch.float16)
    values = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    values.update({name: fn(values) for name, fn in changes.items()})
    return lambda: attention.prefill(**values)


@pytest.mark.parametrize(
    "call, message",
    [
        (_bad(k=lambda a: a["k"].float()), "inputs must share a dtype"),
        (_bad(q=lambda a: a["q"].int()), "q has dtype int32"),
        (_bad(q=lambda a: a["q"][None]), "q must be 3-D"),
        (_bad(v=lambda a: a["v"][:, :, :8]), "k and v must have the same shape"),
        (_bad(k=lambda a: a["k"][:, :, :8], v=lambda a: a["v"][:, :, :8]), "head_dim of q \\(16\\) and k/v \\(8\\)"),
        (_bad(q=lambda a: a["q"][:, :3]), "3 heads, not a multiple of num_kv_heads=2"),
        (_bad(cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()), "cu_seqlens_q has dtype int64"),
        (_bad(cu_seqlens_k=lambda a: a["cu_seqlens_k"][:2]), "must both have batch\\+1"),
        (_bad(cu_seqlens_q=lambda a: torch.tensor([0, 6, 5], dtype=torch.int32)), "non-decreasing"),
        (_bad(cu_seqlens_q=lambda a: torch.tensor([1, 3, 8], dtype=torch.int32)), "must start at 0"),
        (_bad(cu_seqlens_q=lambda a: torch.tensor([0, 3, 7], dtype=torch.int32)), "must equal the number of packed"),
        (_bad(cu_seqlens_k=lambda a: torch.tensor([0, 3, 9], dtype=torch.int32)), "exceeds the number of packed"),
        (_bad(max_seqlen_q=lambda a: 4), "has 5 tokens but the max_seqlen given for cu_seqlens_q is 4"),
        (_bad(max_seqlen_k=lambda a: 2.5), "max_seqlen_k must be an int"),
        (_bad(cu_seqlens_k=lambda a: a["cu_seqlens_k"].to("meta")), "must be on one device"),
    ],
)
def test_validation_errors(fresh_graft, call, message):
    with pytest.raises(GraftInputError, match=message):
        call()


def test_custom_op_opcheck_fake_and_compile(kernel, device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    (q, k, v, cu_q, cu_k, mq, mk), _ = _inputs([3, 5], [4, 5], 2, 1, 16, True, device, torch.float32)
    torch.library.opcheck(kernel.prefill_op, (q, k, v, cu_q, cu_k, mq, mk, True, 0.25),
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(torch.empty(9, 4, 128, dtype=torch.bfloat16))
        fk = mode.from_tensor(torch.empty(9, 2, 128, dtype=torch.bfloat16))
        fcu = mode.from_tensor(torch.zeros(3, dtype=torch.int32))
        out = kernel.prefill_op(fq, fk, fk, fcu, fcu, 5, 5, True, 0.1)
        assert out.shape == (9, 4, 128) and out.dtype == torch.bfloat16
    fn = torch.compile(lambda *a: kernel.prefill(*a, causal=True) * 2, backend="eager", fullgraph=True)
    expected = prefill_reference(q, k, v, cu_q, cu_k, mq, mk, causal=True) * 2
    torch.testing.assert_close(fn(q, k, v, cu_q, cu_k, mq, mk), expected, atol=2e-5, rtol=2e-5)


def test_default_scale_is_inverse_sqrt_head_dim():
    (q, k, v, cu_q, cu_k, mq, mk), _ = _inputs([4], [4], 1, 1, 64, False, "cpu", torch.float32)
    torch.testing.assert_close(
        prefill_reference(q, k, v, cu_q, cu_k, mq, mk),
        prefill_reference(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=1 / math.sqrt(64)),
    )


@pytest.mark.parametrize("causal", [True, False])
def test_torch_backend_compiles_fullgraph_with_its_gradients(causal):
    """graft's torch backend reads the per-sequence lengths on the host; under torch.compile it
    is the custom op attention_prefill_torch (fake + a written-out backward, itself an op):
    fullgraph=True traces, and output and q/k/v gradients equal the eager torch backend's for
    ragged sequences with more keys than queries (bottom-right causal) and GQA."""
    from graft.kernels.torch import attention as TA

    gen = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 9, 17], dtype=torch.int32)
    q = torch.randn(13, 4, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(17, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    grad = torch.randn(13, 4, 16, generator=gen)
    eager = TA.prefill_torch(q, k, v, cu_q, cu_k, 7, 8, causal, 0.25)
    want = torch.autograd.grad(eager, (q, k, v), grad)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: TA.prefill_torch(q, k, v, cu_q, cu_k, 7, 8, causal, 0.25),
                             backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, eager)
    for got, w in zip(torch.autograd.grad(out, (q, k, v), grad), want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_torch_backend_custom_op_opcheck():
    from graft.kernels.torch import attention as TA

    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(8, 1, 8, generator=gen, requires_grad=True) for _ in range(2))
    torch.library.opcheck(TA._PREFILL_TORCH_OP, (q, k, v, cu, cu, 5, 5, True, None))
