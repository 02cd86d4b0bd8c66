"""Compile the attention kernels for GPU targets without a GPU (ahead-of-time check).

The CPU interpreter accepts things the compiler rejects (non-constexpr globals, type
mismatches between loop-carried values...), so the tests also lower each kernel to
PTX/cubin for sm_90 and to an HSACO for gfx942 with Triton's bundled toolchains.
Must run with TRITON_INTERPRET=0 (the kernels are wrapped for the interpreter at
definition otherwise), hence a module that is run as a subprocess::

    TRITON_INTERPRET=0 python -m graft.kernels.triton._attention_aot prefill:cuda:fp16 decode:hip:bf16
"""
from __future__ import annotations

import sys

_POINTERS_INT32 = {"CuSeqlensQ", "CuSeqlensK", "BlockTables", "SeqLens"}


def _signature(kernel, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    sig, const = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            const[(i,)] = constexprs[name]
        elif name[0].isupper():  # tensors are the capitalised arguments
            sig[name] = "*i32" if name in _POINTERS_INT32 else "*fp32" if name.startswith("Part") else f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig, const


def _kernels(which: str, dtype: str):
    from graft.kernels.triton import attention_decode, attention_prefill

    precision = "ieee" if dtype == "fp32" else "tf32"
    if which == "prefill":
        yield attention_prefill._prefill_kernel, dict(
            GROUP=4, CAUSAL=True, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, UPCAST=False, PRECISION=precision
        )
    elif which == "decode":
        for single in (True, False):
            yield attention_decode._decode_kernel, dict(
                GROUP=4, SINGLE_PASS=single, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, UPCAST=False, PRECISION=precision
            )
        yield attention_decode._combine_kernel, dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128)
    else:
        raise SystemExit(f"unknown kernel family {which!r} (prefill, decode)")


def compile_kernels(which: str, backend: str, dtype: str) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32) if backend == "cuda" else GPUTarget("hip", "gfx942", 64)
    done = []
    for kernel, constexprs in _kernels(which, dtype):
        sig, const = _signature(kernel, dtype, constexprs)
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const), target=target,
                                  options={"num_warps": 4})
        binary = "cubin" if backend == "cuda" else "hsaco"
        if binary not in compiled.asm:
            raise RuntimeError(f"{kernel.__name__}: no {binary} produced")
        done.append(f"{kernel.__name__}:{backend}:{dtype}")
    return done


def main(argv) -> int:
    from graft.platform import triton_interpret

    if triton_interpret():
        raise SystemExit("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
    for spec in argv:
        which, backend, dtype = spec.split(":")
        for name in compile_kernels(which, backend, dtype):
            print("compiled", name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
