"""HIP/CUDA C++ kernels (graft.kernels.hip).

Without a GPU (this machine: CPU-only torch, nvcc present, no hipcc) the tests check
what can be checked: the sources hipify into valid-looking HIP (PyTorch's ROCm path),
the torch-free kernel files compile with nvcc for sm_90 (a failure fails the test when
nvcc is on PATH), the hip implementations report why they are unavailable and
selection falls back with that reason, and the custom ops' fake impls trace.
With GRAFT_TEST_DEVICE=cuda (ci/gpu_build_check.sh) the extension is built for real
and every hip impl is compared with the torch reference.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graft.errors import GraftUnsupportedError
from graft.kernels.hip import _build

HIP_OPS = {
    "fused.rms_norm": "fused_rms_norm_hip",
    "fused.silu_and_mul": "fused_silu_and_mul_hip",
    "attention.decode_paged": "attention_decode_paged_hip",
    "gemm.w4a16": "gemm_w4a16_hip",
    "moe.topk_routing": "moe_topk_routing_hip",
}
ON_GPU = os.environ.get("GRAFT_TEST_DEVICE", "cpu") != "cpu"


@pytest.fixture(autouse=True)
def _fresh_build_state():
    # Keep a built extension (GPU runs): a compiled module cannot be unloaded anyway.
    _build.reset(keep_module=True)
    yield
    _build.reset(keep_module=True)


# ------------------------------------------------------------------ (1) the ROCm path: hipify


@pytest.fixture(scope="module")
def hipified(tmp_path_factory):
    """Hipify a copy of csrc/ the way torch.utils.cpp_extension.load does on ROCm."""
    from torch.utils.hipify import hipify_python

    work = tmp_path_factory.mktemp("hipify")
    for path in _build.source_files():
        shutil.copyfile(path, work / path.name)
    sources = [str(work / name) for name in (_build.BINDING_SOURCE, *_build.KERNEL_SOURCES)]
    result = hipify_python.hipify(
        project_directory=str(work),
        output_directory=str(work),
        header_include_dirs=[str(work)],
        includes=[os.path.join(str(work), "*")],
        extra_files=sources,
        show_detailed=False,
        show_progress=False,
        is_pytorch_extension=True,
    )
    outputs = {}
    for source, info in result.items():
        if info.hipified_path:
            outputs[Path(source).name] = Path(info.hipified_path)
    return work, outputs


# CUDA runtime identifiers (cudaStream_t, cudaGetLastError, cudaSuccess, ...) that HIP does not have.
_CUDA_RUNTIME_NAME = re.compile(r"\bcuda[A-Z]\w*")
_CUDA_INCLUDE = re.compile(r"#include\s*[<\"](cuda_runtime[^>\"]*|cuda_fp16\.h|cuda_bf16\.h|cuda\.h)[>\"]")


def _code(text: str) -> str:
    """Source without // comments (comments may name CUDA APIs)."""
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def test_hipify_maps_every_source(hipified):
    work, outputs = hipified
    for name in (_build.BINDING_SOURCE, *_build.KERNEL_SOURCES, *_build.HEADERS):
        assert name in outputs, f"hipify produced nothing for {name}"
    for name in _build.KERNEL_SOURCES:
        assert outputs[name].suffix == ".hip", f"{name} -> {outputs[name].name}: hipcc compiles .hip files"


def test_hipified_sources_are_hip(hipified):
    work, outputs = hipified
    for name, path in outputs.items():
        code = _code(path.read_text())
        leftovers = sorted(set(_CUDA_RUNTIME_NAME.findall(code)))
        assert not leftovers, f"{path.name} still uses CUDA runtime names HIP lacks: {leftovers}"
        assert not _CUDA_INCLUDE.search(code), f"{path.name} still includes a CUDA header"
        assert "__nv_bfloat16" not in code, f"{path.name}: __nv_bfloat16 not mapped to __hip_bfloat16"
        # Every local include must point at a file hipify produced (or an original it left alone).
        for header in re.findall(r'#include\s*"([^"]+)"', code):
            if header.startswith("hip/"):
                continue
            assert (work / header).exists(), f"{path.name} includes {header!r}, which hipify did not write"
    compat = _code(outputs["compat.cuh"].read_text())
    assert "#include <hip/hip_runtime.h>" in compat and "#include <hip/hip_bf16.h>" in compat
    assert "__hip_bfloat16" in compat and "__shfl_xor(" in compat
    for name in _build.KERNEL_SOURCES:
        code = _code(outputs[name].read_text())
        assert "hipStream_t" in code and "hipGetLastError()" in code, name
        assert "<<<" not in code, f"{name}: kernel launches not rewritten to hipLaunchKernelGGL"
        assert "compat_hip.cuh" in code or "compat.cuh" in code
    binding = _code(outputs[_build.BINDING_SOURCE].read_text())
    assert "c10/hip/HIPStream.h" in binding and "c10/hip/HIPGuard.h" in binding
    assert "hipError_t" in binding and "hipGetErrorString" in binding


def test_sources_carry_no_vendor_specific_assembly():
    for path in _build.source_files():
        code = _code(path.read_text())
        assert "asm(" not in code.replace(" ", "") and "asmvolatile" not in code.replace(" ", ""), path.name
        # Only compat.cuh may name the warp width or the shuffle intrinsics.
        if path.name != "compat.cuh":
            assert "__shfl" not in code and not re.search(r"\b(32|64)\s*/\*\s*warp", code), path.name
            assert "warpSize" not in code, path.name


# ------------------------------------------------------------------ (2) the CUDA path: nvcc


@pytest.fixture(scope="module")
def nvcc_objects(tmp_path_factory):
    """Compile each torch-free kernel file with nvcc for sm_90, once per session, in parallel."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH: the CUDA compile check needs the CUDA toolkit")
    out = tmp_path_factory.mktemp("nvcc")
    jobs = {}
    for name in _build.KERNEL_SOURCES:
        obj = out / (Path(name).stem + ".o")
        cmd = [nvcc, "-c", "-std=c++17", "-O2", "-arch=sm_90", "-I", str(_build.CSRC_DIR),
               str(_build.CSRC_DIR / name), "-o", str(obj)]
        jobs[name] = (obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = {}
    for name, (obj, proc) in jobs.items():
        output, _ = proc.communicate(timeout=600)
        results[name] = (proc.returncode, output, obj)
    return results


@pytest.mark.parametrize("source", _build.KERNEL_SOURCES)
def test_kernel_sources_compile_with_nvcc(nvcc_objects, source):
    returncode, output, obj = nvcc_objects[source]
    assert returncode == 0, f"nvcc failed on {source}:\n{output}"
    assert obj.exists() and obj.stat().st_size > 0


EXPECTED_LAUNCHERS = {
    "fused_kernels.cu": ("launch_rms_norm", "launch_silu_and_mul"),
    "attention_kernels.cu": ("launch_paged_decode",),
    "gemm_kernels.cu": ("launch_int4_dequant",),
    "moe_kernels.cu": ("launch_topk_routing",),
}


@pytest.mark.parametrize("source", _build.KERNEL_SOURCES)
def test_compiled_objects_export_the_launchers(nvcc_objects, source):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not available")
    _, _, obj = nvcc_objects[source]
    symbols = subprocess.run([nm, "-C", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    for launcher in EXPECTED_LAUNCHERS[source]:
        assert f"graft::{launcher}(" in symbols, f"{source} does not define graft::{launcher}"


@pytest.mark.timeout(1200)  # torch's headers: about 40 s of compiler time, minutes on a loaded machine
def test_torch_binding_compiles_for_cuda(tmp_path):
    """bindings.cpp (the one file with torch headers) through nvcc's host compiler against this
    torch's headers: syntax and types, so every C++ source is compiled by some test. The CPU
    wheel lacks one generated CUDA header (CMake's macros), stubbed here."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH: the CUDA compile check needs the CUDA toolkit")
    import sysconfig

    from torch.utils import cpp_extension

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [str(tmp_path), *cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(_build.CSRC_DIR)]
    cmd = [nvcc, "-x", "c++", "-std=c++20", "-Xcompiler", "-fsyntax-only", "-Xcompiler", "-w", "-c",
           *(f"-I{path}" for path in includes), "-DTORCH_EXTENSION_NAME=graft_hip_kernels",
           str(_build.CSRC_DIR / _build.BINDING_SOURCE), "-o", str(tmp_path / "bindings.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"bindings.cpp does not compile:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"


def test_kernel_sources_do_not_include_torch():
    for name in (*_build.KERNEL_SOURCES, *_build.HEADERS):
        code = (_build.CSRC_DIR / name).read_text()
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", code), f"{name} must stay torch-free"


# ------------------------------------------------------------------ (3) availability and fallback


@pytest.mark.skipif(ON_GPU, reason="checks the reasons reported on a machine without a GPU build")
def test_this_machine_reports_why_hip_is_unavailable():
    reason = _build.unavailable_reason()
    assert reason is not None
    if _build.vendor() is None:
        assert "has no CUDA/HIP support" in reason
    with pytest.raises(GraftUnsupportedError, match=re.escape(reason)):
        _build.load_extension()


def test_reasons_for_each_missing_piece(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    _build.reset(keep_module=True)
    assert "torch" in _build.unavailable_reason() and "no CUDA/HIP support" in _build.unavailable_reason()

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _build.reset(keep_module=True)
    assert _build.unavailable_reason() == "no CUDA/ROCm device"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    _build.reset(keep_module=True)
    assert "nvcc not found" in _build.unavailable_reason() and "CUDA_HOME" in _build.unavailable_reason()

    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(cpp_extension, "ROCM_HOME", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    _build.reset(keep_module=True)
    assert "hipcc not found" in _build.unavailable_reason()

    monkeypatch.setattr(shutil, "which", lambda name: "/opt/rocm/bin/hipcc")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    _build.reset(keep_module=True)
    assert "ninja" in _build.unavailable_reason()


def test_failed_build_is_reported_and_remembered(monkeypatch):
    monkeypatch.setattr(_build._State, "module", None)
    monkeypatch.setattr(_build, "environment_reason", lambda: None)
    calls = []

    def broken_build():
        calls.append(1)
        raise RuntimeError("Error building extension 'graft_hip_kernels': nvcc fatal: bad flag")

    monkeypatch.setattr(_build, "_build", broken_build)
    with pytest.raises(GraftUnsupportedError, match="bad flag"):
        _build.load_extension()
    assert "building the HIP/CUDA kernels failed" in _build.unavailable_reason()
    with pytest.raises(GraftUnsupportedError, match="bad flag"):
        _build.load_extension()
    assert len(calls) == 1, "a failed build must not be retried on every call"


def test_build_mode_off_uses_only_prebuilt_kernels(monkeypatch, tmp_path):
    from graft.errors import GraftConfigError

    monkeypatch.setattr(_build._State, "module", None)
    monkeypatch.setattr(_build._State, "error", None)
    monkeypatch.setattr(_build, "environment_reason", lambda: None)
    monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("GRAFT_HIP_BUILD", raising=False)  # the default (a GPU script may set off)
    assert _build.unavailable_reason() is None  # default: lazy, builds on first use
    monkeypatch.setenv("GRAFT_HIP_BUILD", "off")
    assert "GRAFT_HIP_BUILD=off and no prebuilt kernels" in _build.unavailable_reason()
    name, _, build_dir = _build._paths()
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"")  # what `python -m graft.kernels.hip build` leaves
    assert _build.prebuilt() and _build.unavailable_reason() is None
    monkeypatch.setenv("GRAFT_HIP_BUILD", "sometimes")
    with pytest.raises(GraftConfigError, match="GRAFT_HIP_BUILD='sometimes' is not valid; use one of: lazy, off"):
        _build.unavailable_reason()


def test_ahead_of_time_build_command_reports_why_not_here():
    proc = subprocess.run([sys.executable, "-m", "graft.kernels.hip", "build"], capture_output=True, text=True,
                          timeout=120)
    if torch.cuda.is_available():
        pytest.skip("a GPU machine builds for real (ci/gpu_build_check.sh)")
    assert proc.returncode == 1 and "not built: graft HIP/CUDA kernels unavailable:" in proc.stderr


def test_build_is_cached_per_sources_and_in_graft_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path))
    assert _build.cache_dir() == tmp_path
    key = _build.build_key()
    assert re.fullmatch(r"[0-9a-f]{16}", key) and _build.build_key() == key
    _build._stage_sources(tmp_path / "src")
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == sorted(p.name for p in _build.source_files())
    monkeypatch.delenv("GRAFT_CACHE_DIR")
    assert _build.cache_dir() == Path.home() / ".cache" / "graft"
    from graft import config

    assert "GRAFT_CACHE_DIR" in config.KNOWN_ENV_VARS


@pytest.mark.skipif(ON_GPU, reason="checks fallback on a machine where the hip backend cannot run")
@pytest.mark.parametrize("op", sorted(HIP_OPS))
def test_selection_falls_back_with_the_reason(fresh_graft, op, monkeypatch, caplog):
    import logging

    import graft
    from graft import selection
    from graft.selection import decide

    registry = graft.get_registry()
    hip = [i for i in registry.implementations(op) if i.backend == "hip"]
    assert len(hip) == 1 and hip[0].custom_op is not None
    reason = _build.unavailable_reason()
    # A GPU request on this machine: hip is skipped with its environment reason.
    decision = decide(registry, op, "cuda", torch.float16, "sm_90")
    by_backend = {c.impl.backend: c.reason for c in decision.candidates}
    assert by_backend["hip"] == reason
    assert decision.selected.backend in ("triton", "torch")
    # graft.explain lists the hip implementation too (on the CPU, for the device).
    explained = graft.explain(op).as_dict()
    assert any(c["backend"] == "hip" and not c["usable"] and c["reason"] for c in explained["candidates"])
    # Explicitly asking for hip falls back with a warning naming the reason; strict mode refuses.
    monkeypatch.setenv("GRAFT_BACKENDS", "hip")
    selection.reset_caches()  # skip messages are logged once per (op, impl, reason), whatever the level
    with caplog.at_level(logging.WARNING, logger="graft.selection"):
        decision = decide(registry, op, "cuda", torch.float16, "sm_90")
    assert decision.fell_back
    assert any(reason in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("GRAFT_STRICT", "1")
    with pytest.raises(GraftUnsupportedError, match=re.escape(reason)):
        decide(registry, op, "cuda", torch.float16, "sm_90")


def test_graft_info_lists_hip_implementations(fresh_graft):
    from graft.tools.info import collect

    report = collect(ops=sorted(HIP_OPS))
    for entry in report["ops"]:
        hip = [c for c in entry["candidates"] if c["backend"] == "hip"]
        assert hip, f"graft info does not list the hip implementation of {entry['op']}"
        if not ON_GPU:
            assert hip[0]["usable"] is False and hip[0]["reason"]


def test_per_call_checks():
    from graft.kernels.hip import attention, moe

    q = torch.empty(2, 4, 320, device="meta")
    assert "head_dim 320" in attention.check_decode(q, None, None, None, None)
    assert attention.check_decode(torch.empty(2, 4, 128, device="meta"), None, None, None, None) is None
    fp8_cache = torch.empty(3, 16, 2, 128, dtype=torch.float8_e4m3fn, device="meta")
    assert "fp8" in attention.check_decode(torch.empty(2, 4, 128, device="meta"), fp8_cache, fp8_cache, None, None,
                                           k_scale=1.0, v_scale=1.0)
    assert "9000 experts" in moe.check_topk(torch.empty(3, 9000, device="meta"), 2)
    assert moe.check_topk(torch.empty(3, 64, device="meta"), 2) is None


# ------------------------------------------------------------------ (4) fake impls


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_fake_impls_give_output_shapes_without_a_gpu():
    from graft.kernels.hip import attention, fused, gemm, moe

    x = _meta(3, 5, 64, dtype=torch.bfloat16)
    assert fused.rms_norm_op(x, _meta(64, dtype=torch.float32), 1e-6).shape == (3, 5, 64)
    out, res = fused.add_rms_norm_op(x, x, _meta(64, dtype=torch.bfloat16), 1e-6)
    assert out.shape == res.shape == x.shape and out.dtype == res.dtype == torch.bfloat16
    assert fused.silu_and_mul_op(_meta(7, 2 * 48)).shape == (7, 48)
    q = _meta(4, 8, 128)
    cache = _meta(16, 16, 2, 128)
    out = attention.decode_paged(q, cache, cache, _meta(4, 3, dtype=torch.int32), _meta(4, dtype=torch.int32))
    assert out.shape == q.shape and out.dtype == q.dtype
    y = gemm.w4a16(_meta(2, 3, 256), _meta(32, 96, dtype=torch.int32), _meta(2, 96), None, None, 128, "gptq")
    assert y.shape == (2, 3, 96)
    y = gemm.w4a16(_meta(5, 256), _meta(256, 12, dtype=torch.int32), _meta(2, 96), None, None, 128, "awq")
    assert y.shape == (5, 96)
    w, ids = moe.topk_routing(_meta(6, 32, dtype=torch.float32), 4)
    assert w.shape == ids.shape == (6, 4) and w.dtype == torch.float32 and ids.dtype == torch.int32


def test_fake_impls_trace_with_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft.kernels.hip import fused, moe

    def layer(x, w, logits):
        h, r = fused.rms_norm(x, w, 1e-5, residual=x)
        weights, ids = moe.topk_routing(logits, 2)
        return fused.silu_and_mul(h) * 2, r, weights, ids

    args = (torch.randn(3, 16), torch.randn(16), torch.randn(3, 8))
    graph = make_fx(layer, tracing_mode="fake")(*args)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    for name in ("fused_add_rms_norm_hip", "fused_silu_and_mul_hip", "moe_topk_routing_hip"):
        assert any(name in t for t in targets), f"{name} missing from the traced graph: {targets}"


def test_real_impl_on_cpu_tensors_is_refused():
    from graft.kernels.hip import fused

    with pytest.raises((NotImplementedError, RuntimeError)):
        fused.silu_and_mul_op(torch.randn(2, 8))


# ------------------------------------------------------------------ GPU numerics (ci/gpu_build_check.sh)

TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-4)}
# w4a16 dequantizes into the activation dtype before the matmul: one extra rounding of W.
GEMM_TOL = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2), torch.float32: (1e-4, 1e-4)}


def _compare(out, ref, dtype, tol):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        if r is None:
            assert o is None
            continue
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
        if not r.dtype.is_floating_point:
            assert torch.equal(o.cpu(), r.cpu())
            continue
        atol, rtol = tol.get(dtype, TOL[torch.float32])
        torch.testing.assert_close(o.float().cpu(), r.float().cpu(), atol=atol, rtol=rtol)


def _cases():
    from graft.ops import all_op_specs  # noqa: F401 - family modules import
    from graft.ops import family_modules

    cases = []
    for module in family_modules():
        for case in getattr(module, "CASES", ()):
            if case.op in HIP_OPS and "quick" in case.tags:
                cases.append(case)
    return cases


@pytest.fixture(scope="module")
def hip_extension():
    if not ON_GPU:
        pytest.skip("GPU numerics: run with GRAFT_TEST_DEVICE=cuda (ci/gpu_build_check.sh)")
    if not torch.cuda.is_available():
        pytest.skip("GRAFT_TEST_DEVICE is set but no GPU is available")
    # On a GPU machine the build must work: an unavailable hip backend is a failure here.
    return _build.load_extension()


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_hip_impl_matches_reference(hip_extension, fresh_graft, device, case):
    import graft

    registry = graft.get_registry()
    spec = registry.op(case.op)
    impl = next(i for i in registry.implementations(case.op) if i.backend == "hip")
    tol = GEMM_TOL if case.op == "gemm.w4a16" else TOL
    for dtype in case.dtypes:
        if impl.dtypes is not None and dtype not in impl.dtypes:
            continue
        args, kwargs = case.inputs(device, dtype)
        if impl.check is not None and impl.check(*args, **kwargs):
            continue
        out = impl.fn(*args, **kwargs)
        ref = spec.reference(*args, **kwargs)
        if case.normalize is not None:
            out, ref = case.normalize(out), case.normalize(ref)
        _compare(out, ref, dtype, tol)


def test_hip_rms_norm_layouts(hip_extension, device):
    from graft.kernels.hip import fused as hip_fused
    from graft.ops import fused

    base = torch.randn(7, 300, device=device, dtype=torch.bfloat16)
    x = base[:, :257]  # strided rows
    w = torch.randn(257, device=device)  # fp32 weight, bf16 activations
    r = torch.randn(7, 257, device=device, dtype=torch.bfloat16)
    _compare(hip_fused.rms_norm(x, w, 1e-6, r), fused.rms_norm_reference(x, w, 1e-6, r), torch.bfloat16, TOL)
    big = torch.randn(3, 8193, device=device, dtype=torch.float16)
    wb = torch.randn(8193, device=device, dtype=torch.float16)
    _compare(hip_fused.rms_norm(big, wb, 1e-6), fused.rms_norm_reference(big, wb, 1e-6), torch.float16, TOL)


def test_hip_decode_on_vllm_v1_cache_views(hip_extension, device):
    # vLLM 0.33 hands the kernel kv_cache.transpose(1, 2).split(head_dim, -1): strided views.
    from graft.kernels.hip import attention as hip_attention
    from graft.ops import attention

    num_blocks, block_size, kv_heads, head_dim, heads = 12, 16, 2, 96, 8
    kv = torch.randn(num_blocks, kv_heads, block_size, 2 * head_dim, device=device, dtype=torch.float16)
    key_cache, value_cache = kv.transpose(1, 2).split(head_dim, -1)
    query = torch.randn(3, heads, head_dim, device=device, dtype=torch.float16)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32)[:12].reshape(3, 4)
    lens = torch.tensor([1, 37, 64], device=device, dtype=torch.int32)
    out = hip_attention.decode_paged(query, key_cache, value_cache, tables, lens, 0.1)
    ref = attention.decode_paged_reference(query, key_cache, value_cache, tables, lens, 0.1)
    _compare(out, ref, torch.float16, TOL)
