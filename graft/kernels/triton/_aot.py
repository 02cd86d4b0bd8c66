"""Compile every Triton kernel for GPU targets without a GPU (ahead-of-time check).

The CPU interpreter accepts code the GPU compilers reject (reading a non-constexpr
global, loop-carried values changing type, dot shapes below the MMA minimum...) and
knows nothing of shared memory or registers, so every ``@triton.jit`` kernel is also
lowered with Triton's bundled toolchains to a cubin for sm_90 (Hopper) and an HSACO for
gfx942 (MI300), and each binary's resources are checked against the target's limits::

    TRITON_INTERPRET=0 python -m graft.kernels.triton._aot [--target sm_90|gfx942]... [--quick]

Each kernel module declares what its launchers can launch in a module-level function
``aot_variants()`` returning a list of :class:`AotVariant` (built with :func:`variant`), derived
from the same tile tables and fitting rules the launchers use; the check calls it
(:func:`module_variants`), so importing a kernel module builds none. A variant is compiled with the
JIT's own specialisation (Triton's binder turns the variant's example argument values
into the signature, constants and ``tt.divisibility`` attributes exactly as a launch
does: an int equal to 1 becomes a constant, a multiple of 16 is marked divisible): by
default every int is a multiple of 16 and every pointer 16-byte aligned (real model
shapes; also the case that pipelines deepest and needs the most shared memory), with
``values`` overriding (unit strides: ``stride_d=1``). The first variant of each kernel and
target (its quick one, ``--quick``) is also compiled unaligned (odd ints), the other
specialisation a launch can hit.

Per variant it prints shared memory, registers, spills and the fast paths the code uses
(:func:`fast_paths`: wgmma / mma.sync / MFMA, TMA / 16-byte copies), and fails when shared
memory or registers exceed the target's limits (:data:`LIMITS`), when it spills (unless the
variant's ``accept_spills`` gives the reason), or when its code regresses to scalar
(:func:`fast_path_problems`). Run it with the GPU image's Triton (3.6: ``PYTHONPATH=.venv-triton36``). :func:`uncovered` names every
``@triton.jit`` function of graft.kernels.triton that no variant compiles, directly or as
a callee, so a new kernel cannot be left out. Exit status 1 on any failure or gap.

Must run with TRITON_INTERPRET=0: under the interpreter kernels are wrapped at
definition and cannot be compiled.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

# Target name -> (Triton backend, arch, warp size), and the tile-table generation tuned for it.
TARGETS = {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
GENERATION = {"sm_90": "hopper", "gfx942": "cdna3"}
# Launch options a tile row may carry (waves_per_eu: AMD only, the occupancy the compiler fits
# its VGPRs to; a row for an NVIDIA generation never names it, Triton's CUDA launcher refuses it).
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "waves_per_eu")

# Per-block limits. sm_90 (H100/H200): 227 KiB of shared memory per block (opt-in maximum),
# 255 registers per thread and 64K per block. gfx942 (MI300): 64 KiB of LDS per workgroup,
# 512 VGPRs per lane (256 architectural + 256 accumulation).
LIMITS = {
    "sm_90": {"shared": 232_448, "regs_per_thread": 255, "regs_per_block": 65_536},
    "gfx942": {"shared": 65_536, "vgprs": 512},
}
ALIGNED_INT = 4096  # default example value of an int argument: a multiple of 16
UNALIGNED_INT = 4097  # ... for the unaligned specialisation (not 1, not a multiple of 16)


@dataclass
class AotVariant:
    kernel: Any  # the @triton.jit function (triton is not analysed by the type checker)
    constexprs: dict
    types: dict = field(default_factory=dict)  # argument name -> Triton type, see signature()
    pointer: str = "*fp16"  # type of every pointer argument not named in ``types``
    options: dict = field(default_factory=dict)  # num_warps, num_stages
    targets: tuple = tuple(TARGETS)
    values: dict = field(default_factory=dict)  # example values of int arguments (default ALIGNED_INT)
    accept_spills: dict = field(default_factory=dict)  # target (or "<target> unaligned") -> why spills are accepted
    descriptors: dict = field(default_factory=dict)  # argument name -> block shape of a 2-D TMA descriptor

    @property
    def name(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel.fn.__module__}.{self.kernel.fn.__name__}[{self.pointer};{flags}]"


def variant(kernel, constexprs: dict, *, pointer="*fp16", options=None, targets=None, values=None,
            accept_spills=None, descriptors=None, **types) -> AotVariant:
    """One compile of ``kernel``. Arguments not in ``constexprs`` or ``types`` are typed by
    name (see :func:`signature`): pointers get ``pointer``, everything else is ``i32``
    (sizes, strides); float scalars must be named in ``types`` (``eps="fp32"``). ``values``
    gives example values of int arguments where the default (a multiple of 16) is not what
    a launch passes, e.g. ``stride_d=1`` for a unit stride (the JIT makes it a constant).
    ``accept_spills``: target -> the reason spills there are accepted (else a spill fails);
    ``"<target> unaligned"`` accepts them in the unaligned specialisation only.
    ``descriptors``: argument name -> block shape of a 2-D tensor descriptor argument (a
    host-side ``TensorDescriptor`` over ``pointer``'s dtype, or ``types[name]``'s), as the
    launcher passes one."""
    unknown = (set(constexprs) | set(types) | set(values or {}) | set(descriptors or {})) - set(kernel.arg_names)
    if unknown:
        raise TypeError(f"{kernel.fn.__name__} has no argument(s) {sorted(unknown)}")
    bad = set(accept_spills or {}) - set(TARGETS) - {f"{t} unaligned" for t in TARGETS}
    if bad:
        raise TypeError(f"accept_spills names unknown target(s) {sorted(bad)}; keys are a target of "
                        f"{sorted(TARGETS)}, optionally followed by ' unaligned'")
    return AotVariant(kernel, dict(constexprs), dict(types), pointer, dict(options or {}),
                      tuple(targets or TARGETS), dict(values or {}), dict(accept_spills or {}),
                      {name: tuple(block) for name, block in (descriptors or {}).items()})


def per_target(table: dict):
    """(target, tile config) for each target, from a table keyed by architecture generation."""
    for target in TARGETS:
        yield target, dict(table.get(GENERATION[target], table["default"]))


def split_tiles(cfg: dict) -> tuple[dict, dict]:
    """A tile config -> (its constexprs, its launch options)."""
    return ({k: v for k, v in cfg.items() if k not in _LAUNCH_OPTIONS},
            {k: v for k, v in cfg.items() if k in _LAUNCH_OPTIONS})


def _constexpr_names(kernel) -> set:
    """Arguments annotated ``tl.constexpr`` (also for interpreted kernels, which lack ``params``)."""
    params = inspect.signature(kernel.fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(getattr(p.annotation, "__name__", p.annotation))}


def signature(v: AotVariant) -> dict:
    """Triton signature of a variant. A kernel names its pointers either ``*_ptr`` (then a
    Capitalised ``M``, ``N``, ``K`` is a size) or Capitalised (``Q``, ``K``, ``Out``)."""
    names = v.kernel.arg_names
    suffixed = any(name.endswith("_ptr") for name in names)
    sig = {}
    declared = _constexpr_names(v.kernel)
    for name in names:
        if name in v.constexprs or name in declared:  # an omitted constexpr takes its default
            sig[name] = "constexpr"
        elif name in v.descriptors:
            sig[name] = "desc" + v.types.get(name, v.pointer)
        elif name in v.types:
            sig[name] = v.types[name]
        elif name.endswith("_ptr") if suffixed else name[0].isupper():
            sig[name] = v.pointer
        else:
            sig[name] = "i32"
    return sig


# --- what there is to compile --------------------------------------------------------


def _modules(public_only: bool):
    import graft.kernels.triton as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if public_only and info.name.startswith("_"):
            continue
        yield importlib.import_module(f"{package.__name__}.{info.name}")


def module_variants(module) -> list:
    """The AOT variants a kernel module declares (its ``aot_variants()``; none without one)."""
    build = getattr(module, "aot_variants", None)
    return list(build()) if build is not None else []


def variants(targets=tuple(TARGETS), quick: bool = False):
    """(target, variant) pairs to compile; ``quick``: the first variant per kernel and target."""
    seen = set()
    for module in _modules(public_only=True):
        for v in module_variants(module):
            for target in targets:
                if target not in v.targets or (quick and (v.kernel, target) in seen):
                    continue
                seen.add((v.kernel, target))
                yield target, v


def _is_jit(obj) -> bool:
    from triton.runtime.jit import KernelInterface

    return isinstance(obj, KernelInterface) and hasattr(obj, "fn")


def _callees(jit_fn) -> set:
    """The @triton.jit functions ``jit_fn`` calls by name (``f(...)`` or ``module.f(...)``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(jit_fn.fn)))
    scope = jit_fn.fn.__globals__
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts, target = [], node.func
        while isinstance(target, ast.Attribute):
            parts.append(target.attr)
            target = target.value
        if not isinstance(target, ast.Name) or target.id not in scope:
            continue
        obj = scope[target.id]
        for attr in reversed(parts):
            obj = getattr(obj, attr, None)
        if _is_jit(obj):
            found.add(obj)
    return found


def reachable(kernels) -> set:
    """``kernels`` and every @triton.jit function they call, transitively."""
    todo, done = list(kernels), set()
    while todo:
        fn = todo.pop()
        if fn not in done:
            done.add(fn)
            todo.extend(_callees(fn))
    return done


def jit_functions(modules=None) -> list:
    """Every @triton.jit function defined in ``modules`` (default: all of graft.kernels.triton)."""
    found = []
    for module in modules if modules is not None else _modules(public_only=False):
        for obj in vars(module).values():
            if _is_jit(obj) and obj.fn.__module__ == module.__name__ and obj not in found:
                found.append(obj)
    return found


def uncovered(modules=None) -> list[str]:
    """Qualified names of the @triton.jit functions no AOT variant compiles."""
    modules = list(modules) if modules is not None else list(_modules(public_only=False))
    covered = reachable({v.kernel for m in modules for v in module_variants(m)})
    return [f"{fn.fn.__module__}.{fn.fn.__name__}" for fn in jit_functions(modules) if fn not in covered]


# --- compiling ---------------------------------------------------------------------

_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i8": "int8",
                 "u8": "uint8", "i16": "int16", "i32": "int32", "i64": "int64", "i1": "bool", "fp8e4nv": "float8_e4m3fn",
                 "fp8e5": "float8_e5m2", "fp8e4b8": "float8_e4m3fnuz", "fp8e5b16": "float8_e5m2fnuz"}


def launch_arguments(v: AotVariant, aligned: bool = True) -> dict:
    """Example arguments of a launch of ``v``, by name (constexprs included)."""
    import torch
    from triton.runtime.jit import MockTensor  # data_ptr() == 0: 16-byte aligned, as torch allocations

    sig = signature(v)
    args = {}
    for name in v.kernel.arg_names:
        kind = sig[name]
        if kind == "constexpr":
            if name in v.constexprs:
                args[name] = v.constexprs[name]
        elif kind.startswith("*"):
            args[name] = MockTensor(getattr(torch, _TORCH_DTYPES[kind[1:]]))
        elif kind.startswith("desc*"):  # TMA needs 16-byte aligned row strides whatever the sizes
            from triton.tools.tensor_descriptor import TensorDescriptor

            size = ALIGNED_INT if aligned else UNALIGNED_INT
            args[name] = TensorDescriptor(MockTensor(getattr(torch, _TORCH_DTYPES[kind[5:]])), [size, size],
                                          [ALIGNED_INT, 1], list(v.descriptors[name]))
        elif kind.startswith(("fp", "bf")):
            args[name] = 1.5  # floats are never specialised
        elif name in v.values:
            args[name] = v.values[name]
        elif kind == "i64":
            args[name] = 2**33 + (0 if aligned else 1)
        else:
            args[name] = ALIGNED_INT if aligned else UNALIGNED_INT
    return args


def specialise(v: AotVariant, target: str, aligned: bool = True):
    """(backend, options, signature, constexprs, attrs) as Triton's JIT derives them for
    a launch of ``v`` on ``target`` (its own binder and argument packing)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend_name, arch, warp_size = TARGETS[target]
    backend = make_backend(GPUTarget(backend_name, arch, warp_size))
    kwargs = {"num_warps": 4, **v.options, **launch_arguments(v, aligned)}
    binder = create_function_from_signature(v.kernel.signature, v.kernel.params, backend)
    bound_args, specialization, options = binder(**kwargs)
    options, sig, consts, attrs = v.kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return backend, options, sig, consts, attrs


def compile_variant(v: AotVariant, target: str, aligned: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend_name, arch, warp_size = TARGETS[target]
    _, options, sig, consts, attrs = specialise(v, target, aligned)
    src = ASTSource(fn=v.kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget(backend_name, arch, warp_size), options=options.__dict__)
    binary = "cubin" if backend_name == "cuda" else "hsaco"
    if not compiled.asm.get(binary):
        raise RuntimeError(f"no {binary} produced")
    return compiled


def _cuobjdump() -> str:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else "cuobjdump"


def resources(compiled, target: str) -> dict:
    """shared (bytes per block), regs (per thread), spills (bytes of local memory or scratch per thread)."""
    found = {"shared": int(compiled.metadata.shared), "threads": int(compiled.metadata.num_warps) * TARGETS[target][2]}
    if TARGETS[target][0] == "cuda":
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        local = re.search(r"LOCAL:(\d+)", usage)
        if regs is None:
            raise RuntimeError(f"cuobjdump -res-usage gave no register count: {usage!r}")
        found.update(regs=int(regs.group(1)), spills=int(local.group(1)) if local else 0)
    else:
        text = compiled.asm["amdgcn"]

        def field_(name):
            m = re.search(rf"\.{name}:\s+(\d+)", text)
            return int(m.group(1)) if m else 0

        # .vgpr_count already counts the accumulation registers (.agpr_count) on gfx90a and later.
        # Spills: VGPRs spilled plus scratch bytes (SGPR spills go to VGPR lanes, not memory).
        found.update(regs=field_("vgpr_count"),
                     spills=field_("vgpr_spill_count") + field_("private_segment_fixed_size"))
    return found


_CP_ASYNC_16 = re.compile(r"cp\.async\.cg\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x10|16)\b")
_LD_16 = re.compile(r"ld\.global(?:\.[a-z0-9:]+)*\.v4\.(?:b32|f32|u32|s32)|ld\.global(?:\.[a-z0-9:]+)*\.v2\.(?:b64|f64|u64)")
_GCN_16 = re.compile(r"\b(?:global|buffer)_load_(?:lds_)?dwordx4\b")


def fast_paths(compiled, target: str) -> dict:
    """Which of the target's fast paths the compiled code uses: ``mma`` (sm_90: ``wgmma``, else
    ``mma.sync``; gfx942: ``mfma``; None: the products are scalar FMAs) and ``copy``, the widest
    global-to-register/shared path (sm_90: ``tma`` for cp.async.bulk, ``cp.async16``,
    ``vector16`` for 16-byte loads, ``cp.async`` for 4/8-byte ones; gfx942: ``vector16`` for
    dwordx4 loads; ``narrow``: nothing wider than 8 bytes)."""
    if TARGETS[target][0] == "cuda":
        ptx = compiled.asm["ptx"]
        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync.aligned" in ptx else None
        copy = ("tma" if "cp.async.bulk" in ptx else "cp.async16" if _CP_ASYNC_16.search(ptx)
                else "vector16" if _LD_16.search(ptx) else "cp.async" if "cp.async." in ptx else "narrow")
    else:
        gcn = compiled.asm["amdgcn"]
        mma = "mfma" if "v_mfma" in gcn else None
        copy = "vector16" if _GCN_16.search(gcn) else "narrow"
    return {"mma": mma, "copy": copy}


def uses_dot(v: AotVariant) -> bool:
    """Whether the variant's kernel (or a function it calls) multiplies tiles with tl.dot."""
    return any("tl.dot(" in inspect.getsource(fn.fn) for fn in reachable({v.kernel}))


FAST_COPIES = {"sm_90": ("tma", "cp.async16", "vector16"), "gfx942": ("vector16",)}


def expected_mma(v: AotVariant, target: str) -> str | None:
    """The MMA a variant's compiled code must use on ``target`` (None: none is expected).
    A kernel with tl.dot must reach the tensor cores: on gfx942 MFMA (it has fp32 MFMAs too);
    on sm_90 ``wgmma`` for tiles of 64+ rows on a warp group or more (what Triton lowers them
    to), ``mma`` (wgmma or mma.sync) for smaller ones, and none for fp32 with IEEE precision
    (those products are FMAs by design)."""
    if not uses_dot(v):
        return None
    if target != "sm_90":
        return "mfma"
    fp32_ieee = v.pointer == "*fp32" and v.constexprs.get("PRECISION", "ieee") == "ieee" and not any(
        t in ("*bf16", "*fp16", "*i8", "*fp8e4nv") for t in v.types.values())
    if fp32_ieee:
        return None
    rows = v.constexprs.get("BLOCK_M", 0)
    return "wgmma" if rows >= 64 and v.options.get("num_warps", 4) % 4 == 0 else "mma"


def fast_path_problems(found: dict, v: AotVariant, target: str, aligned: bool = True) -> list[str]:
    """A regression to scalar code: a dot without the MMA :func:`expected_mma` wants, or (in
    a variant declaring unit strides, aligned) tiles loaded without the target's 16-byte
    paths (:data:`FAST_COPIES`); a variant with tensor descriptors must load by TMA on sm_90."""
    want, problems = expected_mma(v, target), []
    if want == "wgmma" and found.get("mma") != "wgmma":
        problems.append(f"tl.dot on a {v.constexprs.get('BLOCK_M')}-row tile compiled to {found.get('mma') or 'FMAs'}, "
                        f"not wgmma (a regression from Hopper's warp-group MMA)")
    elif want is not None and found.get("mma") is None:
        problems.append(f"tl.dot compiled to scalar FMAs: no {'wgmma/mma.sync' if target == 'sm_90' else 'MFMA'} "
                        f"instruction (a regression to scalar code)")
    if v.descriptors and target == "sm_90" and found.get("copy") != "tma":
        problems.append(f"tiles loaded by {found.get('copy')} copies, not TMA (cp.async.bulk.tensor): the kernel's "
                        f"tensor descriptors were lowered to pointer loads")
        return problems
    unit = any(name.startswith("stride") and value == 1 for name, value in v.values.items())
    if want is not None and aligned and unit and found.get("copy") not in FAST_COPIES[target]:
        problems.append(f"tiles loaded by {found.get('copy')} copies, not {' / '.join(FAST_COPIES[target])} "
                        f"(a regression to scalar loads)")
    return problems


def over_limits(found: dict, target: str, accepted_spills: str | None = None) -> list[str]:
    """What in ``found`` (see :func:`resources`) exceeds ``target``'s limits; spills count
    unless ``accepted_spills`` says why they are accepted."""
    limits, problems = LIMITS[target], []
    if found.get("spills") and not accepted_spills:
        problems.append(f"{found['spills']} spilled {'bytes' if target == 'sm_90' else 'VGPRs/scratch bytes'} "
                        f"(accept with a reason in the variant's accept_spills, or fit the tile)")
    if found["shared"] > limits["shared"]:
        problems.append(f"shared memory {found['shared']:,} B > {limits['shared']:,} B")
    if target == "sm_90":
        if found["regs"] > limits["regs_per_thread"]:
            problems.append(f"{found['regs']} registers per thread > {limits['regs_per_thread']}")
        if found["regs"] * found["threads"] > limits["regs_per_block"]:
            problems.append(f"{found['regs']} registers x {found['threads']} threads > {limits['regs_per_block']:,}")
    elif found["regs"] > limits["vgprs"]:
        problems.append(f"{found['regs']} VGPRs > {limits['vgprs']}")
    return problems


RESOURCES_VERSION = 3  # bump when resources() or fast_paths() changes what it records
CACHE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_resources.json")


def variant_key(v: AotVariant, target: str, aligned: bool = True) -> str:
    """What a compile's result depends on: Triton's version, the target, the source of the
    kernel and of every @triton.jit function it reaches, the JIT's specialisation and the
    launch options. Equal keys compile to the same binary, so a recorded result stands in."""
    import hashlib
    import json

    import triton

    _, _, sig, consts, attrs = specialise(v, target, aligned)
    sources = sorted(f"{fn.fn.__module__}.{fn.fn.__qualname__}\n{inspect.getsource(fn.fn)}" for fn in reachable({v.kernel}))
    blob = json.dumps([RESOURCES_VERSION, triton.__version__, target, aligned, sources, sig, repr(sorted(consts.items())),
                       repr(sorted(attrs.items())), sorted(v.options.items()),
                       os.environ.get("TRITON_DEFAULT_FP_FUSION", "")], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


RECORDED = ("shared", "regs", "spills", "threads", "mma", "copy")


def triton_version() -> str:
    import triton

    return triton.__version__


def load_cache(path: str = CACHE_FILE) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def save_cache(entries: dict, path: str = CACHE_FILE) -> None:
    import json

    with open(path, "w") as f:
        json.dump(dict(sorted(entries.items())), f, indent=0, sort_keys=True)
        f.write("\n")


def _compile_job(job):
    target, v, aligned = job
    compiled = compile_variant(v, target, aligned)
    return resources(compiled, target) | fast_paths(compiled, target)


_FORKED_TODO: list = []  # what forked compile workers index into (variants do not pickle)


def _forked_job(index: int):
    return _compile_job(_FORKED_TODO[index])


def compile_all(targets=tuple(TARGETS), quick: bool = False, log=None, selected=None, cache=None,
                jobs: int = 1) -> list[str]:
    """Compile every variant for every target and check its resources; returns the failures
    (all of them, not the first). ``selected``: (target, variant) pairs instead of all of them.
    ``cache`` (a dict, see :func:`variant_key`): results recorded for unchanged variants are
    checked without compiling; new results are added to it. ``jobs``: compile processes."""
    todo, first = [], set()
    for target, v in (selected if selected is not None else variants(targets, quick)):
        todo.append((target, v, True))
        if (v.kernel, target) not in first:  # the quick variant: also the unaligned specialisation
            first.add((v.kernel, target))
            todo.append((target, v, False))
    keys = [variant_key(v, target, aligned) if cache is not None else None for target, v, aligned in todo]
    misses = [i for i, key in enumerate(keys) if cache is None or key not in cache]
    results = {}
    if jobs > 1 and len(misses) > 1:
        import concurrent.futures
        import multiprocessing

        _FORKED_TODO[:] = todo
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {i: pool.submit(_forked_job, i) for i in misses}
            for i, future in futures.items():
                start = time.perf_counter()
                try:
                    results[i] = (future.result(), time.perf_counter() - start)
                except Exception as exc:  # noqa: BLE001 - report every failure
                    results[i] = (exc, 0.0)
    failures = []
    for i, (target, v, aligned) in enumerate(todo):
        name = v.name if aligned else f"{v.name} (unaligned)"
        start = time.perf_counter()
        if i in results:
            found, seconds = results[i]
        elif cache is not None and keys[i] in cache:
            found, seconds = dict(cache[keys[i]]), None
        else:
            try:
                found = _compile_job((target, v, aligned))
            except Exception as exc:  # noqa: BLE001
                found = exc
            seconds = time.perf_counter() - start
        usage = ""
        if isinstance(found, Exception):
            status = "FAILED"
            failures.append(f"{target} {name}: {type(found).__name__}: {str(found)[:2000]}")
        else:
            if cache is not None:
                cache[keys[i]] = {k: found[k] for k in RECORDED} | {"name": name, "target": target,
                                                                    "triton": triton_version()}
            accepted = v.accept_spills.get(target) or (None if aligned else v.accept_spills.get(f"{target} unaligned"))
            usage = (f"shared={found['shared']:>6} regs={found['regs']:>3} spills={found['spills']:>4} "
                     f"mma={found['mma'] or '-':<8} copy={found['copy']:<10} ")
            problems = over_limits(found, target, accepted) + fast_path_problems(found, v, target, aligned)
            status = "OVER" if problems else "ok"
            if found["spills"] and accepted and not problems:
                usage += f"(spills accepted: {accepted}) "
            failures += [f"{target} {name}: {p}" for p in problems]
        if log:
            took = "cached" if seconds is None else f"{seconds:5.1f}s"
            log(f"{status:6} {target:6} {took:>6} {usage}{name}")
    return failures


def main(argv=None) -> int:
    from graft.platform import triton_interpret

    parser = argparse.ArgumentParser(prog="python -m graft.kernels.triton._aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="GPU target (repeatable; default: all of them)")
    parser.add_argument("--quick", action="store_true", help="one representative variant per kernel and target")
    parser.add_argument("--cache", action="store_true",
                        help=f"take results of unchanged variants from {os.path.basename(CACHE_FILE)} (compile the rest)")
    parser.add_argument("--update-cache", action="store_true",
                        help="compile what changed and rewrite the cache file with the results of this run")
    parser.add_argument("--jobs", type=int, default=1, help="compile processes (default 1)")
    parser.add_argument("--module", action="append",
                        help="only the variants of this kernel module (repeatable; e.g. gemm_linear): a long "
                             "refresh in parts")
    args = parser.parse_args(argv)
    if triton_interpret():
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    print(f"Triton {triton_version()}", flush=True)
    problems = [f"no AOT variant compiles {name} (add one to its module's aot_variants())" for name in uncovered()]
    targets = tuple(args.target or TARGETS)
    cache = load_cache() if (args.cache or args.update_cache) else None
    selected = None
    if args.module:
        unknown = set(args.module) - {m.__name__.rsplit(".", 1)[1] for m in _modules(public_only=False)}
        if unknown:
            print(f"unknown --module {sorted(unknown)}: kernel modules of graft.kernels.triton", file=sys.stderr)
            return 2
        selected = [(t, v) for t, v in variants(targets, args.quick)
                    if v.kernel.fn.__module__.rsplit(".", 1)[1] in args.module]
    problems += compile_all(targets, args.quick, log=lambda line: print(line, flush=True), cache=cache, selected=selected,
                            jobs=args.jobs)
    if args.update_cache:  # keep the entries of today's full set (stale ones go), other Triton versions' too
        wanted = {variant_key(v, t, True) for t, v in variants(targets)}
        wanted |= {variant_key(v, t, False) for t, v in variants(targets, quick=True)}
        assert cache is not None  # loaded above whenever --update-cache is given
        version = triton_version()
        save_cache({k: e for k, e in cache.items()
                    if k in wanted or e["target"] not in targets or e.get("triton", version) != version
                    or (args.module and e["name"].split("[")[0].rsplit(".", 2)[1] not in args.module)})
    for problem in problems:
        print("FAILED", problem)
    print(f"{len(problems)} problem(s) for {', '.join(targets)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
