"""Compile every Triton kernel for GPU targets without a GPU (ahead-of-time check).

The CPU interpreter accepts code the GPU compilers reject (reading a non-constexpr
global, loop-carried values changing type, dot shapes below the MMA minimum...), so
every ``@triton.jit`` kernel is also lowered with Triton's bundled toolchains to a
cubin for sm_90 (Hopper) and an HSACO for gfx942 (MI300)::

    TRITON_INTERPRET=0 python -m graft.kernels.triton._aot [--target sm_90|gfx942]... [--quick]

Each kernel module declares what to compile in a module-level ``AOT_VARIANTS`` list of
:class:`AotVariant` (built with :func:`variant`). The first variant listed for a kernel
and target is its quick, representative one (``--quick``, what the tests compile); the
rest make up the full sweep (dtypes, flags, tile tables). :func:`uncovered` names every
``@triton.jit`` function of graft.kernels.triton that no variant compiles, directly or
as a callee, so a new kernel cannot be left out. Exit status 1 on any failure or gap.

Must run with TRITON_INTERPRET=0: under the interpreter kernels are wrapped at
definition and cannot be compiled.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pkgutil
import sys
import textwrap
import time
from dataclasses import dataclass, field

# Target name -> (Triton backend, arch, warp size), and the tile-table family tuned for it.
TARGETS = {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
FAMILY = {"sm_90": "hopper", "gfx942": "cdna3"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass
class AotVariant:
    kernel: object  # the @triton.jit function
    constexprs: dict
    types: dict = field(default_factory=dict)  # argument name -> Triton type, see signature()
    pointer: str = "*fp16"  # type of every pointer argument not named in ``types``
    options: dict = field(default_factory=dict)  # num_warps, num_stages
    targets: tuple = tuple(TARGETS)

    @property
    def name(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel.fn.__module__}.{self.kernel.fn.__name__}[{self.pointer};{flags}]"


def variant(kernel, constexprs: dict, *, pointer="*fp16", options=None, targets=None, **types) -> AotVariant:
    """One compile of ``kernel``. Arguments not in ``constexprs`` or ``types`` are typed by
    name (see :func:`signature`): pointers get ``pointer``, everything else is ``i32``
    (sizes, strides); float scalars must be named in ``types`` (``eps="fp32"``)."""
    unknown = (set(constexprs) | set(types)) - set(kernel.arg_names)
    if unknown:
        raise TypeError(f"{kernel.fn.__name__} has no argument(s) {sorted(unknown)}")
    return AotVariant(kernel, dict(constexprs), dict(types), pointer, dict(options or {}),
                      tuple(targets or TARGETS))


def per_target(table: dict):
    """(target, tile config) for each target, from a table keyed by architecture family."""
    for target in TARGETS:
        yield target, dict(table.get(FAMILY[target], table["default"]))


def split_tiles(cfg: dict) -> tuple[dict, dict]:
    """A tile config -> (its constexprs, its launch options)."""
    return ({k: v for k, v in cfg.items() if k not in _LAUNCH_OPTIONS},
            {k: v for k, v in cfg.items() if k in _LAUNCH_OPTIONS})


def signature(v: AotVariant) -> dict:
    """Triton signature of a variant. A kernel names its pointers either ``*_ptr`` (then a
    Capitalised ``M``, ``N``, ``K`` is a size) or Capitalised (``Q``, ``K``, ``Out``)."""
    names = v.kernel.arg_names
    suffixed = any(name.endswith("_ptr") for name in names)
    sig = {}
    for name in names:
        if name in v.constexprs:
            sig[name] = "constexpr"
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


def variants(targets=tuple(TARGETS), quick: bool = False):
    """(target, variant) pairs to compile; ``quick``: the first variant per kernel and target."""
    seen = set()
    for module in _modules(public_only=True):
        for v in getattr(module, "AOT_VARIANTS", ()):
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
    covered = reachable({v.kernel for m in modules for v in getattr(m, "AOT_VARIANTS", ())})
    return [f"{fn.fn.__module__}.{fn.fn.__name__}" for fn in jit_functions(modules) if fn not in covered]


# --- compiling -------------------------------------------------------------------------


def compile_variant(v: AotVariant, target: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp_size = TARGETS[target]
    sig = signature(v)
    # Pointers 16-byte aligned, as torch allocations are: the vectorised load paths get compiled.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(v.kernel.arg_names) if sig[name].startswith("*")}
    src = ASTSource(fn=v.kernel, signature=sig, constexprs=v.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget(backend, arch, warp_size), options={"num_warps": 4, **v.options})
    binary = "cubin" if backend == "cuda" else "hsaco"
    if not compiled.asm.get(binary):
        raise RuntimeError(f"no {binary} produced")
    return compiled


def compile_all(targets=tuple(TARGETS), quick: bool = False, log=None) -> list[str]:
    """Compile every variant for every target; returns the failures (all of them, not the first)."""
    failures = []
    for target, v in variants(targets, quick):
        start = time.perf_counter()
        try:
            compile_variant(v, target)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - report every failure
            status = "FAILED"
            failures.append(f"{target} {v.name}: {type(exc).__name__}: {exc}")
        if log:
            log(f"{status:6} {target:6} {time.perf_counter() - start:5.1f}s {v.name}")
    return failures


def main(argv=None) -> int:
    from graft.platform import triton_interpret

    parser = argparse.ArgumentParser(prog="python -m graft.kernels.triton._aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="GPU target (repeatable; default: all of them)")
    parser.add_argument("--quick", action="store_true", help="one representative variant per kernel and target")
    args = parser.parse_args(argv)
    if triton_interpret():
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    problems = [f"no AOT variant compiles {name} (add one to its module's AOT_VARIANTS)" for name in uncovered()]
    targets = tuple(args.target or TARGETS)
    problems += compile_all(targets, args.quick, log=lambda line: print(line, flush=True))
    for problem in problems:
        print("FAILED", problem)
    print(f"{len(problems)} problem(s) for {', '.join(targets)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
