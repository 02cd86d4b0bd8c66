"""The kernel tests under Triton 3.6, the version on the GPU machines (torch 2.11 there).

Triton 3.6 goes into its own folder (``.venv-triton36``, made by ci/setup.sh, or here on
first use: ``pip install --no-deps --target``, with numpy < 2.4 for 3.6's interpreter;
GRAFT_TRITON36_DIR overrides the folder)
and shadows the venv's Triton through PYTHONPATH in a subprocess that runs one kernel test
per Triton kernel file, interpreted, with the CPU torch of this venv, plus the bounds-safety
cases on the triton backend. An API that 3.9 has and 3.6 lacks fails here, not on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = "3.6.0"
# (test, the kernel file it runs): one per Triton kernel file.
SUBSET = [
    ("tests/test_gemm_linear.py::test_strided_inputs", "gemm_linear"),
    ("tests/test_gemm_linear_tma.py::test_tma_kernel_every_tile_written_once", "gemm_linear"),  # TMA descriptors
    ("tests/test_gemm_linear_tma.py::test_warp_specialized_tma_kernel_matches_pointer_kernel[ragged-torch.float16]",
     "gemm_linear"),  # tl.range(warp_specialize=...), the pointer epilogue
    ("tests/test_gemm_quant.py::test_w8a8_int32_accumulation_is_exact", "gemm_w8a8"),
    ("tests/test_gemm_quant.py::test_w8a8_split_k_is_bit_exact[5-33-129-2]", "gemm_w8a8"),  # split-K + int32 reduce
    ("tests/test_gemm_quant.py::test_gptq_and_awq_layouts_agree", "gemm_w4a16"),
    ("tests/test_gemm_quant.py::test_gptq_interleaved_gives_gptqs_product[32]", "gemm_w4a16"),  # 16-row slices
    ("tests/test_attention_prefill.py::test_kernel_reads_strided_views_of_fused_qkv", "attention_prefill"),
    ("tests/test_attention_unwritten_rows.py::test_many_sequences_span_several_cu_seqlens_chunks",
     "attention_prefill"),  # the zeroing pass over cu_seqlens chunks
    ("tests/test_attention_decode.py::test_more_splits_than_tiles_and_odd_head_dim", "attention_decode_paged"),
    ("tests/test_attention_prefill_paged.py::test_kernel_reads_vllm_strided_cache_views", "attention_prefill_paged"),
    ("tests/test_attention_decode.py::test_fp8_kv_cache_matches_dequantised_reference[torch.float16-torch.float8_e4m3fn]",
     "attention_decode_paged"),  # the fp8 KV path
    ("tests/test_moe.py::test_triton_routing_ties_and_empty", "moe_topk_routing"),
    ("tests/test_moe.py::test_triton_align_many_chunks_and_wide_router", "moe_align_block_size"),
    ("tests/test_moe.py::test_triton_fused_experts_empty_and_strided", "moe_fused_experts"),
    ("tests/test_fused.py::test_triton_rms_norm_strided_rows_and_long_row_two_pass", "fused_rms_norm"),
    ("tests/test_fused.py::test_triton_rotary_views_int32_positions_and_no_k", "fused_rotary_embedding"),
    ("tests/test_fused.py::test_triton_rotary_heads_in_chunks[gptj]", "fused_rotary_embedding"),  # heads in chunks, backward
    ("tests/test_fused.py::test_triton_silu_and_mul[(1, 2)-torch.float16]", "fused_silu_and_mul"),
    ("tests/test_optim_adam.py::test_several_tensors_over_several_steps", "fused_adam_step"),
    ("tests/test_gemm_fp8.py::test_fp8_dispatch_and_custom_op", "gemm_fp8"),
    ("tests/test_moe_fp8.py::test_close_to_the_unquantized_moe", "moe_fused_experts_fp8"),
    # the backwards (and the fused loss): the gradient check of each op's first case
    ("tests/test_training.py::test_gradient_conformance_first_case[attention.prefill]", "attention_prefill_backward"),
    ("tests/test_training.py::test_gradient_conformance_first_case[fused.layer_norm]", "fused_layer_norm"),
    ("tests/test_training.py::test_gradient_conformance_first_case[gemm.linear]", "gemm_linear_backward"),
    ("tests/test_training.py::test_gradient_conformance_first_case[moe.fused_experts]", "moe_fused_experts_backward"),
    ("tests/test_training.py::test_gradient_conformance_first_case[loss.fused_linear_cross_entropy]",
     "loss_fused_linear_cross_entropy"),
]
pytestmark = pytest.mark.timeout(1800)  # a first run installs Triton 3.6; interpreted kernels on 2 cores


def _triton36_dir() -> str:
    folder = os.environ.get("GRAFT_TRITON36_DIR") or os.path.join(ROOT, ".venv-triton36")
    if not os.path.exists(os.path.join(folder, "triton", "__init__.py")):
        # numpy < 2.4 beside it: Triton 3.6's interpreter calls int() on 1-element arrays (an
        # error since numpy 2.4; 3.9 squeezes first). Compiled kernels on a GPU never do.
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", folder,
                               f"triton=={VERSION}", "numpy<2.4"], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"could not install triton=={VERSION} into {folder}:\n{proc.stderr[-3000:]}"
    return folder


def _env(folder: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")])), TRITON_INTERPRET="1")
    return env


@pytest.fixture(scope="module")
def triton36():
    folder = _triton36_dir()
    env = _env(folder)
    proc = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__, triton.__file__)"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(VERSION + " " + folder), proc.stdout + proc.stderr
    return env


def test_one_kernel_test_per_kernel_file_under_triton36(triton36):
    from graft.kernels.triton import _aot

    kernel_files = {m.__name__.rsplit(".", 1)[1] for m in _aot._modules(public_only=True)
                    if _aot.module_variants(m)}
    covered = {kernel_file for _, kernel_file in SUBSET}
    assert kernel_files <= covered, f"no Triton 3.6 test for {sorted(kernel_files - covered)}"
    tests = [test for test, _ in SUBSET]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests],
                          cwd=ROOT, env=triton36, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"{len(SUBSET)} passed" in proc.stdout, proc.stdout[-3000:]


def test_bounds_safety_cases_under_triton36(triton36):
    env = dict(triton36, GRAFT_CHECK_VALUES="0", GRAFT_STRICT="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tests", "_safety_cases.py"), "triton"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("PASS ") >= 8, proc.stdout
