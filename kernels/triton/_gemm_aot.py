"""Compile the GEMM kernels for GPU targets without a GPU (Triton ahead-of-time), so that
GPU-only compile errors (dot shapes, dtype rules, constexpr branches the interpreter
accepts) show up on CPU-only machines too.

    TRITON_INTERPRET=0 python -m graft.kernels.triton._gemm_aot [cuda:90] [hip:gfx942] [--all]

Default targets: cuda:90 (Hopper) and hip:gfx942 (MI300). ``--all`` compiles every
activation and both tile tables; the default compiles one variant of each kernel per table.
Exit status 1 if any compile failed. Must run with TRITON_INTERPRET=0 (the interpreter
wraps kernels at definition, and they can then not be compiled).
"""
from __future__ import annotations

import sys


def _signature(kernel, pointer_types, constexprs):
    pointers = iter(pointer_types)
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = next(pointers)
        else:
            sig[name] = "i32"
    return sig


def variants(everything: bool = False, quick: bool = False):
    """(kernel, pointer types, constexprs, launch options) to compile; ``quick``: one per kernel."""
    from graft.kernels.triton import gemm_dense, gemm_w4a16, gemm_w8a8

    def tiles(cfg):
        return {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}, {
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}

    tables = ("large_m",) if quick else ("large_m", "small_m")
    for table in tables:
        blocks, opts = tiles(gemm_dense.TILES[table]["hopper"])
        for dt in ("fp16", "bf16", "fp32") if everything else ("bf16",):
            for act in ("none", "relu", "gelu", "gelu_erf", "silu") if everything else ("gelu",):
                c = dict(HAS_BIAS=True, ACTIVATION=act, UPCAST=False, PRECISION="ieee", **blocks)
                yield gemm_dense._linear_kernel, [f"*{dt}"] * 4, c, opts
        blocks, opts = tiles(gemm_w8a8.TILES[table]["hopper"])
        yield gemm_w8a8._w8a8_kernel, ["*i8", "*i8", "*fp32", "*fp32", "*fp32", "*bf16"], dict(HAS_BIAS=True, **blocks), opts
        blocks, opts = tiles(gemm_w4a16.TILES[table]["hopper"])
        for awq in (True,) if quick else (False, True):
            c = dict(AWQ=awq, HAS_ZEROS=True, HAS_BIAS=True, UPCAST=False, PRECISION="ieee", **blocks)
            yield gemm_w4a16._w4a16_kernel, ["*fp16", "*i32", "*fp16", "*i32", "*fp16", "*fp16"], c, opts


def compile_all(targets, everything=False, quick=False) -> list:
    """Compile every variant for every target; returns the failures as strings."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for spec in targets:
        backend, arch = spec.split(":")
        target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
        for kernel, pointers, constexprs, opts in variants(everything, quick):
            src = ASTSource(fn=kernel, signature=_signature(kernel, pointers, constexprs), constexprs=constexprs)
            try:
                triton.compile(src, target=target, options=opts)
            except Exception as exc:  # report every failure, not only the first
                failures.append(f"{spec} {kernel.fn.__name__} {constexprs}: {type(exc).__name__}: {exc}")
    return failures


def main(argv=None) -> int:
    from graft.platform import triton_interpret

    argv = list(sys.argv[1:] if argv is None else argv)
    if triton_interpret():
        print("run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    everything = "--all" in argv
    targets = [a for a in argv if a != "--all"] or ["cuda:90", "hip:gfx942"]
    failures = compile_all(targets, everything)
    for f in failures:
        print("FAILED", f)
    print(f"{len(failures)} compile failures for {', '.join(targets)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
