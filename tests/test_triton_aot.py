"""Every Triton kernel compiles for real GPU targets, here on a CPU-only machine, within
the target's shared-memory and register limits.

The interpreter (which runs the kernel tests here) accepts code the GPU compilers reject
and knows nothing of resources, so graft.kernels.triton._aot lowers every variant the
launchers can launch to sm_90 and gfx942 binaries with Triton's bundled toolchains, with
the JIT's own specialisation, and fails when a variant exceeds the target's limits or a
kernel has no variant at all. Results of unchanged variants come from
kernels/triton/aot_resources.json (keyed by Triton version, target, kernel sources and
specialisation); whatever changed is compiled here. Refresh the file after changing a
kernel: ``TRITON_INTERPRET=0 python -m graft.kernels.triton._aot --update-cache --jobs 2``.
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


def _aot_env(tmp_path):
    return dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")


@pytest.mark.timeout(1800)  # seconds with a current cache file; a changed kernel's variants compile here
def test_every_variant_fits_sm90_and_gfx942(tmp_path):
    """The full set (every variant of every kernel, both targets), compiled by Triton 3.6 (the
    GPU image's version, from .venv-triton36 as in test_triton36.py), in a subprocess because
    the interpreter is on in this one: within the limits, no unaccepted spill, and every tl.dot
    on the tensor cores (wgmma or mma.sync on sm_90, MFMA on gfx942)."""
    from test_triton36 import VERSION, _triton36_dir

    env = dict(_aot_env(tmp_path), PYTHONPATH=os.pathsep.join(filter(None, [_triton36_dir(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "graft.kernels.triton._aot", "--cache", "--jobs", "2"],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith(f"Triton {VERSION}"), proc.stdout[:200]
    checked = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    full = list(_aot.variants())
    assert len(checked) == len(full) + len(_quick_compiles()), proc.stdout  # + the unaligned quick ones
    for target in _aot.TARGETS:
        assert any(f" {target} " in line and "shared=" in line and "regs=" in line for line in checked)
    # the fast paths are reported per variant; the GEMM, attention and MoE families reach them
    for family in ("gemm_linear.", "gemm_w8a8.", "gemm_fp8.", "attention_prefill.", "moe_fused_experts."):
        lines = [line for line in checked if family in line]
        assert any(" sm_90 " in line and "mma=wgmma" in line for line in lines), family
        assert any(" gfx942 " in line and "mma=mfma" in line for line in lines), family


_PROBE = textwrap.dedent('''
    import triton
    import triton.language as tl

    from graft.kernels.triton._aot import variant


    @triton.jit
    def probe_matmul(a_ptr, b_ptr, c_ptr, K, stride_am, stride_bk, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + ks)[None, :])
            b = tl.load(b_ptr + (k0 + ks)[:, None] * stride_bk + cols[None, :])
            acc = tl.dot(a, b, acc, input_precision="tf32")
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc)


    TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
    # fp32 128x128x64 in 4 stages: 262,144 B of shared memory, over the 232,448 B of sm_90.
    OVER = variant(probe_matmul, TILE, pointer="*fp32", options={"num_warps": 8, "num_stages": 4}, targets=("sm_90",))
    FITS = variant(probe_matmul, TILE, pointer="*fp32", options={"num_warps": 8, "num_stages": 3}, targets=("sm_90",))
''')


@pytest.mark.timeout(900)
def test_a_planted_over_limit_config_fails_and_its_fix_passes(tmp_path):
    (tmp_path / "graft_aot_limits_probe.py").write_text(_PROBE)
    code = textwrap.dedent('''
        import sys
        sys.path.insert(0, sys.argv[1])
        import graft_aot_limits_probe as probe
        from graft.kernels.triton import _aot
        for name in ("OVER", "FITS"):
            print(name, _aot.compile_all(selected=[("sm_90", getattr(probe, name))], log=print))
    ''')
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=_aot_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    over = next(line for line in proc.stdout.splitlines() if line.startswith("OVER ["))
    fits = next(line for line in proc.stdout.splitlines() if line.startswith("FITS ["))
    assert "shared memory 262,144 B > 232,448 B" in over, proc.stdout
    assert fits == "FITS []", proc.stdout


def test_limits_per_target():
    ok = {"shared": 65_536, "regs": 512, "threads": 256, "spills": 0}
    assert _aot.over_limits(ok, "gfx942") == []
    assert _aot.over_limits(dict(ok, shared=65_537), "gfx942") == ["shared memory 65,537 B > 65,536 B"]
    assert _aot.over_limits(dict(ok, regs=513), "gfx942") == ["513 VGPRs > 512"]
    assert _aot.over_limits(dict(ok, shared=232_448, regs=255), "sm_90") == []
    assert _aot.over_limits(dict(ok, shared=232_448, regs=255, threads=512), "sm_90") == [
        "255 registers x 512 threads > 65,536"]


def _compiled_side(code: str, tmp_path) -> subprocess.CompletedProcess:
    """Run ``code`` with the interpreter off (kernels are JIT functions there, not wrapped)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_aot_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def test_specialisation_is_the_jits_and_keys_follow_it(tmp_path):
    """Ints equal to 1 become constants and multiples of 16 get tt.divisibility, as in a launch;
    an unaligned launch gets neither. Cache keys change with the target, specialisation and tiles."""
    _compiled_side('''
        from graft.kernels.triton import _aot, attention_decode_paged

        v = attention_decode_paged.aot_variants()[0]
        names = v.kernel.arg_names
        _, _, sig, consts, attrs = _aot.specialise(v, "sm_90")
        assert sig["stride_kd"] == "constexpr" and consts[(names.index("stride_kd"),)] == 1
        assert sig["stride_kb"] == "i32" and ["tt.divisibility", 16] in attrs[(names.index("stride_kb"),)]
        assert ["tt.divisibility", 16] in attrs[(names.index("Q"),)]
        _, _, sig, _, attrs = _aot.specialise(v, "sm_90", aligned=False)
        assert sig["stride_kb"] == "i32" and attrs[(names.index("stride_kb"),)] == []

        key = _aot.variant_key(v, "sm_90")
        assert key == _aot.variant_key(v, "sm_90")
        assert len({key, _aot.variant_key(v, "gfx942"), _aot.variant_key(v, "sm_90", aligned=False)}) == 3
        other = _aot.variant(v.kernel, dict(v.constexprs, BLOCK_N=32), pointer=v.pointer, options=v.options,
                             values=v.values, **v.types)
        assert _aot.variant_key(other, "sm_90") != key
    ''', tmp_path)


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


        def aot_variants():
            return [variant(covered_kernel, dict(BLOCK=16))]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import graft_aot_probe

    try:
        assert _aot.uncovered([graft_aot_probe]) == ["graft_aot_probe.forgotten_kernel"]
        graft_aot_probe.aot_variants = lambda: []
        assert len(_aot.uncovered([graft_aot_probe])) == 3  # the helper is no longer reached either
    finally:
        sys.modules.pop("graft_aot_probe", None)


def test_signature_types_arguments_by_naming_convention():
    from graft.kernels.triton import attention_prefill, gemm_linear

    gemm = _aot.signature(gemm_linear.aot_variants()[0])
    assert gemm["x_ptr"] == "*bf16" and gemm["M"] == gemm["K"] == "i32" and gemm["BLOCK_K"] == "constexpr"
    tma = next(v for v in gemm_linear.aot_variants() if v.kernel is gemm_linear._linear_tma_kernel)
    sig = _aot.signature(tma)
    assert sig["x_desc"] == sig["y"] == tma.pointer.replace("*", "desc*") and sig["bias_ptr"] == tma.pointer
    desc = _aot.launch_arguments(tma)["w_desc"]  # a host-side descriptor of the plan's block, as launched
    assert list(desc.block_shape) == [tma.constexprs["BLOCK_N"], tma.constexprs["BLOCK_K"]] and desc.strides[-1] == 1
    attn = _aot.signature(attention_prefill.aot_variants()[0])
    assert attn["K"] == "*fp16" and attn["CuSeqlensQ"] == "*i32" and attn["qk_scale"] == "fp32"
    assert attn["head_dim"] == "i32" and attn["CAUSAL"] == "constexpr"


def test_variant_rejects_unknown_argument_names():
    from graft.kernels.triton import fused_silu_and_mul

    with pytest.raises(TypeError, match="BLOCK_SIZE"):
        _aot.variant(fused_silu_and_mul._silu_and_mul_kernel, dict(BLOCK_SIZE=16))


def test_spills_fail_unless_accepted_with_a_reason():
    found = {"shared": 1024, "regs": 512, "threads": 256, "spills": 104}
    (problem,) = _aot.over_limits(found, "gfx942")
    assert "104 spilled" in problem and "accept_spills" in problem
    assert _aot.over_limits(found, "gfx942", accepted_spills="the backward's dK/dV tile: measured faster") == []
    with pytest.raises(TypeError, match="unknown target"):
        _aot.variant(_aot.variants().__next__()[1].kernel, {}, accept_spills={"sm_80": "why"})


def test_fast_paths_are_read_from_the_code_and_a_scalar_dot_fails():
    from types import SimpleNamespace

    from graft.kernels.triton import fused_rms_norm, gemm_linear

    def ptx(text):
        return SimpleNamespace(asm={"ptx": text})

    assert _aot.fast_paths(ptx("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 ...\n"
                               "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r3;"), "sm_90") == {
        "mma": "wgmma", "copy": "cp.async16"}
    assert _aot.fast_paths(ptx("mma.sync.aligned.m16n8k16 ...\ncp.async.bulk.tensor.2d ..."), "sm_90") == {
        "mma": "mma.sync", "copy": "tma"}
    assert _aot.fast_paths(ptx("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];"), "sm_90")["copy"] == "vector16"
    assert _aot.fast_paths(ptx("fma.rn.f32 ...\nld.global.b16 %rs1, [ %rd1 + 0 ];"), "sm_90") == {
        "mma": None, "copy": "narrow"}
    gcn = SimpleNamespace(asm={"amdgcn": "v_mfma_f32_32x32x8_bf16 a[0:15], v[0:1]\nglobal_load_dwordx4 v[4:7], v2"})
    assert _aot.fast_paths(gcn, "gfx942") == {"mma": "mfma", "copy": "vector16"}

    bf16_gemm = next(v for v in gemm_linear.aot_variants() if v.pointer == "*bf16" and v.kernel is gemm_linear._linear_kernel)
    fp32_ieee = next(v for v in gemm_linear.aot_variants() if v.pointer == "*fp32" and v.constexprs["PRECISION"] == "ieee")
    norm = fused_rms_norm.aot_variants()[0]
    scalar = {"mma": None, "copy": "cp.async16"}
    assert "scalar" in _aot.fast_path_problems(scalar, bf16_gemm, "sm_90")[0]
    assert "MFMA" in _aot.fast_path_problems(scalar, fp32_ieee, "gfx942")[0]  # gfx942 has fp32 MFMAs
    assert _aot.fast_path_problems(scalar, fp32_ieee, "sm_90") == []  # IEEE fp32 products are FMAs by design
    assert _aot.fast_path_problems(scalar, norm, "sm_90") == []  # no tl.dot: nothing to expect
    assert _aot.fast_path_problems({"mma": "mma.sync", "copy": "cp.async16"}, bf16_gemm, "sm_90") == []
    # a 128-row tile on 8 warps must be a warp-group MMA on Hopper
    big = next(v for v in gemm_linear.aot_variants() if v.pointer == "*bf16" and v.constexprs.get("BLOCK_M") == 128
               and v.kernel is gemm_linear._linear_kernel)
    assert "not wgmma" in _aot.fast_path_problems({"mma": "mma.sync", "copy": "cp.async16"}, big, "sm_90")[0]
    assert _aot.fast_path_problems({"mma": "wgmma", "copy": "cp.async16"}, big, "sm_90") == []
    # unit strides declared: 16-byte copies expected, except in the unaligned specialisation
    narrow = {"mma": "wgmma", "copy": "narrow"}
    assert "scalar loads" in _aot.fast_path_problems(narrow, big, "sm_90")[0]
    assert _aot.fast_path_problems(narrow, big, "sm_90", aligned=False) == []
    assert "scalar loads" in _aot.fast_path_problems({"mma": "mfma", "copy": "narrow"}, big, "gfx942")[0]
    # a kernel with tensor descriptors must load by TMA on Hopper (also in the unaligned specialisation)
    tma = next(v for v in gemm_linear.aot_variants() if v.kernel is gemm_linear._linear_tma_kernel)
    assert _aot.fast_path_problems({"mma": "wgmma", "copy": "tma"}, tma, "sm_90") == []
    for found in ({"mma": "wgmma", "copy": "cp.async16"}, {"mma": "wgmma", "copy": "narrow"}):
        assert "not TMA" in _aot.fast_path_problems(found, tma, "sm_90", aligned=False)[0]
    assert "not wgmma" in _aot.fast_path_problems({"mma": "mma.sync", "copy": "tma"}, tma, "sm_90")[0]


def test_w4a16_dequantises_without_int_to_float_conversions(tmp_path):
    """W4A16's codes become floats by the magic-number bit trick (gemm_w4a16._codes_as), not an
    int-to-float conversion per weight element: the compiled code for sm_90 has none at all
    (it had 64 per K step of a 64x128 tile) and gfx942's keeps only the few scalar ones outside
    the tile (3-4; it had 35-68)."""
    code = textwrap.dedent('''
        import re
        from graft.kernels.triton import _aot, gemm_w4a16
        seen = set()
        for v in gemm_w4a16.aot_variants():
            key = (v.targets[0], v.pointer, v.constexprs["AWQ"])
            if key in seen or v.pointer == "*fp32" or v.constexprs["BLOCK_M"] != 16:
                continue
            seen.add(key)
            compiled = _aot.compile_variant(v, v.targets[0])
            if v.targets[0] == "sm_90":
                n = len(re.findall(r"cvt\\.rn\\.(?:f16|bf16|f32)\\.s32", compiled.asm["ptx"]))
            else:
                n = len(re.findall(r"v_cvt_f(?:32|16)_[iu](?:32|16)", compiled.asm["amdgcn"]))
            print("I2F", v.targets[0], v.pointer, v.constexprs["AWQ"], n)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], env=_aot_env(tmp_path), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = [line.split() for line in proc.stdout.splitlines() if line.startswith("I2F")]
    assert {(c[1], c[2]) for c in counts} >= {("sm_90", "*fp16"), ("sm_90", "*bf16"), ("gfx942", "*fp16"),
                                              ("gfx942", "*bf16")}, proc.stdout
    for _, target, pointer, awq, n in counts:
        assert int(n) <= (0 if target == "sm_90" else 4), (target, pointer, awq, n)


def _rows(table, generation=None):
    """(generation, row) for every tile row of a table keyed by architecture generation (rows
    may sit under size keys, or in (bound, row) tuples as in moe_tiles.SHAPES)."""
    if isinstance(table, dict) and any(k in table for k in _aot._LAUNCH_OPTIONS):
        yield generation, table
    elif isinstance(table, dict):
        for key, sub in table.items():
            yield from _rows(sub, key if generation is None else generation)
    elif isinstance(table, (tuple, list)):
        for sub in table:
            yield from _rows(sub, generation)


def test_waves_per_eu_only_in_amd_rows():
    """Triton's CUDA launcher refuses an option it does not know: a row for an NVIDIA generation
    (or the default / interpreter rows, which any device may take) naming waves_per_eu would
    fail every launch there."""
    import importlib
    import pkgutil

    import graft.kernels.triton as package

    amd = {"cdna1", "cdna2", "cdna3", "cdna4", "rdna3", "rdna4"}
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, table in vars(module).items():
            if not (name.isupper() and ("TILES" in name or name == "SHAPES") and isinstance(table, dict)):
                continue
            for generation, row in _rows(table):
                if "waves_per_eu" in row:
                    found.append((info.name, name, generation))
                    assert generation in amd, (info.name, name, generation, row)
    assert ("attention_prefill", "TILES", "cdna3") in found  # the check sees the rows it guards
