"""nccl-tests style benchmark of graft's collectives against the plain library collective.

    python -m graft.tools.bench.collectives_sweep                       # CPU/gloo, 2 ranks, quick
    python -m graft.tools.bench.collectives_sweep overhead --ranks 2     # graft's own cost (``overhead()``)
    python -m graft.tools.bench.collectives_sweep --backend nccl --ranks 8 \\
        --min-bytes 8 --max-bytes 512MiB --factor 2 --iters 50      # one GPU node

Every row is one (op, implementation, size). ``size`` is the full buffer in bytes, as in
nccl-tests: the all-reduce buffer, the all-gather *output*, the reduce-scatter *input*.
``algbw = size / time``; ``busbw = algbw * factor`` with the per-collective bus factor
(all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``), so busbw is
comparable with the hardware link bandwidth. ``vs_library`` is the library row's time
divided by this row's, both measured in the same run on the same buffers (> 1: faster).
Absolute times describe this machine only; claims are made with ratios.

Implementations per op: ``library`` (torch.distributed, what graft's reference runs),
``graft`` (the public entry point: a cached per-signature plan + the selected impl), ``oneshot`` /
``twoshot`` (forced regardless of thresholds, to show where they pay), ``int8``
(quantized all-gather vs the exact one), ``overlap`` (chunked GEMM + collective vs
GEMM then collective, for M x 256 x 256 per-rank GEMMs sized so the collective moves
``size`` bytes).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta

from graft.tools.bench import timing

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather_quantized": lambda n: (n - 1) / n,
    "gemm_reduce_scatter": lambda n: (n - 1) / n,
    "all_gather_gemm": lambda n: (n - 1) / n,
}
DEFAULT_OPS = tuple(BUS_FACTOR)
COLUMNS = ("op", "impl", "size", "count", "type", "time_us", "algbw_GBps", "busbw_GBps", "vs_library")
GEMM_K = GEMM_N = 256


def parse_bytes(text: str) -> int:
    text = text.strip().lower()
    for suffix, factor in (("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10), ("g", 1 << 30), ("m", 1 << 20),
                           ("k", 1 << 10), ("b", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def sizes(min_bytes: int, max_bytes: int, factor: float) -> list:
    out, size = [], max(1, min_bytes)
    while size <= max_bytes:
        out.append(size)
        nxt = int(size * factor)
        size = nxt if nxt > size else size + 1
    return out


def _impls(op: str, x, ws: int, dtype):
    """[(impl name, zero-arg callable)] for one op on one buffer; the first is the library."""
    import torch

    from graft.kernels.collectives import all_reduce, overlap, all_gather_quantized
    from graft.ops import collectives as C

    if op == "all_reduce":
        return [("library", lambda: C._all_reduce_ref(x)), ("graft", lambda: C.all_reduce(x)),
                ("oneshot", lambda: all_reduce.all_reduce(x, None, "sum", "oneshot")),
                ("twoshot", lambda: all_reduce.all_reduce(x, None, "sum", "twoshot"))]
    if op == "all_gather":
        return [("library", lambda: C._all_gather_ref(x)), ("graft", lambda: C.all_gather(x))]
    if op == "reduce_scatter":
        return [("library", lambda: C._reduce_scatter_ref(x)), ("graft", lambda: C.reduce_scatter(x))]
    if op == "all_gather_quantized":
        return [("library", lambda: C._all_gather_ref(x)), ("int8", lambda: all_gather_quantized.all_gather_int8(x))]
    gen = torch.Generator(device="cpu").manual_seed(1)
    if op == "gemm_reduce_scatter":  # partial sums [M, N] reduce-scattered: x holds M*N values
        m = max(ws, x.numel() // GEMM_N // ws * ws)
        a = torch.randn(m, GEMM_K, generator=gen).to(x.device, dtype)
        b = torch.randn(GEMM_K, GEMM_N, generator=gen).to(x.device, dtype)
        return [("library", lambda: C._gemm_reduce_scatter_ref(a, b)),
                ("overlap", lambda: overlap.gemm_reduce_scatter(a, b))]
    # all_gather_gemm: the gathered a is [ws*m, K]: x holds ws*m*K values
    m = max(2, x.numel() // GEMM_K // ws)
    a = torch.randn(m, GEMM_K, generator=gen).to(x.device, dtype)
    b = torch.randn(GEMM_K, GEMM_N, generator=gen).to(x.device, dtype)
    return [("library", lambda: C._all_gather_gemm_ref(a, b)), ("overlap", lambda: overlap.all_gather_gemm(a, b))]


def _time(fn, iters: int, warmup: int, device) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    timing.sync(device)
    dist.barrier()
    elapsed = torch.tensor([timing.wall_per_call(fn, iters, device)], dtype=torch.float64,
                           device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank defines the collective's time
    return float(elapsed.item())


def _rank_main(rank: int, ws: int, port: int, args, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("GRAFT_DISABLE_PLUGINS", "triton,hip,vllm,deepspeed,megatron")
        import graft

        graft.reload_config()
        if args.backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
            device = torch.device("cpu")
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=args.timeout))
        dtype = getattr(torch, args.dtype)
        es = torch.empty((), dtype=dtype).element_size()
        rows = []
        for op in args.ops:
            for size in sizes(args.min_bytes, args.max_bytes, args.factor):
                count = max(ws, size // es // ws * ws)  # whole elements, divisible by the world size
                per_rank = count // ws if op in ("all_gather", "all_gather_quantized") else count
                x = torch.randn(per_rank, generator=torch.Generator().manual_seed(rank)).to(device, dtype)
                base = None
                for impl, fn in _impls(op, x, ws, dtype):
                    t = _time(fn, args.iters, args.warmup, device)
                    base = t if base is None else base
                    nbytes = count * es
                    algbw = nbytes / t / 1e9
                    rows.append({"op": op, "impl": impl, "size": nbytes, "count": count, "type": args.dtype,
                                 "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](ws),
                                 "vs_library": base / t})
        dist.destroy_process_group()
        queue.put((rank, rows, None))
    except BaseException as exc:
        import traceback

        queue.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _spawn(target, ranks: int, args, timeout: float) -> dict:
    """Run ``target(rank, ranks, port, args, queue)`` on ``ranks`` processes; {rank: result}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, ranks, port, args, queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results: dict = {}
    errors: list = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < ranks and time.monotonic() < deadline:
            try:
                rank, rows, err = queue.get(timeout=1)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    errors.append("a rank exited without a result: " +
                                  ", ".join(f"rank {r}: exit {p.exitcode}" for r, p in enumerate(procs)))
                    break
                continue
            if err:
                errors.append(f"rank {rank}: {err}")
            else:
                results[rank] = rows
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    if errors or 0 not in results:
        raise RuntimeError("benchmark failed:\n" + ("\n".join(errors) or f"timed out after {timeout:.0f} s"))
    return results


def run(args) -> list:
    """Spawn ``args.ranks`` ranks, benchmark, return rank 0's rows."""
    return _spawn(_rank_main, args.ranks, args, args.timeout * 4)[0]


# ----------------------------------------------------------------------------- graft's overhead
OVERHEAD_OPS = ("all_reduce", "all_reduce_", "all_gather", "all_gather_into", "reduce_scatter",
                "reduce_scatter_into")


def _overhead_pairs(x, ws: int):
    """{name: (library call, graft call)} on the same buffers: functional ops against the
    library collective on a fresh output (what a functional collective must allocate),
    in-place ones against the library call on the caller's tensors."""
    import torch.distributed as dist

    from graft.kernels.collectives._common import _all_gather_single as all_gather_single  # torch's own
    from graft.kernels.collectives._common import _reduce_scatter_single as library_reduce_scatter
    from graft.ops import collectives as C

    def reduce_scatter_single(out, inp):
        return library_reduce_scatter(out, inp, op=dist.ReduceOp.SUM)

    n = x.numel()
    gathered, scattered = x.new_empty(ws * n), x.new_empty(n // ws)

    def lib_all_reduce():
        out = x.clone()
        dist.all_reduce(out)
        return out

    def lib_all_gather():
        out = x.new_empty(ws * n)
        all_gather_single(out, x)
        return out

    def lib_reduce_scatter():
        out = x.new_empty(n // ws)
        reduce_scatter_single(out, x)
        return out

    return {
        "all_reduce": (lib_all_reduce, lambda: C.all_reduce(x)),
        "all_reduce_": (lambda: dist.all_reduce(x), lambda: C.all_reduce_(x)),
        "all_gather": (lib_all_gather, lambda: C.all_gather(x)),
        "all_gather_into": (lambda: all_gather_single(gathered, x), lambda: C.all_gather_into(gathered, x)),
        "reduce_scatter": (lib_reduce_scatter, lambda: C.reduce_scatter(x)),
        "reduce_scatter_into": (lambda: reduce_scatter_single(scattered, x),
                                lambda: C.reduce_scatter_into(scattered, x)),
    }


def _overhead_rank(rank: int, ws: int, port: int, args, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("GRAFT_DISABLE_PLUGINS", "triton,hip,vllm,deepspeed,megatron")
        for key in [k for k in os.environ if k.startswith("GRAFT_COLLECTIVES") or k == "GRAFT_BACKENDS"]:
            del os.environ[key]  # graft's torch backend: only graft's own cost is measured
        torch.set_num_threads(1)  # ranks share the cores with gloo's threads
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=args["timeout"]))
        numel = args["numel"] // ws * ws
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        result = {}
        for name, (lib, graft_fn) in _overhead_pairs(x, ws).items():
            for _ in range(args["warmup"]):
                lib()
                graft_fn()
            dist.barrier()
            # Interleaved, alternating which goes first (two variants: the harness's rotation).
            # No barrier per batch (it would add its own noise): every rank runs the same
            # sequence, the collectives couple them.
            times = timing.interleaved({"library": lib, "graft": graft_fn}, rounds=args["rounds"],
                                       inner=args["batch"], warmup=0)
            # Each rank's medians; the slowest rank's count (a collective is as slow as its slowest rank).
            medians = torch.tensor([times["library"], times["graft"]],
                                   dtype=torch.float64)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
            lib_us, graft_us = float(medians[0]) * 1e6, float(medians[1]) * 1e6
            result[name] = {"library_us": lib_us, "graft_us": graft_us, "ratio": graft_us / lib_us}
        dist.destroy_process_group()
        queue.put((rank, result, None))
    except BaseException as exc:
        import traceback

        queue.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def overhead(world_size: int = 2, quick: bool = True, numel: int = 20_000, timeout: float = 120.0) -> dict:
    """graft's collectives against the torch.distributed calls they wrap, on ``world_size``
    gloo ranks of this machine (graft on its torch backend, so only graft's cost counts).

    Measured in one run, interleaved (alternating order per round), medians of per-call
    batch times (each rank's, then the slowest rank's). ``numel`` fp32 values per rank (20k: 80 KB).
    Returns ``{"world_size", "numel", "dtype", "backend", "rounds", "ops": {name:
    {"library_us", "graft_us", "ratio"}}, "max_ratio"}`` with ``ratio = graft / library``
    for ``all_reduce``, ``all_gather``, ``reduce_scatter`` (functional) and ``all_reduce_``,
    ``all_gather_into``, ``reduce_scatter_into`` (in place, what DeepSpeed's comm routes).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # Many short interleaved rounds: a shared machine's noise hits both sides alike and the
    # median discards it (a few long batches would each carry a different share of it).
    params = {"numel": max(numel, world_size), "timeout": timeout, "warmup": 5 if quick else 20,
              "rounds": 151 if quick else 501, "batch": 5}
    ops = _spawn(_overhead_rank, world_size, params, timeout * 2)[0]
    return {"world_size": world_size, "numel": params["numel"] // world_size * world_size, "dtype": "float32",
            "backend": "gloo", "rounds": params["rounds"], "ops": ops,
            "max_ratio": max(v["ratio"] for v in ops.values())}


def format_table(rows: list, args) -> str:
    head = (f"# graft collectives benchmark: {args.ranks} ranks, backend {args.backend}, {args.iters} iters "
            f"({args.warmup} warm-up)\n# absolute numbers are for THIS machine only; compare vs_library "
            f"(library time / this time, same run)\n")
    widths = (21, 9, 12, 11, 9, 12, 12, 12, 12)
    lines = ["".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths))]
    for r in rows:
        cells = (r["op"], r["impl"], r["size"], r["count"], r["type"], f"{r['time_us']:.2f}",
                 f"{r['algbw_GBps']:.4f}", f"{r['busbw_GBps']:.4f}", f"{r['vs_library']:.2f}")
        lines.append("".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    return head + "\n".join(lines)


def parse_args(argv=None):
    import torch

    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m graft.tools.bench.collectives_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1KiB" if not gpu else "8"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256KiB" if not gpu else "512MiB"))
    p.add_argument("--factor", type=float, default=4.0 if not gpu else 2.0)
    p.add_argument("--iters", type=int, default=10 if not gpu else 50)
    p.add_argument("--warmup", type=int, default=2 if not gpu else 10)
    p.add_argument("--ranks", type=int, default=2 if not gpu else torch.cuda.device_count())
    p.add_argument("--backend", choices=("gloo", "nccl"), default="nccl" if gpu else "gloo")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--ops", type=lambda s: [o.strip() for o in s.split(",") if o.strip()], default=list(DEFAULT_OPS))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may take before failing")
    args = p.parse_args(argv)
    unknown = [o for o in args.ops if o not in BUS_FACTOR]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {', '.join(DEFAULT_OPS)}")
    if args.factor <= 1 or args.ranks < 2 or args.min_bytes > args.max_bytes:
        p.error("need --factor > 1, --ranks >= 2 and --min-bytes <= --max-bytes")
    return args


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "overhead":  # python -m graft.tools.bench.collectives_sweep overhead [--ranks N] [--full]
        ranks = int(argv[argv.index("--ranks") + 1]) if "--ranks" in argv else 2
        res = overhead(ranks, quick="--full" not in argv)
        print(f"# graft collectives overhead: {ranks} gloo rank(s), {res['numel']} fp32, medians of "
              f"{res['rounds']} interleaved rounds; ratio = with graft / library")
        for name, r in res["ops"].items():
            print(f"{name:>20} {r['library_us']:10.1f} us {r['graft_us']:10.1f} us {r['ratio']:7.3f}x")
        return 0
    args = parse_args(argv)
    print(format_table(run(args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
