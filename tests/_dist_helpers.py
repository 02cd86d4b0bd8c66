"""Run a function on N torch.distributed ranks (gloo on 127.0.0.1) with a hard timeout.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initialises a gloo
process group over loopback on a free port, calls ``fn(rank, world_size, *args)`` and
returns each rank's result (rank order). If any rank raises, the test fails with every
rank's traceback; if the ranks do not all finish within ``timeout`` seconds (a hang on a
collective, say) every rank is killed and the test fails naming the ranks still running.
``fn`` must be a module-level function (the spawn start method pickles it by name).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT = 90.0
# Collectives inside ranks give up well before the launcher does, so a mismatch shows up
# as an exception text rather than as a kill.
PG_TIMEOUT = timedelta(seconds=30)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, env, args, results, pg_timeout=PG_TIMEOUT):
    os.environ.update(env)
    import graft

    graft.reload_config()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share few cores
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=pg_timeout
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None,
              pg_timeout: timedelta = PG_TIMEOUT) -> list:
    """``[fn(0, n, *args), ..., fn(n-1, n, *args)]``, each run on its own rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Ranks load only the adapters collectives need: faster start, no unrelated kernels.
    rank_env = {"GRAFT_LOG_LEVEL": "WARNING", "GRAFT_DISABLE_PLUGINS": "triton,hip,vllm,deepspeed,megatron"}
    rank_env.update(env or {})
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, rank_env, args, results, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcomes[rank] = (status, value)
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) will never answer.
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                for r in dead:
                    outcomes[r] = ("error", f"rank {r} exited with code {procs[r].exitcode} without a result")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
    missing = [r for r in range(world_size) if r not in outcomes]
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors or missing:
        text = [f"--- rank {r} raised:\n{v}" for r, v in sorted(errors.items())]
        if missing:
            text.append(f"--- rank(s) {missing} did not finish within {timeout:.0f} s and were killed")
        raise AssertionError(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(text))
    return [outcomes[r][1] for r in range(world_size)]

