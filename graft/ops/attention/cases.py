"""The attention ops' conformance cases and their input builders."""
from __future__ import annotations

import torch

from graft.cases import OpCase


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def make_prefill_inputs(seqlens_q, seqlens_k, num_heads, num_kv_heads, head_dim, causal, device, dtype, gen):
    """Packed inputs for the given per-sequence lengths (deterministic in ``gen``)."""
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q = _randn((total_q, num_heads, head_dim), dtype, device, gen)
    k = _randn((total_k, num_kv_heads, head_dim), dtype, device, gen)
    v = _randn((total_k, num_kv_heads, head_dim), dtype, device, gen)
    cu_q = torch.tensor([0] + list(_cumsum(seqlens_q)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(_cumsum(seqlens_k)), dtype=torch.int32, device=device)
    args = (q, k, v, cu_q, cu_k, max(seqlens_q, default=0), max(seqlens_k, default=0))
    return args, {"causal": causal}


def make_decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, device, dtype, gen, num_splits=0,
                       spare_blocks=3, kv_dtype=None):
    """A paged cache with every sequence's blocks scattered at random physical positions;
    ``kv_dtype`` (fp8): caches quantised per tensor, scales as one-element fp32 tensors."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(max(blocks_per_seq, default=0), 1)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    key_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), dtype, device, gen)
    value_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), dtype, device, gen)
    perm = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at arbitrary (valid) blocks: kernels must not read them.
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    query = _randn((len(seq_lens), num_heads, head_dim), dtype, device, gen)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    args = (query, key_cache, value_cache, block_tables.to(device), lens.to(device))
    if kv_dtype is None:
        return args, {"num_splits": num_splits}
    from graft import quant

    k_q, k_scale = quant.quantize_fp8_per_tensor(key_cache.float(), kv_dtype)
    v_q, v_scale = quant.quantize_fp8_per_tensor(value_cache.float(), kv_dtype)
    args = (query, k_q, v_q) + args[3:]
    return args, {"num_splits": num_splits, "k_scale": k_scale.reshape(1), "v_scale": v_scale.reshape(1)}


def make_prefill_paged_inputs(seqlens_q, context_lens, num_heads, num_kv_heads, head_dim, block_size, causal, device,
                              dtype, gen, spare_blocks=3):
    """Queries for the last ``seqlens_q[b]`` tokens of contexts of ``seqlens_q[b] + context_lens[b]``
    tokens, held in a paged cache whose blocks are scattered at random (deterministic in ``gen``)."""
    seq_lens = [q + c for q, c in zip(seqlens_q, context_lens)]
    (_, key_cache, value_cache, block_tables, lens), _ = make_decode_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, device, dtype, gen, spare_blocks=spare_blocks)
    q = _randn((sum(seqlens_q), num_heads, head_dim), dtype, device, gen)
    cu_q = torch.tensor([0] + list(_cumsum(seqlens_q)), dtype=torch.int32, device=device)
    args = (q, key_cache, value_cache, block_tables, cu_q, lens, max(seqlens_q, default=0))
    return args, {"causal": causal}


def _cumsum(values):
    total = 0
    for x in values:
        total += x
        yield total


def _prefill_flops(args, kwargs):
    q, _, _, cu_q, cu_k = args[:5]
    num_heads, head_dim = q.shape[1], q.shape[2]
    sq = torch.diff(cu_q).tolist()
    sk = torch.diff(cu_k).tolist()
    pairs = 0
    for a, b in zip(sq, sk):
        if kwargs.get("causal"):
            # visible keys of row i: clamp(i + b - a + 1, 0, b)
            pairs += sum(min(max(i + b - a + 1, 0), b) for i in range(a))
        else:
            pairs += a * b
    return 4.0 * pairs * num_heads * head_dim  # QK^T and PV, 2 flops per MAC


def _decode_flops(args, kwargs):
    query, _, _, _, seq_lens = args
    return 4.0 * float(seq_lens.sum()) * query.shape[1] * query.shape[2]


def _prefill_reduction(args, kwargs):
    return max(args[6], args[0].shape[-1])  # softmax/PV sum over keys, QK^T over head_dim


def _decode_reduction(args, kwargs):
    return max(int(args[4].max()) if args[4].numel() else 0, args[0].shape[-1])


def _prefill_paged_flops(args, kwargs):
    q, _, _, _, cu_q, seq_lens = args[:6]
    return _prefill_flops((q, None, None, cu_q, _cumsum0_tensor(seq_lens)), kwargs)


def _cumsum0_tensor(lengths):
    return torch.tensor([0] + list(_cumsum(lengths.tolist())), dtype=torch.int32)


def _prefill_paged_reduction(args, kwargs):
    seq_lens = args[5]
    return max(int(seq_lens.max()) if seq_lens.numel() else 0, args[0].shape[-1])


def _prefill_paged_case(name, seqlens_q, context_lens, heads, kv_heads, head_dim, block_size, causal,
                        tags=frozenset({"quick"})):
    return OpCase(
        op="attention.prefill_paged",
        name=name,
        make_inputs=lambda device, dtype, gen: make_prefill_paged_inputs(
            seqlens_q, context_lens, heads, kv_heads, head_dim, block_size, causal, device, dtype, gen
        ),
        tags=tags,
        flops=_prefill_paged_flops,
        reduction=_prefill_paged_reduction,
    )


def _prefill_case(name, seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, tags=frozenset({"quick"})):
    return OpCase(
        op="attention.prefill",
        name=name,
        make_inputs=lambda device, dtype, gen: make_prefill_inputs(
            seqlens_q, seqlens_k, heads, kv_heads, head_dim, causal, device, dtype, gen
        ),
        tags=tags,
        flops=_prefill_flops,
        reduction=_prefill_reduction,
    )


def _decode_case(name, seq_lens, heads, kv_heads, head_dim, block_size, num_splits=0, tags=frozenset({"quick"}),
                 kv_dtype=None):
    return OpCase(
        op="attention.decode_paged",
        name=name,
        make_inputs=lambda device, dtype, gen: make_decode_inputs(
            seq_lens, heads, kv_heads, head_dim, block_size, device, dtype, gen, num_splits, kv_dtype=kv_dtype
        ),
        tags=tags,
        flops=_decode_flops,
        reduction=_decode_reduction,
    )


_GPU = frozenset({"gpu"})
CASES = [
    _prefill_case("b3_ragged_h4_kv2_d64_causal", [1, 33, 7], [1, 33, 7], 4, 2, 64, True),
    _prefill_case("b3_ragged_h2_kv2_d128", [17, 5, 40], [17, 5, 40], 2, 2, 128, False),
    _prefill_case("b2_q_lt_k_mqa_d64_causal", [5, 1], [37, 20], 4, 1, 64, True),
    _prefill_case("b3_empty_seq_h2_d64_causal", [9, 0, 4], [9, 0, 4], 2, 1, 64, True),
    _decode_case("n4_odd_lens_h4_kv2_d64_bs16", [1, 17, 32, 45], 4, 2, 64, 16),
    _decode_case("n3_zero_len_h4_kv1_d128_bs8_split3", [0, 9, 70], 4, 1, 128, 8, num_splits=3),
    # Paged prefill: block sizes that do not divide the lengths, zero context, an empty
    # query, an empty batch; the first is the smallest (the fuzz module starts from it).
    _prefill_paged_case("b2_ctx_h2_kv1_d64_bs5_causal", [3, 6], [7, 0], 2, 1, 64, 5, True),
    _prefill_paged_case("b3_ctx_h4_kv2_d64_bs16_causal", [1, 7, 20], [0, 33, 5], 4, 2, 64, 16, True),
    _prefill_paged_case("b4_odd_empty_q_h4_kv1_d128_bs8_causal", [3, 0, 11, 1], [17, 4, 2, 60], 4, 1, 128, 8, True),
    _prefill_paged_case("b2_zero_ctx_h2_kv2_d64_bs16_causal", [9, 17], [0, 0], 2, 2, 64, 16, True),
    _prefill_paged_case("b2_ctx_h4_kv2_d64_bs16", [5, 12], [30, 3], 4, 2, 64, 16, False),
    _prefill_paged_case("b0_empty_batch_h2_kv1_d64_bs16", [], [], 2, 1, 64, 16, True),
    _decode_case("n3_fp8_e4m3_kv_h4_kv2_d64_bs16", [5, 40, 17], 4, 2, 64, 16, kv_dtype=torch.float8_e4m3fn),
    _decode_case("n2_fp8_e5m2_kv_h8_kv2_d128_bs8_split2", [33, 9], 8, 2, 128, 8, num_splits=2,
                 kv_dtype=torch.float8_e5m2),
    _prefill_case("b8_s2048_h32_kv8_d128_causal", [2048] * 8, [2048] * 8, 32, 8, 128, True, _GPU),
    _prefill_case("b8_s2048_h32_kv8_d128", [2048] * 8, [2048] * 8, 32, 8, 128, False, _GPU),
    _prefill_case("b4_ragged_h32_kv8_d64_causal", [4000, 1000, 3000, 129], [4000, 1000, 3000, 129], 32, 8, 64, True,
                  _GPU),
    # Chunked prefill / prefix caching: 512 new tokens after 1.5k-3.5k cached ones.
    _prefill_paged_case("b8_q512_ctx3584_h32_kv8_d128_bs16_causal", [512] * 8, [3584] * 8, 32, 8, 128, 16, True, _GPU),
    _prefill_paged_case("b4_ragged_ctx_h32_kv8_d128_bs16_causal", [2048, 512, 1000, 64], [0, 1536, 3000, 8000], 32, 8,
                        128, 16, True, _GPU),
    _decode_case("n64_ctx4096_h32_kv8_d128_bs16", [4096] * 64, 32, 8, 128, 16, tags=_GPU),
    _decode_case("n8_ctx32768_h32_kv8_d128_bs16", [32768] * 8, 32, 8, 128, 16, tags=_GPU),
    _decode_case("n64_ctx4096_h32_kv8_d128_bs16_fp8kv", [4096] * 64, 32, 8, 128, 16, tags=_GPU,
                 kv_dtype=torch.float8_e4m3fn),
]
