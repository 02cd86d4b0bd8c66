"""Every Triton kernel compiles for real GPU targets, here on a CPU-only machine.

The interpreter (which runs the kernel tests here) accepts code the GPU compilers reject,
so graft.kernels.triton._aot lowers a representative variant of every @triton.jit kernel
to sm_90 and gfx942 binaries with Triton's bundled toolchains, and fails when a kernel
has no AOT variant at all. The full sweep: ``TRITON_INTERPRET=0 python -m graft.kernels.triton._aot``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from graft.kernels.triton import _aot


def _quick_compiles() -> set:
    return {(v.kernel, target) for target, v in _aot.variants(quick=True)}


def test_every_kernel_compiles_for_sm90_and_gfx942(tmp_path):
    """Quick sweep, in a subprocess because the interpreter is on in this one; a fresh cache
    dir so that nothing is skipped as already compiled."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "graft.kernels.triton._aot", "--quick"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == len(_quick_compiles()), proc.stdout
    for target in _aot.TARGETS:
        assert any(f" {target} " in line for line in compiled)


def test_every_jit_function_is_compiled_by_some_variant():
    assert _aot.uncovered() == []
    kernels = {kernel for kernel, _ in _quick_compiles()}
    assert len(kernels) >= 17  # gemm 3, attention 3, moe 7, fused 3, optim 1 at the time of writing
    assert {target for _, target in _quick_compiles()} == set(_aot.TARGETS)


def test_a_kernel_without_variant_is_reported(tmp_path, monkeypatch):
    (tmp_path / "graft_aot_probe.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        from graft.kernels.triton._aot import variant


        @triton.jit
        def _helper(x):
            return x * 2


        @triton.jit
        def covered_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, _helper(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


        @triton.jit
        def forgotten_kernel(x_ptr, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)


        AOT_VARIANTS = [variant(covered_kernel, dict(BLOCK=16))]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import graft_aot_probe

    try:
        assert _aot.uncovered([graft_aot_probe]) == ["graft_aot_probe.forgotten_kernel"]
        graft_aot_probe.AOT_VARIANTS = []
        assert len(_aot.uncovered([graft_aot_probe])) == 3  # the helper is no longer reached either
    finally:
        sys.modules.pop("graft_aot_probe", None)


def test_signature_types_arguments_by_naming_convention():
    from graft.kernels.triton import attention_prefill, gemm_dense

    gemm = _aot.signature(gemm_dense.AOT_VARIANTS[0])
    assert gemm["x_ptr"] == "*bf16" and gemm["M"] == gemm["K"] == "i32" and gemm["BLOCK_K"] == "constexpr"
    attn = _aot.signature(attention_prefill.AOT_VARIANTS[0])
    assert attn["K"] == "*fp16" and attn["CuSeqlensQ"] == "*i32" and attn["qk_scale"] == "fp32"
    assert attn["head_dim"] == "i32" and attn["CAUSAL"] == "constexpr"


def test_variant_rejects_unknown_argument_names():
    from graft.kernels.triton import fused_activation

    with pytest.raises(TypeError, match="BLOCK_SIZE"):
        _aot.variant(fused_activation._silu_and_mul_kernel, dict(BLOCK_SIZE=16))
