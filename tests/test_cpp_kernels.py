"""graft's cpp backend (graft.kernels.cpp): CPU C++ kernels built with torch's extension
builder. On this machine they build and run for real (a C++ compiler and ninja are part of
the set-up), so every test compares the kernel against the op's torch reference."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import graft
from graft import config
from graft.errors import GraftConfigError
from graft.kernels.cpp import _build
from graft.kernels.cpp import attention as cpp_attention
from graft.ops.attention import decode_paged_reference, make_decode_inputs

pytestmark = pytest.mark.skipif(_build.unavailable_reason() is not None,
                                reason=f"cpp backend unavailable here: {_build.unavailable_reason()}")


def _inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, kv_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    args, kwargs = make_decode_inputs(seq_lens, heads, kv_heads, head_dim, block_size, "cpu", dtype, gen,
                                      kv_dtype=kv_dtype)
    kwargs.pop("num_splits")
    return args, kwargs


def _tolerance(dtype):
    return {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


def _assert_matches(args, kwargs, scale=None):
    out = cpp_attention.decode_paged(*args, softmax_scale=scale, **kwargs)
    ref = decode_paged_reference(*args, softmax_scale=scale, **kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = _tolerance(args[0].dtype)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, equal_nan=True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (16, 4, 64, 16),    # vLLM's CPU bench model: GQA 4
    (6, 2, 80, 128),    # group 3 (the 2-head and 1-head register blocks), head_dim not a vector multiple
    (5, 5, 8, 1),       # MHA, tiny head_dim, one token per block
    (8, 1, 128, 32),    # MQA: group 8 (two 4-head blocks)
    (2, 2, 3, 7),       # odd everything
])
def test_decode_matches_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    seq_lens = [1, 33, 0, 70, block_size * 2]  # a zero-length row, a full last block
    args, kwargs = _inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    out = _assert_matches(args, kwargs)
    assert bool((out[2] == 0).all())  # no token: zeros


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_fp8_cache_matches_the_reference(kv_dtype, dtype):
    args, kwargs = _inputs([5, 40, 17], 8, 2, 64, 16, dtype, kv_dtype=kv_dtype)
    _assert_matches(args, kwargs)
    # Scales as Python floats (vLLM's *_scale_float) give the same result.
    floats = {name: float(value) for name, value in kwargs.items()}
    _assert_matches(args, floats)


def test_decode_reads_vllm_layout_strided_views_and_int64_metadata():
    # vLLM 0.33's cache: [num_blocks, kv_heads, block_size, 2 * head_dim] split in the last dim.
    gen = torch.Generator().manual_seed(1)
    num_blocks, kv_heads, block_size, head_dim = 9, 2, 16, 64
    kv = torch.randn(num_blocks, kv_heads, block_size, 2 * head_dim, generator=gen)
    key_cache, value_cache = kv.transpose(1, 2).split(head_dim, -1)
    query = torch.randn(8, 3, head_dim, generator=gen).transpose(0, 1)  # non-contiguous [3, 8, D]
    tables = torch.tensor([[3, 1, 8], [0, 2, 5], [7, 6, 4]], dtype=torch.int64)
    lens = torch.tensor([40, 1, 48], dtype=torch.int64)
    _assert_matches((query, key_cache, value_cache, tables, lens), {}, scale=0.3)
    # A table given as a strided view (every other column).
    wide = torch.zeros(3, 6, dtype=torch.int32)
    wide[:, ::2] = tables.int()
    _assert_matches((query, key_cache, value_cache, wide[:, ::2], lens.int()), {})


def test_decode_out_of_range_values_are_clamped_and_skipped_as_in_the_reference():
    args, kwargs = _inputs([20, 30, 12], 4, 2, 32, 8, torch.float32)
    query, key_cache, value_cache, tables, lens = args
    tables = tables.clone()
    tables[0, 1] = -1  # a used entry below range: its 8 tokens take no part
    tables[1, :] = 10**6  # every entry out of range: a zero row
    lens = torch.tensor([20, 30, 10**5], dtype=torch.int32)  # beyond capacity: clamped
    out = _assert_matches((query, key_cache, value_cache, tables, lens), kwargs)
    assert bool((out[1] == 0).all())


def test_decode_non_finite_scores_follow_torch_softmax():
    args, kwargs = _inputs([10, 10, 10], 2, 1, 16, 4, torch.float32)
    query, key_cache, value_cache, tables, lens = args
    key_cache = key_cache.clone()
    key_cache[tables[0, 0], 1, 0, 0] = float("nan")  # a NaN key in sequence 0: its row is NaN
    query = query.clone()
    query[2, 0, :] = float("inf")  # +-inf scores in sequence 2, head 0
    out = _assert_matches((query, key_cache, value_cache, tables, lens), kwargs)
    assert bool(out[0].isnan().all()) and not bool(out[1].isnan().any())


def test_decode_empty_batch_and_default_scale():
    args, kwargs = _inputs([], 4, 2, 16, 4, torch.float32)
    out = cpp_attention.decode_paged(*args)
    assert out.shape == (0, 4, 16)
    args, kwargs = _inputs([9], 4, 2, 16, 4, torch.float32)
    scaled = cpp_attention.decode_paged(*args, softmax_scale=1.0 / math.sqrt(16))
    torch.testing.assert_close(cpp_attention.decode_paged(*args), scaled, atol=0, rtol=0)


def test_check_declines_row_strided_caches():
    args, _ = _inputs([5], 2, 1, 8, 4, torch.float32)
    query, key_cache, value_cache, tables, lens = args
    strided = torch.randn(*key_cache.shape[:3], 16)[..., ::2]
    assert "stride(3) == 1" in cpp_attention.check_decode(query, strided, strided, tables, lens)
    assert cpp_attention.check_decode(*args) is None


def test_public_op_serves_from_cpp_and_falls_back_on_a_declined_call():
    args, kwargs = _inputs([7, 19], 4, 2, 16, 4, torch.float32)
    query, key_cache, value_cache, tables, lens = args
    strided = torch.randn(*key_cache.shape[:3], 32)[..., ::2]
    # The default order without Triton's interpreter (the tests run with it on): cpp, then torch.
    with config.override(GRAFT_BACKENDS="hip,cpp,torch"):
        torch.testing.assert_close(graft.ops.attention.decode_paged(*args), decode_paged_reference(*args),
                                   atol=2e-5, rtol=2e-5)
        assert graft.select("attention.decode_paged", *args).backend == "cpp"
        assert graft.select("attention.decode_paged", query, strided, strided, tables, lens).backend == "torch"


def test_decode_traces_under_torch_compile_without_graph_breaks():
    args, _ = _inputs([7, 19], 4, 2, 16, 4, torch.float32)
    compiled = torch.compile(lambda *a: cpp_attention.decode_paged(*a), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), decode_paged_reference(*args), atol=2e-5, rtol=2e-5)


def test_opcheck_on_the_custom_op():
    args, _ = _inputs([7, 19], 4, 2, 16, 4, torch.float32)
    torch.library.opcheck(cpp_attention.decode_paged_op, (*args, 0.25, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_build_mode_is_validated_and_off_without_a_prebuilt_library_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(_build.BUILD_VAR, "sometimes")
    with pytest.raises(GraftConfigError, match="GRAFT_CPP_BUILD='sometimes' is not valid; use one of: lazy, off"):
        _build.build_mode()
    # In a fresh process (a loaded library stays loaded): off + empty cache = unavailable, named.
    env = {**os.environ, _build.BUILD_VAR: "off", "GRAFT_CACHE_DIR": str(tmp_path), "GRAFT_BACKENDS": "cpp,torch"}
    code = ("from graft.kernels.cpp import _build; import graft, torch; "
            "from graft.ops.attention import make_decode_inputs as m; "
            "a, _ = m([3], 2, 1, 8, 4, 'cpu', torch.float32, torch.Generator().manual_seed(0)); "
            "print(_build.unavailable_reason()); print(graft.select('attention.decode_paged', *a).backend)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reason, backend = result.stdout.strip().splitlines()[-2:]
    assert "GRAFT_CPP_BUILD=off and no prebuilt kernels" in reason and backend == "torch"


def test_build_command_usage_and_key():
    result = subprocess.run([sys.executable, "-m", "graft.kernels.cpp"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: python -m graft.kernels.cpp build" in result.stderr
    key = _build.build_key()
    assert len(key) == 16 and key == _build.build_key()
    assert any(flag.startswith("-DCPU_CAPABILITY=") for flag in _build.cxx_flags())
