"""Tile sweep: graft's Triton GEMM launchers timed on this GPU under other rows of the tile
table (:data:`graft.kernels.triton._gemm_common.TILES`), and its prefill attention under other
tiles (:data:`graft.kernels.triton.attention_prefill.TILES`), so that a table change is a
measurement, not a guess::

    python -m graft.tools.bench.tile_sweep --device cuda --out benchmarks --budget-s 90

Each sweep is one case of the kernel benchmark (:mod:`graft.tools.bench.kernels`, same inputs and
baseline) where the benchmark found graft far from the library, and a handful of candidate
rows for the table row that case uses (the current row first). A candidate replaces that row
while its launch is captured in a CUDA graph (the graph keeps the launch's tiles), then all
candidates and the baseline are replayed in interleaved rounds; medians per call. Every
candidate's output is compared with the current row's (a wrong tile fails loudly, not fast).
The report (``tile-sweep-<gpu>.json``) is rewritten after every candidate; sweeps that do
not fit ``--budget-s`` are recorded as skipped. The CPU runs the logic with the interpreter's
tiles (``--quick``: tiny shapes), as the tests do.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from graft.tools.bench import kernels as bench
from graft.tools.bench import timing
from graft.kernels.triton._gemm_common import WARP_SPECIALIZED_TMA_ROW

_T = dict
# (benchmark case, dtype-independent candidate rows for the row that case's M falls in).
# Candidates are chosen from what fits Hopper's 227 KiB of shared memory (fit_shared trims
# stages where not) and from the configurations other Triton GEMMs ship for sm_90.
SWEEPS = (
    ("linear_bf16_m4096_n28672_k4096", (
        # the persistent TMA kernel (the current row on Hopper) against the pointer kernel's rows,
        # the measured 256x128 among them; TMA with 128x128 tiles leaves room for a 4th stage
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=4, TMA=True),
        # its warp-specialised form (a producer warp group for the TMA loads, two consumer groups)
        _T(WARP_SPECIALIZED_TMA_ROW, TMA=True),
        _T(BLOCK_M=128, BLOCK_N=256, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=4),
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=4),
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=256, GROUP_M=8, num_warps=8, num_stages=3),
        _T(BLOCK_M=256, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=3),
        _T(BLOCK_M=64, BLOCK_N=256, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=4),
    )),
    ("fp8_block_m4096_n28672_k4096", (
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=3),
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=4),
        _T(BLOCK_M=64, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=4),
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=4),
    )),
    ("linear_bf16_m16_n6144_k4096", (
        _T(BLOCK_M=16, BLOCK_N=128, K_BYTES=256, GROUP_M=1, num_warps=4, num_stages=4),
        _T(BLOCK_M=16, BLOCK_N=64, K_BYTES=512, GROUP_M=1, num_warps=4, num_stages=3),
        _T(BLOCK_M=16, BLOCK_N=128, K_BYTES=128, GROUP_M=1, num_warps=4, num_stages=6),
    )),
    ("linear_bf16_m128_n6144_k4096", (
        _T(BLOCK_M=64, BLOCK_N=64, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=4),
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=3),
        _T(BLOCK_M=64, BLOCK_N=128, K_BYTES=256, GROUP_M=8, num_warps=4, num_stages=3),
    )),
    # Prefill attention (d=128, causal, 16k tokens): 128-key tiles where they fit. Under Triton
    # 3.6 for sm_90 they take 255 registers (the cap, no spills) and 160 KiB of shared memory at
    # 2 stages, 224 KiB at 3; the current 64-key tile 234 registers, 128 KiB.
    ("ragged_16k", (
        _T(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        _T(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        _T(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    )),
    ("w4a16_gptq_m4096_n28672_k4096", (
        _T(BLOCK_M=128, BLOCK_N=128, K_BYTES=128, GROUP_M=8, num_warps=8, num_stages=4),
        _T(BLOCK_M=64, BLOCK_N=256, K_BYTES=128, GROUP_M=8, num_warps=4, num_stages=4),
        _T(BLOCK_M=128, BLOCK_N=256, K_BYTES=64, GROUP_M=8, num_warps=8, num_stages=4),
    )),
)
QUICK_SWEEPS = (  # the CPU: the interpreter's rows, tiny shapes (the logic, not the speed)
    ("linear_bf16_m33_n64_k96", (_T(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=1, num_stages=1),
                                 _T(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=1, num_stages=1,
                                    TMA=True),
                                 _T(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1,
                                    TMA=True, WARP_SPECIALIZE=True))),
    ("fp8_block_m33_n64_k96", (_T(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=1, num_stages=1),)),
    ("ragged_tiny", (_T(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1),)),
)
FAMILIES = ("gemm", "prefill")  # the benchmark families whose cases a sweep can name


def _row_index(generation: str, m: int) -> int:
    from graft.kernels.triton._gemm_common import TILES

    for i, (max_m, _) in enumerate(TILES[generation]):
        if max_m is None or m <= max_m:
            return i
    raise AssertionError("the last row of a tile table has max_m None")


@contextlib.contextmanager
def tile_row(generation: str, m: int, row: dict | None):
    """The table row used at ``m`` rows replaced by ``row`` for every kernel kind (None:
    unchanged, each kind's own measured row included) while inside. A row with ``TMA: True``
    is the TMA kernel's row (:data:`TMA_TILES`), and lowers its minimum M to ``m`` so it
    serves; any other row turns the TMA kernel off, so the pointer kernel runs it."""
    from graft.kernels.triton import _gemm_common as common

    if row is None:
        yield
        return
    table, kinds = common.TILES[generation], common.KIND_TILES.get(generation)
    tma, min_m = common.TMA_TILES.get(generation), common.TMA_MIN_M
    if row.get("TMA"):
        common.TMA_TILES[generation] = {k: v for k, v in row.items() if k != "TMA"}
        common.TMA_MIN_M = min(min_m, m)
    else:
        i = _row_index(generation, m)
        common.TILES[generation] = table[:i] + ((table[i][0], dict(row)),) + table[i + 1:]  # type: ignore[assignment]
        common.KIND_TILES.pop(generation, None)  # the candidate applies to every kernel kind
        common.TMA_TILES.pop(generation, None)
    common._plan.cache_clear()
    try:
        yield
    finally:
        common.TILES[generation] = table
        if kinds is not None:
            common.KIND_TILES[generation] = kinds
        if tma is not None:
            common.TMA_TILES[generation] = tma
        else:
            common.TMA_TILES.pop(generation, None)
        common.TMA_MIN_M = min_m
        common._plan.cache_clear()


@contextlib.contextmanager
def prefill_row(generation: str, row: dict | None):
    """Prefill attention's tile entry ``generation`` (its ``table_key``) replaced by ``row``
    while inside (None: unchanged). Launches read the table each call (no cache)."""
    from graft.kernels.triton import attention_prefill

    if row is None:
        yield
        return
    table = attention_prefill.TILES
    before = table.get(generation)
    table[generation] = dict(row)
    try:
        yield
    finally:
        if before is not None:
            table[generation] = before
        else:
            table.pop(generation, None)


def _label(row: dict | None) -> str:
    if row is None:
        return "current"
    k = f"K{row['BLOCK_K']}" if "BLOCK_K" in row else f"Kb{row['K_BYTES']}" if "K_BYTES" in row else ""
    tma = " tma" if row.get("TMA") else ""
    tma += " ws" if row.get("WARP_SPECIALIZE") else ""
    return f"{row['BLOCK_M']}x{row['BLOCK_N']}{k} w{row['num_warps']} s{row['num_stages']}{tma}"


def sweep(name: str, rows, device, dtype, rounds: int, report: dict, write) -> None:
    """One sweep into ``report["sweeps"][name]`` (``write()`` after every candidate)."""
    import torch

    from graft.kernels.triton import gemm_linear
    from graft.kernels.triton._gemm_common import TILES, generation_of

    cases = {c.name: c for c in bench.all_cases(list(FAMILIES), device.type == "cpu", {"triton"})}
    case = cases[name]
    if case.family == "prefill":
        from graft.kernels.triton import attention_prefill
        from graft.kernels.triton._autotune import table_key

        generation = table_key(attention_prefill.TILES, device)  # the entry the launches read
        shared_row = dict(attention_prefill.TILES[generation])

        def in_place(row):
            return prefill_row(generation, row)
    else:
        generation = generation_of(device)
        m = case.params["M"]
        shared_row = dict(TILES[generation][_row_index(generation, m)][1])

        def in_place(row):
            return tile_row(generation, m, row)
    entry = report["sweeps"].setdefault(name, {"params": case.params, "generation": generation,
                                               "shared_row": shared_row, "candidates": {}, "status": "running"})
    graft, baselines = case.build(device, dtype)
    if "graft:triton" not in graft:
        entry.update(status="error", note="no Triton implementation serves this case here")
        write()
        return
    fn = graft["graft:triton"]
    runners, reference = {}, None
    for row in (None, *rows):
        label = _label(row)
        failed_before = dict(gemm_linear._tma_failed)
        try:
            with in_place(row):
                run, inner, mode, out = timing.prepare(fn, device, device.type == "cuda")
            if gemm_linear._tma_failed != failed_before:
                # The TMA kernel did not compile or launch and the pointer kernel ran in its place
                # (logged): not this row's time. Forgotten, so that the next TMA rows are tried.
                why = next(v for k, v in gemm_linear._tma_failed.items() if failed_before.get(k) != v)
                gemm_linear._tma_failed.clear()
                gemm_linear._tma_failed.update(failed_before)
                raise RuntimeError(f"the TMA kernel failed ({why}); the pointer kernel ran in its place")
            diff = 0.0 if reference is None else bench._max_rel_diff(out, reference)
            reference = out if reference is None else reference
            runners[label] = (run, inner)
            entry["candidates"][label] = {"row": row, "mode": mode, "max_rel_diff_vs_current": diff, "samples_s": []}
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or launch is a result
            entry["candidates"][label] = {"row": row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        write()
    for label, fn_base in baselines.items():
        try:
            run, inner, mode, _ = timing.prepare(fn_base, device, device.type == "cuda")
            runners[f"baseline {label}"] = (run, inner)
            entry["candidates"][f"baseline {label}"] = {"mode": mode, "samples_s": []}
        except Exception as exc:  # noqa: BLE001
            entry["candidates"][f"baseline {label}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        break  # the first baseline: the library the case replaces
    if runners:
        timing.device_rounds(runners, rounds, device,
                             into={label: entry["candidates"][label]["samples_s"] for label in runners})
    current = timing.median(entry["candidates"]["current"]["samples_s"]) if "current" in runners else None
    for label in runners:
        c = entry["candidates"][label]
        c["median_s"] = timing.median(c["samples_s"])
        if current:
            c["speedup_vs_current"] = current / c["median_s"]
    timed = {k: v for k, v in entry["candidates"].items() if "median_s" in v and not k.startswith("baseline")
             and (v.get("max_rel_diff_vs_current") or 0.0) < 2e-2}
    if timed:
        best = min(timed, key=lambda k: timed[k]["median_s"])
        entry["best"] = best
        base = [v for k, v in entry["candidates"].items() if k.startswith("baseline") and "median_s" in v]
        if base:
            entry["best_vs_baseline"] = base[0]["median_s"] / timed[best]["median_s"]
            entry["current_vs_baseline"] = base[0]["median_s"] / current if current else None
    entry["status"] = "ok"
    del runners, reference, graft, baselines
    bench.release(device)
    write()


def run(args) -> int:
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = bench.environment(device)
    tag = args.tag or ("cpu-quick" if device.type == "cpu" else
                       "".join(ch if ch.isalnum() else "-" for ch in env.get("gpu", "gpu").lower()).strip("-"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tile-sweep-{tag}.json")
    report: dict = {"environment": env, "sweeps": {},
              "how_to_read": "per sweep: median seconds per call of graft's Triton launcher with each candidate row "
                             "of the tile table in place of the current one (CUDA graph replays, interleaved "
                             "rounds), speedup_vs_current = current / candidate, best_vs_baseline = library / best"}

    def write():
        bench._write_atomic(path, json.dumps(report, indent=1, default=str))

    sweeps = QUICK_SWEEPS if args.quick else SWEEPS
    dtype = getattr(torch, args.dtype)
    start, longest = time.perf_counter(), 0.0
    for i, (name, rows) in enumerate(sweeps, 1):
        elapsed = time.perf_counter() - start
        if elapsed + longest > args.budget_s:
            report["sweeps"][name] = {"status": "skipped", "note": f"budget {args.budget_s:.0f}s: {elapsed:.0f}s spent"}
            write()
            continue
        t0 = time.perf_counter()
        try:
            sweep(name, rows, device, dtype, args.rounds, report, write)
        except Exception as exc:  # noqa: BLE001 - the next sweep still runs
            report["sweeps"].setdefault(name, {})["status"] = "error"
            report["sweeps"][name]["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            write()
        longest = max(longest, time.perf_counter() - t0)
        e = report["sweeps"][name]
        times = ", ".join(f"{k} {v['speedup_vs_current']:.2f}x" for k, v in e.get("candidates", {}).items()
                          if "speedup_vs_current" in v and k != "current" and not k.startswith("baseline"))
        vs = f"; vs library: current {e['current_vs_baseline']:.2f}x, best {e['best_vs_baseline']:.2f}x" \
            if e.get("best_vs_baseline") and e.get("current_vs_baseline") else ""
        print(f"[{i}/{len(sweeps)} {time.perf_counter() - start:4.0f}s] {e.get('status')} {name}: best "
              f"{e.get('best', '-')}; vs current: {times}{vs}", flush=True)
    print(f"wrote {path}", flush=True)
    return 0 if any(e.get("status") == "ok" for e in report["sweeps"].values()) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft.tools.bench.tile_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when a GPU is visible) or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes, the interpreter's rows: the logic only")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--budget-s", type=float, default=90.0, help="a sweep starts only if the longest so far fits")
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--tag", default=None)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
