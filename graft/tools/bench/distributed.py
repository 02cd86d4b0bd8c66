"""The multi-process part of ``graft bench overhead``: one process per rank (gloo, CPU), each
running the same sections in the same order; rank 0 prints progress and every rank writes
its results to ``<out>.rank<N>``.

    python -m graft.tools.bench.distributed --sections collectives,deepspeed,megatron --out FILE

(with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; :func:`launch` does that).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

SECTIONS = ("collectives", "deepspeed", "megatron", "torchtitan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(sections, world: int, out: Path, quick: bool, timeout: float, env: dict) -> list:
    """Run ``sections`` on ``world`` local ranks; returns each rank's results (rank 0 first).

    Rank 0's progress goes to this process's stdout; the other ranks' output to
    ``<out>.log<N>``, shown if a rank fails.
    """
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                        # DeepSpeed's CPU accelerator otherwise counts NUMA nodes with a subprocess
                        # on every device_count() call (each ZeRO-3 step): noise for both sides.
                        LOCAL_SIZE=str(world))
        cmd = [sys.executable, "-m", "graft.tools.bench.distributed", "--sections", ",".join(sections), "--out", str(out)]
        if quick:
            cmd.append("--quick")
        log = None if rank == 0 else open(f"{out}.log{rank}", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT if log else None))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    finally:
        for log in logs:
            if log is not None:
                log.close()
    results = []
    for rank, p in enumerate(procs):
        path = Path(f"{out}.rank{rank}")
        if p.returncode == 0 and path.exists():
            results.append(json.loads(path.read_text()))
        else:
            tail = Path(f"{out}.log{rank}").read_text()[-2000:] if rank else ""
            why = "timed out" if p.returncode in (-9, 137) else f"exit code {p.returncode}"
            results.append({"error": f"rank {rank} {why}" + (f":\n{tail}" if tail else "")})
    return results


def _quiet_frameworks() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed", "megatron", "torchtitan", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _quiet_frameworks()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def progress(line):
        if rank == 0:
            print(line, flush=True)

    quick = args.quick
    results: dict = {}
    for section in sections:
        start = time.perf_counter()
        try:
            if section == "collectives":
                from graft.tools.bench import collectives

                from graft.tools.bench import ops

                # Many short barrier-synced rounds: the median per-round ratio resists gloo's
                # stalls (about 2 s in quick mode).
                results[section] = collectives.measure(20_000, rounds=100 if quick else 300, inner=10,
                                                       progress=progress)
                progress("  graft's own cost per collective op (dispatch.call, implementation stubbed):")
                results["collective_ops"] = ops.measure(rounds=15 if quick else 50, inner=10, progress=progress,
                                                        collectives=True, sync=dist.barrier, cold_budget_s=1.0)
            elif section == "deepspeed":
                from graft.tools.bench import deepspeed_step

                results[section] = deepspeed_step.measure(deepspeed_step.RUNS, rounds=20 if quick else 60,
                                                          progress=progress)
            elif section == "megatron":
                from graft.tools.bench import megatron_step

                results[section] = megatron_step.measure((1, 2), rounds=20 if quick else 60, progress=progress)
            elif section == "torchtitan":
                from graft.tools.bench import torchtitan_step

                results[section] = torchtitan_step.measure((1, 2), rounds=20 if quick else 60, progress=progress)
        except Exception as exc:  # a section that fails is reported, the others still run
            results[section] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            progress(f"  {section}: failed: {type(exc).__name__}: {exc}")
        results.setdefault("seconds", {})[section] = time.perf_counter() - start
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
